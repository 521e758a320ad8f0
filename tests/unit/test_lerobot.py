"""The LeRobot reader on the three sample layouts: metadata, columns, cameras, instructions, bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.lerobot import LeRobotDataset, ParquetImageFrames, VideoFrames

DROID_COLUMNS = ["observation.state", "action"]
LIBERO_COLUMNS = ["state", "actions"]


def test_droid_v21_layout(droid_root):
    ds = LeRobotDataset(droid_root)
    assert ds.version == "v2.1" and ds.fps == 15 and len(ds) == 4
    assert [ds.episode_info(i).length for i in ds.episode_indices] == [192, 62, 97, 133]
    assert list(ds.modality.video) == ["exterior_image_1_left", "exterior_image_2_left", "wrist_image_left"]
    assert {k: (e.start, e.end) for k, e in ds.modality.state.items()} == {
        "cartesian_position": (0, 6),
        "gripper_position": (6, 7),
        "joint_position": (7, 14),
    }
    assert ds.modality.action["joint_position"].original_key == "action"  # modality.json default
    assert (ds.modality.action["joint_position"].start, ds.modality.action["gripper_position"].start) == (14, 12)
    assert ds.tasks[0] == "not provided"
    assert ds.camera_shape("observation.images.wrist_image_left") == (180, 320, 3)

    episode = ds.episode(0, DROID_COLUMNS)
    assert episode.columns["observation.state"].shape == (192, 14)
    assert episode.columns["observation.state"].dtype == np.float64
    assert episode.columns["action"].shape == (192, 28)
    assert set(episode.cameras) == set(ds.modality.video)
    assert all(isinstance(s, VideoFrames) for s in episode.cameras.values())
    joints = episode.slice(ds.modality.state["joint_position"])
    np.testing.assert_array_equal(joints, episode.columns["observation.state"][:, 7:14])
    # Actions are next-step targets in the sample data: action.joint_position[t] == state.joint_position[t+1].
    np.testing.assert_allclose(episode.slice(ds.modality.action["joint_position"])[:-1], joints[1:])

    cols = sorted(episode.annotations)
    assert cols == [f"annotation.language.language_instruction{s}" for s in ("", "_2", "_3")]
    assert all(len(v) == 192 for v in episode.annotations.values())
    second = [ds.episode(i).instructions["annotation.language.language_instruction_2"] for i in ds.episode_indices]
    assert "not provided" in second and any(s != "not provided" for s in second)
    assert all(t in ds.tasks.values() for t in episode.instructions.values())


def test_libero_v20_images_in_parquet(libero_root):
    ds = LeRobotDataset(libero_root)
    assert ds.version == "v2.0" and ds.fps == 10 and len(ds) == 4
    assert ds.modality.video == {"image": "image", "wrist_image": "wrist_image"}  # inferred: no modality.json
    assert list(ds.modality.state) == ["state"] and ds.modality.state["state"].dim == 8
    assert list(ds.modality.action) == ["actions"] and ds.modality.action["actions"].dim == 7
    episode = ds.episode(1, LIBERO_COLUMNS)
    assert episode.length == 47
    assert episode.columns["state"].dtype == np.float32 and episode.columns["state"].shape == (47, 8)
    assert episode.columns["actions"].shape == (47, 7)
    assert isinstance(episode.cameras["image"], ParquetImageFrames)
    frames = episode.cameras["wrist_image"].read([0, 46, 3])
    assert frames.shape == (3, 256, 256, 3) and frames.dtype == np.uint8
    assert list(episode.instructions) == ["task_index"]
    assert episode.instructions["task_index"] in ds.tasks.values()


def test_libero_v3_same_content_as_v2(libero_root, libero_v3_root):
    v2, v3 = LeRobotDataset(libero_root), LeRobotDataset(libero_v3_root)
    assert v3.version == "v3.0" and v3.episode_indices == v2.episode_indices
    # Episodes share files in v3: 3 per parquet file, 2 per mp4 file.
    assert len({v3.episode_info(i).data_path for i in v3.episode_indices}) == 2
    assert len({v3.episode_info(i).video_paths["image"] for i in v3.episode_indices}) == 2
    for i in v2.episode_indices:
        a, b = v2.episode(i, LIBERO_COLUMNS), v3.episode(i, LIBERO_COLUMNS)
        assert a.length == b.length
        for c in LIBERO_COLUMNS:
            np.testing.assert_array_equal(a.columns[c], b.columns[c])
        assert a.instructions["task_index"] == b.instructions["task_index"]
        # Frame k of the v3 mp4 (lossy) is the PNG frame k (lossless), not a neighbour: alignment incl. v3 offsets.
        png = a.cameras["image"].read().astype(np.int16)
        mp4 = b.cameras["image"].read().astype(np.int16)
        err = np.abs(png - mp4).mean(axis=(1, 2, 3))
        assert err.max() < 6, err.max()
        neighbour = np.abs(png[1:] - mp4[:-1]).mean(axis=(1, 2, 3))
        assert (err[1:] < neighbour).mean() > 0.9


def test_missing_meta_and_bad_version(tmp_path, droid_root):
    with pytest.raises(DatasetError, match="meta/info.json is missing"):
        LeRobotDataset(tmp_path)
    root = tmp_path / "ds"
    shutil.copytree(droid_root, root)
    info = json.loads((root / "meta/info.json").read_text())
    info["codebase_version"] = "v1.6"
    (root / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(DatasetError, match=r"info.json: codebase_version 'v1.6' is not one of"):
        LeRobotDataset(root)


def test_bad_parquet_errors_name_file_and_episode(tmp_path, droid_root):
    root = tmp_path / "ds"
    shutil.copytree(droid_root, root)
    ds = LeRobotDataset(root)
    path = ds.episode_info(3).data_path

    table = pq.read_table(path)
    state = np.stack(table.column("observation.state").to_numpy(zero_copy_only=False))
    state[5, 2] = np.nan
    index = table.column_names.index("observation.state")
    pq.write_table(table.set_column(index, "observation.state", pa.array(state.tolist())), path)
    with pytest.raises(DatasetError) as err:
        ds.episode(3, DROID_COLUMNS)
    assert str(err.value) == f"{path}: episode 3: column 'observation.state' holds NaN or inf"

    pq.write_table(table.slice(0, 100), path)
    with pytest.raises(DatasetError, match=r"episode 3: parquet has 100 rows, meta says length 133"):
        ds.episode(3, DROID_COLUMNS)

    path.unlink()
    with pytest.raises(DatasetError, match=rf"{path}: episode 3: parquet file is missing"):
        ds.episode(3)
    with pytest.raises(DatasetError, match="episode 99: no such episode"):
        ds.episode(99)


def test_v3_video_span_mismatch(tmp_path, libero_v3_root):
    root = tmp_path / "ds"
    shutil.copytree(libero_v3_root, root)
    meta = root / "meta/episodes/chunk-000/file-000.parquet"
    rows = pq.read_table(meta).to_pylist()
    rows[2]["videos/wrist_image/to_timestamp"] -= 0.5  # 5 frames short at 10 fps
    pq.write_table(pa.Table.from_pylist(rows), meta)
    with pytest.raises(DatasetError, match=r"episode 2: video span holds 68 frames, episode has 73 rows"):
        LeRobotDataset(root).episode(2)


def test_sample_dataset_refuses_no_workers(tmp_path):
    from devtools.sample_data import write_sample_dataset

    with pytest.raises(ValueError, match="workers must be at least 1"):
        write_sample_dataset(tmp_path / "x", "libero", workers=0)


def test_an_episode_listed_twice_is_refused_when_the_dataset_opens(droid_root, tmp_path):
    import re
    from pathlib import Path

    from wampipe.preprocess.lerobot import LeRobotDataset

    src = Path(shutil.copytree(droid_root, tmp_path / "src"))
    listing = src / "meta" / "episodes.jsonl"
    lines = listing.read_text().splitlines()
    listing.write_text("\n".join([*lines, lines[2]]) + "\n")
    with pytest.raises(DatasetError, match=f"^{re.escape(str(listing))}: episode 2: listed twice$"):
        LeRobotDataset(src)


def _info(key, value):
    return lambda root: _edit_json(root / "meta/info.json", lambda info: info.__setitem__(key, value))


def _edit_json(path, edit):
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def _episode_rows(edit):
    def apply(root):
        path = root / "meta/episodes.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        edit(rows[1])
        path.write_text("\n".join(map(json.dumps, rows)) + "\n")

    return apply


@pytest.mark.parametrize(
    "malform, names, says",
    [
        (_info("fps", "ten"), "meta/info.json", "fps 'ten' is not a positive float"),
        (_info("chunks_size", 0), "meta/info.json", "chunks_size 0 is not a positive int"),
        (_info("data_path", "data/{nope}.parquet"), "meta/info.json", "data_path 'data/{nope}.parquet': unknown field"),
        (lambda root: (root / "meta/info.json").write_text("[1, 2]"), "meta/info.json", "a JSON list, not an object"),
        (
            _episode_rows(lambda row: row.pop("episode_index")),
            "meta/episodes.jsonl",
            "line 2: no whole 'episode_index'",
        ),
        (
            _episode_rows(lambda row: row.__setitem__("length", "abc")),
            "meta/episodes.jsonl",
            "episode 1: length 'abc' is not a whole number",
        ),
        (
            lambda root: _edit_json(root / "meta/info.json", lambda i: i["features"]["action"].pop("dtype")),
            "meta/info.json",
            "feature 'action' has no dtype",
        ),
        (
            lambda root: (root / "meta/tasks.jsonl").write_bytes(b"\xff\xfe\x00bad"),
            "meta/tasks.jsonl",
            "unreadable JSON lines",
        ),
        (
            lambda root: _edit_json(root / "meta/info.json", lambda i: i.pop("video_path")),
            "meta/info.json",
            "'video_path' is missing",
        ),
    ],
    ids=["fps", "chunks_size", "data_path", "info_list", "no_index", "length", "dtype", "tasks_utf8", "video_path"],
)
def test_malformed_metadata_is_one_line_naming_the_file(malform, names, says, droid_root, tmp_path):
    """Each of these was a traceback; now one DatasetError naming the file (and episode) when the dataset opens."""
    from pathlib import Path

    from wampipe.preprocess.lerobot import LeRobotDataset

    src = Path(shutil.copytree(droid_root, tmp_path / "src"))
    malform(src)
    with pytest.raises(DatasetError) as err:
        LeRobotDataset(src)
    assert str(err.value).startswith(f"{src / names}: ") and says in str(err.value), str(err.value)
