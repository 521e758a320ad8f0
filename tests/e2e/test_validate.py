"""The validation loss (train/validate.py) under real torchrun (gloo, CPU) on shards the CLI built with a validation
split: logged with its step's metrics row at every --metrics.val-interval and at the end, the same bits after a
preemption and resume, and for the same weights on one rank or two (torchrun train/validate.py on the run's
checkpoint), per set of a mixture too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow
VAL = ("val_loss", "val_loss_dynamics", "val_loss_action")


@pytest.fixture(scope="session")
def val_shards(held_out_3) -> Path:
    """The sample DROID dataset with episode 3 (3 samples) held out: 7 training samples, 3 validation samples."""
    return held_out_3


def torchrun(script: str, ranks: int, *args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(ROOT / "train" / script),
        "--preset",
        "tiny",
        "--parallel.deterministic",
        "--metrics.val-batch",
        "2",
        *args,
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def train(shards: Path, run_dir: Path, *args: str) -> None:
    torchrun(
        "main.py",
        2,
        "--data.shards",
        str(shards),
        "--checkpoint.dir",
        str(run_dir),
        "--steps",
        "4",
        "--checkpoint.interval",
        "2",
        "--metrics.interval",
        "1",
        "--metrics.val-interval",
        "2",
        "--metrics.no-progress",
        "--metrics.no-tensorboard",
        "--checkpoint.no-export",
        *args,
    )


def rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def full_run(val_shards, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("val_run") / "full"
    train(val_shards, run_dir)
    return run_dir


def test_validation_fields_at_the_interval_and_the_end(full_run):
    logged = rows(full_run)
    assert sorted(logged) == [1, 2, 3, 4]  # one row per step: validation joins its step's row
    assert [s for s, r in logged.items() if set(VAL) <= r.keys()] == [2, 4]
    assert not any(k.startswith("val_") for s in (1, 3) for k in logged[s])
    assert all(0 < logged[s][k] < float("inf") for s in (2, 4) for k in VAL)
    assert logged[2]["val_loss"] != logged[4]["val_loss"]  # the weights moved in between


def test_a_resumed_run_logs_the_same_validation_loss(full_run, val_shards, tmp_path):
    run_dir = tmp_path / "interrupted"
    train(val_shards, run_dir, "--stop-after", "2")
    assert set(VAL) <= rows(run_dir)[2].keys()  # the end of the shortened run
    train(val_shards, run_dir)  # resumes at step 2
    full, resumed = rows(full_run), rows(run_dir)
    assert [resumed[s][k] for s in (2, 4) for k in VAL] == [full[s][k] for s in (2, 4) for k in VAL]


def evaluate(ranks: int, run_dir: Path, *data: str) -> dict:
    done = torchrun("validate.py", ranks, *data, "--checkpoint.dir", str(run_dir))
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_same_weights_give_the_same_loss_on_one_rank_or_two(full_run, val_shards, tmp_path):
    logged = {k: rows(full_run)[4][k] for k in VAL}  # trained on 2 ranks
    one = evaluate(1, full_run, "--data.shards", str(val_shards))
    two = evaluate(2, full_run, "--data.shards", str(val_shards))
    assert one.pop("val_s") > 0 and two.pop("val_s") > 0  # the seconds it took
    assert one == two == {"step": 4, **logged}
    # the split named explicitly: the same number
    given = evaluate(1, full_run, "--data.shards", str(val_shards), "--metrics.val-shards", str(val_shards / "val"))
    assert {k: given[k] for k in VAL} == logged
    # a mixture of the set and its copy: each set's own loss, the same as the set's alone
    copy = shutil.copytree(val_shards, tmp_path / "droid")
    mixed = evaluate(1, full_run, "--data.mixture", str(val_shards), str(copy))
    assert {mixed["val_loss/droid-0"], mixed["val_loss/droid-1"], mixed["val_loss"]} == {logged["val_loss"]}


def test_bad_validation_flags_are_one_line(tmp_path):
    from wampipe.errors import UsageError
    from wampipe.train.config import parse_args

    argv = [
        "--data.shards",
        str(tmp_path),
        "--metrics.val-interval",
        "-1",
        "--metrics.val-samples",
        "0",
        "--metrics.val-batch",
        "-2",
    ]
    with pytest.raises(
        UsageError,
        match=r"^invalid settings: --metrics.val-interval -1 \(must be >= 0\); "
        r"--metrics.val-samples 0 \(must be >= 1\); --metrics.val-batch -2 "
        r"\(must be >= 1 or auto\)$",
    ):
        parse_args(argv)
