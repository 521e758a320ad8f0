"""End to end: `torchrun --nproc-per-node=2 train/main.py --preset tiny` on CPU (gloo) over synthetic shards.

One uninterrupted run, and one run preempted with SIGTERM, resumed, killed with SIGKILL and resumed again, all in
deterministic mode: the loss falls, the interrupted run logs exactly the uninterrupted rows (one per step), both
ranks take the same number of steps over uneven shards, no rank outlives a SIGKILLed torchrun, and the exported
weights load back strictly. A resume with more --steps continues the cosine from its step.
"""

import gzip
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from wampipe.train.checkpoint import complete_checkpoints
from wampipe.train.config import OptimConfig
from wampipe.train.planning.memory import ModelSize, Plan, offload_traffic
from wampipe.train.dit.model import build_model
from wampipe.train.optim import lr_factor, warmup_steps
from wampipe.train.dit.weights import load_weights
from tests.helpers import ROOT, TRAINER_STEPS, descendants, metric_rows, trainer_command, trainer_env

pytestmark = pytest.mark.slow


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the rows logged so far (while the run writes, its last line may be torn)."""
    out = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        out[record["step"]] = record["loss"]
    return out


@pytest.fixture(scope="module")
def full_run(tiny_shards, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run_full")
    subprocess.run(
        trainer_command(tiny_shards, run_dir), check=True, env=trainer_env(), cwd=ROOT, capture_output=True, timeout=600
    )
    return run_dir


def test_loss_falls_and_ranks_take_equal_steps(full_run):
    losses = _losses(full_run)
    assert sorted(losses) == list(range(1, TRAINER_STEPS + 1))
    values = [losses[s] for s in sorted(losses)]
    assert sum(values[-8:]) / 8 < 0.9 * sum(values[:8]) / 8
    summaries = [json.loads((full_run / f"summary-rank{r:05d}.json").read_text()) for r in range(2)]
    assert [s["steps"] for s in summaries] == [TRAINER_STEPS, TRAINER_STEPS]
    assert [s["next_batch"] for s in summaries] == [TRAINER_STEPS, TRAINER_STEPS]
    assert summaries[0]["epoch"] == 2  # 40 anchor-weighted visits = 10 micro-batches per epoch and rank
    assert [s for s, _ in complete_checkpoints(full_run)] == [8, 16, 24]


def test_exported_weights_load_back_strictly(full_run):
    path = full_run / "export" / "model.safetensors"
    model = build_model("tiny")
    fresh = model.head.head.weight.detach().clone()
    report = load_weights(model, path, source="export")
    assert report.initialised == [] and report.loaded == len(model.state_dict())
    assert not torch.equal(model.head.head.weight, fresh)  # zero-initialised head moved during training


def _start(shards: Path, run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        trainer_command(shards, run_dir),
        env=trainer_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while max(_losses(run_dir), default=0) < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
        except OSError:
            pass
    return alive


def test_sigterm_sigkill_and_resume_reproduce_the_losses(tiny_shards, full_run, tmp_path):
    run_dir = tmp_path / "run"
    # SIGTERM to torchrun (as a scheduler sends before preemption): both ranks save the step they are at, exit cleanly
    proc = _start(tiny_shards, run_dir)
    _wait_for_step(proc, run_dir, 10)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    preempted_at = max(_losses(run_dir))
    assert complete_checkpoints(run_dir)[-1][0] == preempted_at > 10  # not the interval's step 8
    summaries = [json.loads((run_dir / f"summary-rank{r:05d}.json").read_text()) for r in range(2)]
    assert [(s["preempted"], s["last_step"]) for s in summaries] == [(True, preempted_at)] * 2

    # SIGKILL to torchrun only: its ranks (own sessions) must die with it, loader workers after them
    proc = _start(tiny_shards, run_dir)
    _wait_for_step(proc, run_dir, 18)
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(workers), "processes of the killed run still running"
    assert complete_checkpoints(run_dir)[-1][0] == 16 and max(_losses(run_dir)) > 16

    subprocess.run(
        trainer_command(tiny_shards, run_dir), check=True, env=trainer_env(), cwd=ROOT, capture_output=True, timeout=600
    )
    assert [(r["step"], r["loss"]) for r in metric_rows(run_dir)] == [
        (r["step"], r["loss"]) for r in metric_rows(full_run)
    ]


def test_resume_with_more_steps_continues_the_cosine_without_warmup(tiny_shards, full_run, tmp_path):
    """Also without --data.shards: the trainer reads `make shards`' output, shards/droid of the working directory."""
    shutil.copytree(tiny_shards, tmp_path / "shards" / "droid")
    run_dir = tmp_path / "run"
    shutil.copytree(full_run, run_dir)
    cmd = trainer_command(None, run_dir) + ["--steps", "40", "--stop-after", "2"]
    subprocess.run(cmd, check=True, env=trainer_env(), cwd=tmp_path, capture_output=True, timeout=600)
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, TRAINER_STEPS + 3))
    warmup = warmup_steps(OptimConfig(warmup_ratio=0.05), TRAINER_STEPS)  # fixed when the run started
    # the first resumed step runs at the new curve's lr over 40 steps, not at the finished run's last lr (0)
    assert [r["lr"] for r in rows[TRAINER_STEPS:]] == pytest.approx([1e-2 * lr_factor(s, warmup, 40) for s in (24, 25)])
    assert rows[TRAINER_STEPS]["lr"] > 0.3e-2


