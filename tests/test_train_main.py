"""End to end: `torchrun --nproc-per-node=2 train/main.py --preset tiny` on CPU (gloo) over synthetic shards.

One uninterrupted run and one run killed with SIGKILL and resumed, both in deterministic mode: the loss falls, the
resumed run reproduces the uninterrupted losses exactly, both ranks take the same number of steps over uneven shards
(25 windows: one rests each epoch, the last shard holds 4 samples), and the exported weights load back strictly.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_train_data import synthetic
from train.checkpoint import complete_checkpoints
from train.model import build_model
from train.weights import load_weights

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
STEPS = 24


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train_shards") / "tiny"
    synthetic.make_synthetic_shards(out, "tiny", episodes=5, windows_per_episode=5, samples_per_shard=7, seed=1)
    return out


def _command(shards: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(ROOT / "train" / "main.py"), "--preset", "tiny", "--data.shards", str(shards),
            "--checkpoint.dir", str(run_dir), "--steps", str(STEPS), "--checkpoint.interval", "8",
            "--metrics.interval", "1", "--metrics.no-progress", "--metrics.no-tensorboard",
            "--parallel.deterministic", "--checkpoint.export-dtype", "float32"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (before a kill and after the resume) keeps its last value."""
    out = {}
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                out[record["step"]] = record["loss"]
    return out


@pytest.fixture(scope="module")
def full_run(shards, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run_full")
    subprocess.run(_command(shards, run_dir), check=True, env=_env(), cwd=ROOT, capture_output=True, timeout=600)
    return run_dir


def test_loss_falls_and_ranks_take_equal_steps(full_run):
    losses = _losses(full_run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    values = [losses[s] for s in sorted(losses)]
    assert sum(values[-8:]) / 8 < 0.9 * sum(values[:8]) / 8
    summaries = [json.loads((full_run / f"summary-rank{r:05d}.json").read_text()) for r in range(2)]
    assert [s["steps"] for s in summaries] == [STEPS, STEPS]
    assert [s["next_batch"] for s in summaries] == [STEPS, STEPS]
    assert summaries[0]["epoch"] == 4  # 6 micro-batches per epoch and rank: the run crossed 4 epoch ends
    assert [s for s, _ in complete_checkpoints(full_run)] == [8, 16, 24]


def test_exported_weights_load_back_strictly(full_run):
    path = full_run / "export" / "model.safetensors"
    model = build_model("tiny")
    fresh = model.head.head.weight.detach().clone()
    report = load_weights(model, path, source="export")
    assert report.initialised == [] and report.loaded == len(model.state_dict())
    assert not torch.equal(model.head.head.weight, fresh)  # zero-initialised head moved during training


def test_sigkill_and_resume_reproduce_the_losses(shards, full_run, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_command(shards, run_dir), env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while max(_losses(run_dir), default=0) < 10 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = max(_losses(run_dir))
    assert killed_at < STEPS and complete_checkpoints(run_dir)[-1][0] == 8
    subprocess.run(_command(shards, run_dir), check=True, env=_env(), cwd=ROOT, capture_output=True, timeout=600)
    assert _losses(run_dir) == _losses(full_run)
