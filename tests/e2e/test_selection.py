"""Episode and frame selection (preprocess.selection): DreamZero's DROID filters re-stated from the official code and
compared with what the build keeps, the cut episodes as every stage sees them, and bad filter inputs in one line.

The sample data is the raw DROID layout of devtools/sample_data.py (`raw_plan`): idle stretches with openpi-style
keep ranges, a failed episode, repeated, missing and one-character instructions, an idle-only episode."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.helpers import (
    DROID_KEY,
    ROOT,
    build,
    manifest,
    official_filters,
    official_rows,
    official_selection,
    select_episodes,
    shards_cmd,
    write_ranges,
)
from wampipe.errors import UsageError
from wampipe.preprocess.windows import episode_windows
from wampipe.shardformat.embodiments import get_embodiment


# ---------------------------------------------------------------- bad filter inputs: one line each


# ---------------------------------------------------------------- the build (end to end)


@pytest.fixture(scope="module")
def raw_shards(tmp_path_factory, raw_root, ranges_file, tiny_checkpoints) -> Path:
    out = tmp_path_factory.mktemp("raw_shards") / "droid"
    build(raw_root, out, "droid", tiny_checkpoints, "--official-filters", "--keep-ranges", str(ranges_file))
    return out


def cut_columns(root: Path, episode: int, rows: np.ndarray) -> tuple[dict, dict]:
    """The embodiment's state and action sub-keys of a recorded episode cut to `rows`, from the files directly."""
    emb, modality = get_embodiment("oxe_droid"), json.loads((root / "meta/modality.json").read_text())
    table = pq.read_table(root / f"data/chunk-000/episode_{episode:06d}.parquet")
    columns = {c: np.stack(table.column(c).to_pylist())[rows] for c in ("observation.state", "action")}

    def sub(kind: str, column: str, keys) -> dict:
        return {k: columns[column][:, modality[kind][k]["start"] : modality[kind][k]["end"]] for k in keys}

    return sub("state", "observation.state", emb.state_keys), sub("action", "action", emb.action_keys)


@pytest.mark.e2e
def test_the_build_holds_the_official_windows_and_records_the_selection(raw_shards, raw_root, ranges_file):
    from wampipe.preprocess.state_action import window_state_action
    from wampipe.preprocess.windows import window_at
    from wampipe.shardformat.files import sha256_file
    from wampipe.shardformat.index import ShardIndex, ShardReader
    from wampipe.shardformat.keys import sample_key

    emb = get_embodiment("oxe_droid")
    expected = {e: official_rows(r) for e, r in official_selection(raw_root, ranges_file).items()}
    stride = 16  # conftest FAST's --anchor-stride
    keys = {
        sample_key("droid", e, w.start, 0): (e, w)
        for e, rows in expected.items()
        for w in episode_windows(len(rows), emb.window, stride)
    }
    reader = ShardReader(ShardIndex(raw_shards))
    table = reader.index.table
    stored = {table.key(row): row for row in range(len(table))}
    assert set(stored) == set(keys)
    crossing = 0
    for key, (episode, window) in keys.items():
        meta, tensors = reader.raw_row(stored[key])
        rows = expected[episode]
        states, actions = cut_columns(raw_root, episode, rows)
        state, action = window_state_action(states, actions, window_at(meta["window_start"], emb.window), emb)
        np.testing.assert_array_equal(np.asarray(tensors["state"]), state, err_msg=key)
        np.testing.assert_array_equal(np.asarray(tensors["action"]), action, err_msg=key)
        crossing += bool(np.any(np.diff(rows[window.video_rows]) > 1))
    assert crossing >= 2  # windows across a seam, where the official conversion makes them

    m = manifest(raw_shards)
    assert m["selection"]["counts"] == select_episodes(raw_root, official_filters(ranges_file)).counts
    assert m["selection"]["filters"] == {
        "keep_ranges": {"path": str(ranges_file), "sha256": sha256_file(ranges_file), "key": DROID_KEY},
        "drop_failed": {"reward_field": "next.reward"},
        "require_language": "official",
    }
    assert m["totals"]["episodes_encoded"] == 3 and m["source"]["episodes"] == 3
    # statistics over the kept rows only
    kept_joints = np.concatenate([cut_columns(raw_root, e, rows)[0]["joint_position"] for e, rows in expected.items()])
    statistics = json.loads((raw_shards / "metadata.json").read_text())["oxe_droid"]["statistics"]
    np.testing.assert_allclose(
        statistics["state"]["joint_position"]["mean"], kept_joints.astype(np.float32).mean(0), rtol=1e-6
    )
    np.testing.assert_allclose(statistics["state"]["joint_position"]["min"], kept_joints.min(0), rtol=1e-6)


@pytest.mark.e2e
def test_a_rerun_with_another_keep_ranges_file_is_refused_in_one_line(
    raw_shards, raw_root, ranges_file, tiny_checkpoints, tmp_path
):
    from wampipe.shardformat.files import sha256_file

    changed = json.loads(ranges_file.read_text())
    changed[next(iter(changed))] = [[0, 100]]
    other = write_ranges(tmp_path, changed)
    before = sorted(p.name for p in raw_shards.rglob("*"))
    done = subprocess.run(
        shards_cmd(raw_root, raw_shards, "droid", tiny_checkpoints, "--official-filters", "--keep-ranges", str(other)),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"{raw_shards} holds a build made from other inputs: --keep-ranges: sha256 {sha256_file(ranges_file)[:12]} "
            f"-> sha256 {sha256_file(other)[:12]}."
        )
    )
    assert sorted(p.name for p in raw_shards.rglob("*")) == before


@pytest.mark.e2e
def test_preview_shows_the_recorded_frames_a_kept_window_came_from(raw_shards, raw_root, ranges_file, tmp_path):
    from wampipe.preprocess.preview import episode_cut, source_frames
    from wampipe.preprocess.windows import Window, window_at
    from wampipe.shardformat.manifest import Manifest

    emb, m = get_embodiment("oxe_droid"), Manifest.read(raw_shards)
    cut = episode_cut(raw_root, m, 7, None)
    assert cut == ((0, 30), (70, 180))
    window = window_at(16, emb.window)  # kept rows 16..112: across the seam after kept row 29
    frames = source_frames(raw_root, emb, 7, window, (90, 160), cut)
    recorded = official_rows([[0, 30], [70, 180]])[window.video_rows]
    assert recorded[0] == 16 and recorded[-1] == 112 + 40
    at_recorded_rows = Window(0, 1, recorded, window.action_rows, window.state_rows)  # of the whole episode
    np.testing.assert_array_equal(frames, source_frames(raw_root, emb, 7, at_recorded_rows, (90, 160)))
    moved = ranges_file.with_name("moved.json")
    moved.write_bytes(ranges_file.read_bytes())
    ranges_file.rename(tmp_path / "away.json")
    try:
        with pytest.raises(UsageError, match=r"--src: the build cut its episodes to the keep ranges of .*missing"):
            episode_cut(raw_root, m, 7, None)
        assert episode_cut(raw_root, m, 7, moved) == cut
    finally:
        (tmp_path / "away.json").rename(ranges_file)
