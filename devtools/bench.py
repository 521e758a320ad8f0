"""Running the real trainer for a benchmark: its flags, synthetic shards of a recipe's shapes, the measured window
of its metrics.jsonl and the result line (scripts/bench_train.py, scripts/check_fp8_parity.py)."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from wampipe import configs
from devtools import synthetic
from wampipe.shardformat.layout import MANIFEST
from wampipe.train.config import Config
from wampipe.train.parallel import computes_on_cuda

MAIN = Path(__file__).resolve().parents[1] / "train" / "main.py"


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """A script's own flags (before `--`) and those it passes to the trainer unchanged (after it)."""
    if "--" not in argv:
        return list(argv), []
    cut = argv.index("--")
    return list(argv[:cut]), list(argv[cut + 1 :])


def trainer_argv(args, shards: Path, run_dir: Path, extra: list[str]) -> list[str]:
    """train/main.py flags: the bench's settings, a metrics interval that puts the warm-up in records of its own,
    no checkpoints or export, then the pass-through flags (which win)."""
    total = args.warmup_steps + args.steps
    interval = math.gcd(args.warmup_steps, args.steps) if args.warmup_steps else args.steps
    argv = [
        "--preset",
        args.preset,
        "--data.shards",
        str(shards),
        "--checkpoint.dir",
        str(run_dir),
        "--steps",
        str(total),
        "--metrics.interval",
        str(interval),
        "--metrics.no-progress",
        "--metrics.no-tensorboard",
        "--checkpoint.interval",
        "0",
        "--checkpoint.no-save-final",
        "--checkpoint.no-export",
        "--checkpoint.no-resume",
    ]
    if args.micro_batch is not None:
        argv += ["--data.micro-batch-size", str(args.micro_batch)]
    if args.global_batch is not None:
        argv += ["--parallel.global-batch-size", str(args.global_batch)]
    if args.ac is not None:
        argv += ["--parallel.activation-checkpoint", args.ac]
    if args.compile is not None:
        argv += ["--parallel.compile" if args.compile else "--parallel.no-compile"]
    return argv + extra


def trainer_device(cfg: Config) -> torch.device:
    """The device the trainer's rank 0 trains on (train/runtime.py setup_distributed): what auto settings size by."""
    return torch.device("cuda", 0) if computes_on_cuda(cfg.parallel) else torch.device("cpu")


def check_same_resolution(cfg: Config, run_dir: Path) -> None:
    """The trainer resolved the auto settings as this process did for the bound (its config.yaml says)."""
    path = run_dir / "config.yaml"
    theirs, ours = configs.read(path)["train"], asdict(cfg)
    parts = [
        ("parallel", "activation_checkpoint"),
        ("data", "micro_batch_size"),
        ("parallel", "reshard_after_forward"),
        ("parallel", "ac_blocks"),
        ("parallel", "ac_others"),
        ("parallel", "reduce_every_micro_batch"),
        ("parallel", "gather_once_per_step"),
    ]
    differ = [f"{g}.{k} {theirs[g][k]} (here {ours[g][k]})" for g, k in parts if theirs[g][k] != ours[g][k]]
    if differ:
        raise SystemExit(f"{path}: the trainer resolved other settings than the bound uses: {'; '.join(differ)}")


def write_shards(cfg: Config, preset: str, shards: Path, windows: int) -> None:
    """At least `windows` synthetic windows of the preset's shapes (an existing shard directory is reused)."""
    if (shards / MANIFEST).is_file():
        have = json.loads((shards / MANIFEST).read_text()).get("totals", {}).get("samples", 0)
        note = f" (fewer than the {windows} this run reads: windows repeat)" if have < windows else ""
        print(f"reusing {shards}: {have} samples{note}", flush=True)
        return
    per_episode = 8
    episodes = max(1, math.ceil(windows / per_episode))
    t0 = time.perf_counter()
    manifest = synthetic.make_synthetic_shards(
        shards,
        preset,
        episodes=episodes,
        windows_per_episode=per_episode,
        samples_per_shard=32,
        episodes_per_unit=4,
        seed=cfg.seed,
    )
    print(
        f"wrote {manifest['totals']['samples']} synthetic {preset} samples ({manifest['totals']['bytes'] / 2**30:.2f}"
        f" GiB) to {shards} in {time.perf_counter() - t0:.0f} s",
        flush=True,
    )


def run_trainer(args, argv: list[str], run_dir: Path) -> float:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        str(MAIN),
        *argv,
    ]
    print("trainer:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise SystemExit(f"trainer failed with exit status {done.returncode} (its log is above)")
    return time.perf_counter() - t0


def measured_window(run_dir: Path, warmup_steps: int, samples_per_rank_step: int) -> dict:
    """Aggregate the metrics.jsonl records after the warm-up: rates over the summed time, not a mean of rates."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # the training rows (the open-loop action error logs rows of its own)
    measured = [r for r in records if r["step"] > warmup_steps and "samples_per_s_per_gpu" in r]
    if not measured:
        raise SystemExit(f"{path}: no record after step {warmup_steps}")
    steps, seconds, wait_s, flops_s, host_s = 0, 0.0, 0.0, 0.0, 0.0
    prev = warmup_steps
    for r in measured:
        n = r["step"] - prev
        prev = r["step"]
        elapsed = n * samples_per_rank_step / r["samples_per_s_per_gpu"]
        steps += n
        seconds += elapsed
        wait_s += elapsed * r["data_wait_pct"] / 100
        if "mfu_pct" in r:
            flops_s += elapsed * r["mfu_pct"]
        host_s += n * r.get("cpu_optimizer_s", 0.0)  # a row's mean over its steps
    peaks = [r["peak_mem_gib"] for r in measured if "peak_mem_gib" in r]
    reserved = [r["peak_reserved_gib"] for r in measured if "peak_reserved_gib" in r]
    retries = [r["alloc_retries"] for r in measured if "alloc_retries" in r]
    return {
        "samples_per_s_per_gpu": steps * samples_per_rank_step / seconds,
        "mfu_pct": flops_s / seconds if any("mfu_pct" in r for r in measured) else None,
        "data_wait_pct": 100 * wait_s / seconds,
        "peak_mem_gib": max(peaks) if peaks else None,
        "peak_reserved_gib": max(reserved) if reserved else None,
        # rank 0's, per measured step: each one empties the allocator's cache and synchronizes the GPU
        "alloc_retries_per_step": sum(retries) / steps if retries else None,
        "cpu_optimizer_s": host_s / steps if any("cpu_optimizer_s" in r for r in measured) else None,
        "measured_steps": steps,
        "measured_s": seconds,
        "loss_last": measured[-1].get("loss"),
    }


def provenance(argv: list[str] | None) -> dict:
    """When and how a benchmark ran: UTC date and the command line (`argv` as main() got it, else sys.argv)."""
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
    }


def emit(result: dict, out: Path | None) -> dict:
    """The benchmark's final JSON line; also <out>/result.json when a work directory was given."""
    if out is not None:
        (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)
    return result


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