def test_reducing_after_every_micro_batch_offloading_and_gathering_once_train_the_same(tiny_shards, tmp_path):
    """Gradient accumulation over 2 micro-batches per rank, the gradients reduce-scattered once per step (unsharded
    fp32 accumulation, the default) or after every micro-batch (sharded accumulation): the same run up to the
    order of fp32 sums. The latter with the fp32 state offloaded to host memory (the same unfused AdamW; on CPU
    ranks the copies are the only difference, and the gradient norm's collective runs on host tensors): bit for bit
    the same run. Gathering the parameters once per step instead of once per micro-batch: the default's run bit for
    bit (the same gathered values), with one all-gather per FSDP unit in a profiled step instead of two."""
    runs = {}
    for name, extra in [
        ("per_step", []),
        ("per_micro_batch", ["--parallel.reduce-every-micro-batch"]),
        ("offloaded", ["--parallel.reduce-every-micro-batch", "--parallel.cpu-offload", "--optim.fused", "False"]),
        ("gathered_once", ["--parallel.no-reshard-after-forward", "--parallel.gather-once-per-step"]),
        ("gathered_per_micro_batch", ["--parallel.no-reshard-after-forward"]),
    ]:
        run_dir = tmp_path / name
        cmd = [
            *trainer_command(tiny_shards, run_dir),
            "--steps",
            "6",
            "--checkpoint.interval",
            "0",
            "--checkpoint.no-save-final",
            "--checkpoint.no-export",
            "--parallel.param-dtype",
            "float32",
            "--parallel.global-batch-size",
            "8",
            "--parallel.backend",
            "gloo",  # CPU ranks, also on a GPU host
            *extra,
        ]  # tiny: micro-batch 2 x 2 ranks x accum 2
        if name.startswith("gathered") or name == "offloaded":  # step 4 profiled: its collectives are in the trace
            cmd += ["--metrics.profile-start", "3", "--metrics.profile-steps", "1"]
        done = subprocess.run(cmd, check=True, env=trainer_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert ("fp32 state in host memory" in done.stdout) == (name == "offloaded")
        runs[name] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_step, per_micro = runs["per_step"], runs["per_micro_batch"]
    assert [r["step"] for r in per_step] == [r["step"] for r in per_micro] == list(range(1, 7))
    for a, b in zip(per_step, per_micro):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-4
        )
    assert per_step[0]["loss"] == per_micro[0]["loss"]  # the first forward sees the same weights bit for bit
    # ... but not the same sums: the flag took effect (a no-op would give the default's bits)
    assert [r["grad_norm"] for r in per_step] != [r["grad_norm"] for r in per_micro]
    assert [(r["loss"], r["grad_norm"]) for r in runs["offloaded"]] == [(r["loss"], r["grad_norm"]) for r in per_micro]
    for name in ("gathered_once", "gathered_per_micro_batch"):
        assert [(r["loss"], r["grad_norm"]) for r in runs[name]] == [(r["loss"], r["grad_norm"]) for r in per_step]
    # ... and the trainer gathered each FSDP unit (2 blocks and the root) once in the step, not once per micro-batch
    gathers = {}
    for name in ("gathered_once", "gathered_per_micro_batch"):
        with gzip.open(tmp_path / name / "trace-rank0.json.gz", "rt") as f:
            gathers[name] = sum(e.get("name") == "c10d::_allgather_base_" for e in json.load(f)["traceEvents"])
    assert gathers == {"gathered_once": 3, "gathered_per_micro_batch": 6}
    # offloaded, resharding after forward: each micro-batch gathers the first block and the root twice (forward,
    # backward) and the last block once, and reduce-scatters each unit once: what offload_traffic counts as copies
    with gzip.open(tmp_path / "offloaded" / "trace-rank0.json.gz", "rt") as f:
        names = [e.get("name") for e in json.load(f)["traceEvents"]]
    size = ModelSize(params=30, trainable=30, block_params=10, blocks=2, tokens=1, dim=1)  # 2 blocks, a root of 10
    copied_in, copied_out = offload_traffic(size, Plan("none", 2, True, True, 2, 1, cpu_offload=True))
    assert (names.count("c10d::_allgather_base_"), names.count("c10d::_reduce_scatter_base_")) == (10, 6)
    assert (copied_in, copied_out) == (4 * 100, 4 * 60)  # 10 unit-gathers of 10 parameters, 6 reduces of 10
    assert all(r["cpu_optimizer_s"] > 0 for r in runs["offloaded"]) and "cpu_optimizer_s" not in per_step[0]
