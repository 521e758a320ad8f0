"""The recipes of configs/: one name means the same data shapes in both halves, `--config` layering (preset < file <
flags) in both CLIs, one-line errors, and a run directory's config.yaml that reproduces the run's losses exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wampipe import configs
from devtools.synthetic import make_synthetic_shards

from tests.helpers import ROOT


def _train(*argv: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "train" / "main.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_a_runs_saved_config_reproduces_its_losses(tmp_path):
    make_synthetic_shards(tmp_path / "shards", "tiny", episodes=4, windows_per_episode=4, seed=2)
    first, again = tmp_path / "first", tmp_path / "again"
    _train(
        "--preset",
        "tiny",
        "--data.shards",
        str(tmp_path / "shards"),
        "--checkpoint.dir",
        str(first),
        "--steps",
        "6",
        "--seed",
        "3",
        "--optim.lr",
        "3e-3",
        "--data.seed",
        "5",
        "--metrics.interval",
        "1",
        "--metrics.no-tensorboard",
        "--metrics.no-progress",
        "--parallel.deterministic",
        "--checkpoint.no-export",
    )
    _train("--config", str(first / "config.yaml"), "--checkpoint.dir", str(again))
    assert len(_losses(first)) == 6 and _losses(again) == _losses(first)
    saved = [configs.read(run / "config.yaml")["train"] for run in (first, again)]
    for run, cfg in zip((first, again), saved):
        assert cfg["checkpoint"].pop("dir") == str(run)
    assert saved[1].pop("config") == str(first / "config.yaml") and saved[0].pop("config") is None
    assert saved[0] == saved[1]
