"""Two nodes on this host: two torchrun agents (`--nnodes 2 --node-rank {0,1}`, c10d rendezvous, one gloo process
each) train the tiny recipe, stop at a checkpoint, resume, and log the losses of one 2-process torchrun run."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from wampipe.train.checkpoint import complete_checkpoints
from tests.helpers import ROOT

pytestmark = pytest.mark.slow
STEPS, STOP = 6, 3


def _trainer(shards: Path, run_dir: Path) -> list[str]:
    return [
        str(ROOT / "train" / "main.py"),
        "--preset",
        "tiny",
        "--data.shards",
        str(shards),
        "--checkpoint.dir",
        str(run_dir),
        "--steps",
        str(STEPS),
        "--checkpoint.interval",
        str(STOP),
        "--metrics.interval",
        "1",
        "--metrics.no-progress",
        "--metrics.no-tensorboard",
        "--parallel.deterministic",
        "--checkpoint.no-export",
    ]


def _torchrun(*options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *options]


def _run_all(commands: list[list[str]]) -> None:
    """Start every command, then wait for all (the timeout only detects a hang)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd in commands
    ]
    try:
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-3000:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_two_nodes_train_checkpoint_and_resume_as_one_node_of_two(tiny_shards, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    _run_all([_torchrun("--standalone", "--nproc-per-node", "2", *_trainer(tiny_shards, single))])
    for stop in (["--stop-after", str(STOP)], []):  # stop at the checkpoint, then resume from it to the end
        port = _free_port()
        _run_all(
            [
                _torchrun(
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--nproc-per-node",
                    "1",
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-conf",
                    f"is_host={node == 0}",
                    *_trainer(tiny_shards, multi),
                    *stop,
                )
                for node in (0, 1)
            ]
        )
        assert [step for step, _ in complete_checkpoints(multi)][-1] == (STEPS if not stop else STOP)
    assert _losses(multi) == _losses(single)
    assert [json.loads((multi / f"summary-rank{r:05d}.json").read_text())["last_step"] for r in range(2)] == [STEPS] * 2
