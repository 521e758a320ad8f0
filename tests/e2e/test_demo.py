"""`make demo`'s steps at a tiny size, each a real process whose stderr holds nothing but progress bars: a sample
dataset written by its script, shards built (the session's builds) and checked, a 2-rank torchrun of the tiny recipe
on a weighted mixture, the curves plotted. A warning, a library-load message or a traceback in any step fails it."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, unexpected

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # the Makefile's thread setting


def quiet(*argv: str) -> str:
    """Run `argv` from the checkout; fail on an error or on any stderr line beyond progress bars. Returns stdout."""
    done = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)  # detects a hang
    assert done.returncode == 0, done.stderr[-3000:]
    assert unexpected(done.stderr) == [], argv[:4]
    return done.stdout


@pytest.mark.slow
def test_the_demo_prints_only_progress_on_stderr(droid_shards, libero_shards, tmp_path):
    quiet(
        sys.executable,
        "scripts/make_sample_dataset.py",
        "--layout",
        "libero",
        "--out",
        str(tmp_path / "libero-src"),
        "--episodes",
        "2",
        "--seed",
        "0",
    )
    # the session's builds of both sample datasets (`build` in tests/conftest.py) kept their stderr beside them
    for shards in (droid_shards, libero_shards):
        assert unexpected((shards.parent / "build-stderr.txt").read_text()) == []
    libero = libero_shards
    for shards in (droid_shards, libero):
        quiet(sys.executable, "-m", "preprocess", "check", str(shards))
    run_dir = tmp_path / "run"
    quiet(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "train/main.py",
        "--preset",
        "tiny",
        "--data.mixture",
        f"{droid_shards}=0.7",
        f"{libero}=0.3",
        "--checkpoint.dir",
        str(run_dir),
        "--steps",
        "4",
        "--metrics.interval",
        "2",
        "--checkpoint.no-export",
    )
    assert "wrote" in quiet(sys.executable, "scripts/plot_metrics.py", str(run_dir))
    assert (run_dir / "metrics.png").is_file()
