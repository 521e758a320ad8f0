"""Frame decoding: torchcodec and PyAV give identical frames; bad videos give clear errors."""

from __future__ import annotations

import shutil

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from devtools.sample_data import write_sample_dataset
from wampipe.preprocess.decode import BACKENDS, decode_video
from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.lerobot import LeRobotDataset


def window_rows(start: int) -> np.ndarray:
    return start + 3 * np.arange(33)  # DROID's 33 video frames at stride 3


@pytest.fixture(scope="module")
def av1_root(tmp_path_factory):
    return write_sample_dataset(tmp_path_factory.mktemp("data") / "droid_av1", "droid", episodes=2, seed=1, codec="av1")


@pytest.mark.parametrize("layout", ["droid", "libero_v3", "droid_av1"])
def test_backends_return_identical_frames(layout, request):
    root = request.getfixturevalue(
        {"droid": "droid_root", "libero_v3": "libero_v3_root", "droid_av1": "av1_root"}[layout]
    )
    ds = LeRobotDataset(root)
    for index in ds.episode_indices:
        episode = ds.episode(index)
        for camera, source in episode.cameras.items():
            whole = {b: source.read(backend=b) for b in BACKENDS}
            assert whole["torchcodec"].shape == (episode.length, *ds.camera_shape(ds.modality.video[camera]))
            assert whole["torchcodec"].dtype == np.uint8
            np.testing.assert_array_equal(whole["torchcodec"], whole["pyav"])
            last_start = episode.length - 97
            for start in sorted({0, last_start // 2, last_start}) if last_start >= 0 else []:
                rows = window_rows(start)
                for backend in BACKENDS:
                    np.testing.assert_array_equal(source.read(rows, backend=backend), whole["torchcodec"][rows])


def test_any_order_and_repeats(droid_root):
    source = LeRobotDataset(droid_root).episode(0).cameras["wrist_image_left"]
    whole = source.read()
    rows = [50, 2, 2, 191, 0]
    for backend in BACKENDS:
        np.testing.assert_array_equal(source.read(rows, backend=backend), whole[rows])


def copy_dataset(src, tmp_path):
    root = tmp_path / "ds"
    shutil.copytree(src, root)
    return LeRobotDataset(root)


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_video(tmp_path, droid_root, backend):
    ds = copy_dataset(droid_root, tmp_path)
    path = ds.episode_info(2).video_paths["observation.images.exterior_image_2_left"]
    episode = ds.episode(2)
    path.unlink()
    with pytest.raises(DatasetError) as err:
        episode.cameras["exterior_image_2_left"].read(backend=backend)
    assert str(err.value) == f"{path}: episode 2: video file is missing"
    with pytest.raises(DatasetError, match=r"episode 2: video for camera 'exterior_image_2_left' is missing"):
        ds.episode(2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_video(tmp_path, droid_root, backend):
    ds = copy_dataset(droid_root, tmp_path)
    path = ds.episode_info(1).video_paths["observation.images.wrist_image_left"]
    path.write_bytes(b"\x00not an mp4\x00" * 100)
    with pytest.raises(DatasetError) as err:
        ds.episode(1).cameras["wrist_image_left"].read(backend=backend)
    assert str(err.value).startswith(f"{path}: episode 1: cannot decode video ({backend}):")


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_video(tmp_path, droid_root, backend):
    """A video that holds fewer frames than the episode's parquet rows."""
    ds = copy_dataset(droid_root, tmp_path)
    path = ds.episode_info(2).video_paths["observation.images.exterior_image_1_left"]
    frames = ds.episode(2).cameras["exterior_image_1_left"].read()[:80]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=15)
        stream.width, stream.height, stream.pix_fmt = 320, 180, "yuv420p"
        for img in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode())
    source = ds.episode(2).cameras["exterior_image_1_left"]
    with pytest.raises(DatasetError) as err:
        source.read(backend=backend)
    assert str(err.value).startswith(f"{path}: episode 2: short video:")
    with pytest.raises(DatasetError, match="short video: 80 frames in the file, the episode needs 97"):
        source.read(range(5), backend=backend)  # the file is checked as a whole, not only the rows asked for


@pytest.mark.parametrize("backend", BACKENDS)
def test_timestamp_mismatch(tmp_path, droid_root, backend):
    """Parquet timestamps that do not match the video's frame times (e.g. a 30 fps table over a 15 fps video)."""
    ds = copy_dataset(droid_root, tmp_path)
    path = ds.episode_info(3).data_path
    table = pq.read_table(path)
    stretched = (np.arange(table.num_rows) / 15 * 1.01).astype(np.float32)
    table = table.set_column(table.column_names.index("timestamp"), "timestamp", pa.array(stretched))
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match=r"episode 3: frame \d+ has timestamp .* the parquet row expects"):
        ds.episode(3).cameras["wrist_image_left"].read(backend=backend)


def test_unknown_backend(droid_root):
    path = LeRobotDataset(droid_root).episode_info(0).video_paths["observation.images.wrist_image_left"]
    with pytest.raises(ValueError, match="unknown decode backend 'decord'"):
        decode_video(path, [0], backend="decord")
