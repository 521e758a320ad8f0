"""metadata.json statistics against a direct numpy computation on the sample datasets."""

import json

import numpy as np
import pytest

from wampipe.preprocess.__main__ import main
from wampipe.preprocess.stats import build_metadata, merge_metadata
from wampipe.shardformat.embodiments import get_embodiment
from tests.helpers import assert_good_episode_statistics, corrupt_droid, parquet_columns, direct, assert_stats


def test_droid_statistics(droid_root):
    meta = build_metadata([droid_root], get_embodiment("oxe_droid"))
    assert list(meta) == ["oxe_droid"]
    m = meta["oxe_droid"]
    assert list(m) == ["statistics", "modalities", "embodiment_tag"] and m["embodiment_tag"] == "oxe_droid"
    state_eps, action_eps = parquet_columns(droid_root, "observation.state"), parquet_columns(droid_root, "action")
    state = np.concatenate(state_eps).astype(np.float32)
    action = np.concatenate(action_eps).astype(np.float32)
    assert_stats(m["statistics"]["state"]["joint_position"], direct(state[:, 7:14]))
    assert_stats(m["statistics"]["state"]["gripper_position"], direct(state[:, 6:7]))
    assert_stats(m["statistics"]["action"]["gripper_position"], direct(action[:, 12:13]))
    assert_stats(m["statistics"]["action"]["cartesian_velocity"], direct(action[:, 6:12]))
    # relative joint statistics: action[i + k] - state[i], k < 24, i + 24 <= L, pooled over all episodes
    relative = [
        a[i + k, 14:21] - s[i, 7:14]
        for s, a in zip(state_eps, action_eps)
        for i in range(len(s) - 23)
        for k in range(24)
    ]
    assert_stats(m["statistics"]["action"]["joint_position"], direct(np.array(relative)))
    assert set(m["statistics"]["action"]) == {
        "cartesian_position",
        "cartesian_velocity",
        "gripper_position",
        "gripper_velocity",
        "joint_position",
        "joint_velocity",
    }
    video = m["modalities"]["video"]
    assert list(video) == ["exterior_image_1_left", "exterior_image_2_left", "wrist_image_left"]
    assert video["wrist_image_left"] == {"resolution": [320, 180], "channels": 3, "fps": 15.0}  # [width, height]
    assert m["modalities"]["state"]["joint_position"] == {
        "absolute": True,
        "rotation_type": None,
        "shape": [7],
        "continuous": True,
    }


def test_libero_statistics(libero_root):
    m = build_metadata([libero_root], get_embodiment("libero_sim"))["libero_sim"]
    state = np.concatenate(parquet_columns(libero_root, "state")).astype(np.float32)
    actions = np.concatenate(parquet_columns(libero_root, "actions")).astype(np.float32)
    assert_stats(m["statistics"]["state"]["state"], direct(state))
    assert_stats(m["statistics"]["action"]["actions"], direct(actions))
    assert m["modalities"]["video"]["image"] == {"resolution": [256, 256], "channels": 3, "fps": 10.0}
    assert m["modalities"]["action"]["actions"]["shape"] == [7]


def test_relative_episode_sampling_matches_reference(droid_root):
    """With more episodes than the cap, the episodes come from default_rng(42).choice, as the official code."""
    emb = get_embodiment("oxe_droid")
    capped = build_metadata([droid_root], emb, max_relative_episodes=2)["oxe_droid"]["statistics"]["action"]
    chosen = np.random.default_rng(42).choice(4, size=2, replace=False)
    state_eps = parquet_columns(droid_root, "observation.state")
    action_eps = parquet_columns(droid_root, "action")
    relative = [
        action_eps[e][i + k, 14:21] - state_eps[e][i, 7:14]
        for e in chosen
        for i in range(len(state_eps[e]) - 23)
        for k in range(24)
    ]
    assert_stats(capped["joint_position"], direct(np.array(relative)))


def test_merge_equals_pooled_moments():
    rng = np.random.default_rng(0)
    a, b = rng.normal(1.0, 2.0, size=(100, 3)), rng.normal(-1.0, 0.5, size=(300, 3))

    def part(x):
        stats = {k: v.tolist() for k, v in direct(x).items()}
        return {
            "statistics": {"state": {"s": stats}, "action": {"a": stats}},
            "modalities": {"video": {}},
            "embodiment_tag": "t",
        }

    merged = merge_metadata([part(a), part(b)], np.array([100.0, 300.0]), ["a", "b"])["statistics"]["state"]["s"]
    both = np.concatenate([a, b])
    np.testing.assert_allclose(merged["mean"], both.mean(0), rtol=1e-12)
    np.testing.assert_allclose(merged["std"], both.std(0), rtol=1e-10)
    np.testing.assert_allclose(merged["min"], both.min(0))
    np.testing.assert_allclose(merged["max"], both.max(0))
    np.testing.assert_allclose(merged["q01"], np.minimum(direct(a)["q01"], direct(b)["q01"]))
    np.testing.assert_allclose(merged["q99"], np.maximum(direct(a)["q99"], direct(b)["q99"]))


def test_wrong_embodiment_is_a_clear_error(libero_root):
    from wampipe.preprocess.errors import DatasetError

    with pytest.raises(DatasetError, match="joint_position"):
        build_metadata([libero_root], get_embodiment("oxe_droid"))


def test_stats_cli_reports_and_leaves_out_bad_episodes(droid_root, tmp_path, capsys):
    src = corrupt_droid(droid_root, tmp_path / "bad")
    out = tmp_path / "metadata.json"
    main(["stats", "--src", str(src), "--embodiment", "oxe_droid", "--out", str(out)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped")]
    assert lines == [
        f"skipped {src / 'data/chunk-000/episode_000000.parquet'}: episode 0: column 'observation.state' "
        f"holds NaN or inf",
        f"skipped {src / 'data/chunk-000/episode_000003.parquet'}: episode 3: parquet has 123 rows, meta "
        f"says length 133",
    ]
    assert_good_episode_statistics(json.loads(out.read_text()), src, [1, 2])
