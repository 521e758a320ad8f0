"""One odd episode is that episode's recorded failure, never the end of a build: a camera at another frame size, a
state column narrower than modality.json takes, a state stored as scalars, a value finite in float64 but not in
float32 and timestamps that are all NaN each leave their episode out with its reason; the build finishes, `check`
accepts it and it trains. `--fail-fast` stops at the first instead."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from devtools.sample_data import write_sample_dataset
from wampipe.preprocess.check import check
from wampipe.preprocess.decode import encode_mp4
from tests.helpers import ROOT, manifest, shards_cmd

STATE = "observation.state"
pytestmark = pytest.mark.e2e  # builds and trains through the CLI


def rewrite_state(path, edit) -> None:
    table = pq.read_table(path)
    i = table.schema.get_field_index(STATE)
    values = edit(table.column(i).to_pylist())
    table = table.set_column(i, pa.field(STATE, pa.array(values).type), pa.array(values))
    pq.write_table(table, path)


@pytest.fixture(scope="module")
def odd_droid(tmp_path_factory):
    """The sample DROID layout with 8 episodes (188, 75, 97, 130, 125, 187, 193, ... rows): 2-5 and 7 each odd in
    one way, 1 shorter than a window, 0 and 6 sound."""
    root = write_sample_dataset(tmp_path_factory.mktemp("odd") / "droid", "droid", episodes=8, seed=3)
    info = [json.loads(line) for line in (root / "meta/episodes.jsonl").read_text().splitlines()]
    data = root / "data/chunk-000"
    wrist = root / "videos/chunk-000/observation.images.wrist_image_left/episode_000002.mp4"
    length = info[2]["length"]
    encode_mp4(wrist, np.random.default_rng(0).integers(0, 255, (length, 96, 128, 3), np.uint8), 15, "h264")
    rewrite_state(data / "episode_000003.parquet", lambda rows: [r[:7] for r in rows])
    rewrite_state(data / "episode_000004.parquet", lambda rows: [r[0] for r in rows])
    rewrite_state(data / "episode_000005.parquet", lambda rows: [[*r[:8], 1e39, *r[9:]] for r in rows])
    table = pq.read_table(data / "episode_000007.parquet")  # timestamps all NaN: no frame could be checked
    i = table.schema.get_field_index("timestamp")
    nan = pa.array(np.full(table.num_rows, np.nan, table.column(i).type.to_pandas_dtype()))
    pq.write_table(table.set_column(i, table.schema.field(i), nan), data / "episode_000007.parquet")
    return root


def test_each_odd_episode_is_a_recorded_failure_and_the_build_trains(odd_droid, tiny_checkpoints, tmp_path):
    out = tmp_path / "shards"
    done = subprocess.run(
        shards_cmd(odd_droid, out, "droid", tiny_checkpoints), cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reasons = {f["episode"]: f["reason"] for f in manifest(out)["failures"]}
    assert sorted(reasons) == [2, 3, 4, 5, 7]
    assert "cameras differ in frame size" in reasons[2] and "wrist_image_left 96x128" in reasons[2]
    assert reasons[3].startswith(
        f"{odd_droid / 'data/chunk-000/episode_000003.parquet'}: episode 3: column '{STATE}' has shape ["
    )
    assert reasons[4].startswith(f"{odd_droid / 'data/chunk-000/episode_000004.parquet'}: episode 4: ")
    assert reasons[5].endswith(f"column '{STATE}' holds NaN or inf")
    assert reasons[7] == (
        f"{odd_droid / 'data/chunk-000/episode_000007.parquet'}: episode 7: column 'timestamp' holds NaN or inf"
    )
    assert all("\n" not in r for r in reasons.values())
    for episode in reasons:
        assert f"FAILED episode {episode}: " in done.stdout
    assert manifest(out)["totals"]["samples"] > 0 and check(out) == []

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            str(ROOT / "train" / "main.py"),
            "--preset",
            "tiny",
            "--data.shards",
            str(out),
            "--checkpoint.dir",
            str(tmp_path / "run"),
            "--steps",
            "2",
            "--checkpoint.no-export",
            "--metrics.no-tensorboard",
            "--metrics.no-progress",
            "--data.micro-batch-size",
            "1",
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_fail_fast_stops_at_the_first_odd_episode(odd_droid, tiny_checkpoints, tmp_path):
    src = shutil.copytree(odd_droid, tmp_path / "src")
    done = subprocess.run(
        shards_cmd(src, tmp_path / "shards", "droid", tiny_checkpoints, "--fail-fast"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and any(f": episode {e}: " in last for e in (2, 3, 4, 5)), done.stderr[-2000:]
    assert not (tmp_path / "shards" / "manifest.json").exists()


def run_build(src, out, tiny, *extra):
    return subprocess.run(
        shards_cmd(src, out, "droid", tiny, *extra), cwd=ROOT, capture_output=True, text=True, timeout=900
    )


def test_a_build_without_any_sample_stops_in_one_line_with_the_counts(droid_root, tiny_checkpoints, tmp_path):
    """Every episode's parquet shorter than meta/ says: one line with the counts and a reason, before the text
    encoder is loaded for prompts there are none of; no manifest."""
    src = Path(shutil.copytree(droid_root, tmp_path / "src"))
    for path in (src / "data/chunk-000").glob("*.parquet"):
        pq.write_table(pq.read_table(path).slice(0, 10), path)
    done = run_build(src, tmp_path / "shards", tiny_checkpoints)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert last.startswith(f"cannot finalize {tmp_path / 'shards'}: no episode gave a sample (4 failed, e.g. ")
    assert "parquet has 10 rows, meta says length" in last
    assert not (tmp_path / "shards" / "manifest.json").exists()


def test_an_encoder_that_outputs_nan_stops_the_build_in_one_line(droid_root, tiny_checkpoints, tmp_path):
    import torch

    tiny = Path(shutil.copytree(tiny_checkpoints, tmp_path / "tiny"))
    vae = tiny / "wan2.2" / "Wan2.2_VAE.pth"
    weights = torch.load(vae, weights_only=True)
    first = next(k for k, v in weights.items() if v.is_floating_point() and v.ndim > 1)
    weights[first] = torch.full_like(weights[first], float("nan"))
    torch.save(weights, vae)
    done = run_build(droid_root, tmp_path / "shards", tiny, "--max-episodes", "1")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert last.startswith("the encoders' latents of a batch of ") and last.endswith(
        "hold NaN or inf (as bf16): check the VAE's weights and --dtype"
    )
    assert not (tmp_path / "shards" / "manifest.json").exists()


def test_parquet_image_cells_of_mixed_sizes_are_their_episodes_failure(libero_root, tiny_checkpoints, tmp_path):
    """LIBERO stores its frames as PNG cells of the parquet: one episode whose cells change size mid-episode is that
    episode's failure, naming the file, the camera column and both sizes; the others build."""
    import io

    from PIL import Image

    src = Path(shutil.copytree(libero_root, tmp_path / "src"))
    path = src / "data/chunk-000/episode_000000.parquet"
    table = pq.read_table(path)
    i = table.schema.get_field_index("image")
    cells = table.column(i).to_pylist()
    small = io.BytesIO()
    Image.fromarray(np.zeros((128, 128, 3), np.uint8)).save(small, format="PNG")
    for row in range(1, len(cells), 2):
        cells[row] = {"bytes": small.getvalue(), "path": cells[row]["path"]}
    pq.write_table(table.set_column(i, table.schema.field(i), pa.array(cells, table.schema.field(i).type)), path)
    out = tmp_path / "shards"
    done = subprocess.run(
        shards_cmd(src, out, "libero", tiny_checkpoints), cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (failure,) = manifest(out)["failures"]
    assert failure["episode"] == 0 and failure["reason"].startswith(
        f"{path}: episode 0: column 'image': image cells of different sizes: 256x256 at row "
    )
    assert ", 128x128 at row " in failure["reason"] and check(out) == []
