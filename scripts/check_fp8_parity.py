"""Loss parity of float8 training with bf16: the same data, seeds and steps trained twice, the loss curves compared.

    python scripts/check_fp8_parity.py --preset libero-5b --steps 100 -- --model.num-layers 4            # 1 GPU
    python scripts/check_fp8_parity.py --preset libero-5b --float8 rowwise --nproc 4 -- --model.num-layers 4
    python scripts/check_fp8_parity.py --preset tiny --float8 none --steps 4                            # CPU plumbing

Both runs are the real trainer (`torchrun train/main.py`, as scripts/bench_train.py starts it) on the same synthetic
shards of the preset's shapes with the same seeds, so they see the same batches, timesteps and noise; only
`--parallel.float8` differs. The measure: the mean absolute difference of the two runs' per-step losses against the
bf16 run's own step-to-step noise (mean |loss[t] - loss[t-1]|, which the timestep and noise draws dominate). A
float8 run at parity differs from bf16 by a small fraction of that noise (`--max-ratio`). `--float8 none` trains
bf16 twice: the run-to-run floor (0 where the kernels are deterministic). Everything after `--` goes to both runs.
Prints both curves, then one JSON line; exits 1 when the ratio exceeds --max-ratio.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe.configs.cli import cli, refuse
from wampipe.errors import entry_point
from devtools import bench, synthetic
from wampipe.train.planning.auto import device_memory_gib, resolve_auto
from wampipe.train.config import batch_plan
from wampipe.train.config import parse_args as parse_trainer_args
from wampipe.train.parallel import check_float8


@dataclass
class Args:
    preset: Literal[tuple(sorted(synthetic.SHAPES))] = "libero-5b"  # type: ignore[valid-type]
    """Trainer preset (train/config.py) and synthetic sample shapes."""
    float8: Literal["tensorwise", "rowwise", "none"] = "tensorwise"
    """Recipe of the second run (none: bf16 twice, the run-to-run floor)."""
    moments: Literal["fp32", "bf16"] = "fp32"
    """--optim.moments of the second run (bf16: AdamW's moments stored in bf16)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """--parallel.reduce-dtype of the second run (bfloat16: gradients reduce-scattered in bf16, RLinf's recipe)."""
    nproc: int = 1
    """Trainer processes (GPUs) on this host."""
    steps: int = 100
    """Optimizer steps of each run (at least 2)."""
    micro_batch: int | None = None
    """Samples per rank per forward/backward (None: the preset's)."""
    global_batch: int | None = None
    """Samples per optimizer step over all ranks (None: the preset's; 0 = micro-batch x nproc)."""
    max_ratio: float = 0.2
    """Parity: the mean |fp8 - bf16| loss is at most this fraction of the bf16 step-to-step noise."""
    max_windows: int = 512
    """Write at most this many windows (later steps revisit them, in the same order in both runs)."""
    shards: Path | None = None
    """Shard directory to reuse if it holds a manifest (written there otherwise); None: <out>/shards."""
    out: Path | None = None
    """Work directory (shards, run-bf16/, run-<float8>/, result.json); None: a temporary one, deleted."""
    # what bench.trainer_argv reads besides the flags: no warm-up, the preset's recompute and compile
    warmup_steps, ac, compile = 0, None, None


def parse_args(argv: list[str] | None = None) -> tuple[Args, list[str]]:
    argv, extra = bench.split_passthrough(sys.argv[1:] if argv is None else argv)
    args = cli(Args, args=argv, description=__doc__)
    if args.steps < 2:
        refuse("--steps must be >= 2 (the noise is a step-to-step difference)")
    return args, extra


def losses(run_dir: Path) -> list[float]:
    """Per-step losses of a run logged with --metrics.interval 1 (mean over ranks)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records]


def throughput(run_dir: Path, skip: int) -> float | None:
    """Mean samples/s/GPU after the first `skip` steps (compile, warm-up)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["samples_per_s_per_gpu"] for r in records[skip:]]
    return sum(rates) / len(rates) if rates else None


def compare(reference: list[float], other: list[float]) -> dict:
    """Mean |other - reference| per step against the reference's mean step-to-step change."""
    if len(reference) != len(other):
        raise SystemExit(f"the runs logged {len(reference)} and {len(other)} steps")
    diff = sum(abs(a - b) for a, b in zip(reference, other)) / len(reference)
    noise = sum(abs(b - a) for a, b in zip(reference, reference[1:])) / (len(reference) - 1)
    return {"mean_abs_diff": diff, "bf16_step_noise": noise, "ratio": diff / noise if noise else None}


def main(argv: list[str] | None = None) -> dict:
    args, extra = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fp8_parity-")) if args.out is None else args.out
    work.mkdir(parents=True, exist_ok=True)
    shards = args.shards or work / "shards"
    label = " ".join(
        [args.float8] * (args.float8 != "none")
        + [f"{args.moments}-moments"] * (args.moments != "fp32")
        + ["bf16-reduce"] * (args.reduce_dtype != "float32")
    )
    label = label or "bf16 again"
    runs = {
        "bf16": ("none", "fp32", "float32", work / "run-bf16"),
        label: (args.float8, args.moments, args.reduce_dtype, work / f"run-{label.replace(' ', '-')}"),
    }
    argvs = {
        name: bench.trainer_argv(
            args,
            shards,
            run_dir,
            [
                "--metrics.interval",
                "1",
                *extra,
                "--parallel.float8",
                mode,
                "--optim.moments",
                moments,
                "--parallel.reduce-dtype",
                reduce_dtype,
            ],
        )
        for name, (mode, moments, reduce_dtype, run_dir) in runs.items()
    }
    cfg = parse_trainer_args(argvs["bf16"])
    device = bench.trainer_device(cfg)
    check_float8(args.float8, torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
    cfg, _ = resolve_auto(cfg, device_memory_gib(device), args.nproc)
    plan = batch_plan(cfg, args.nproc)
    micro, global_batch = plan.micro, plan.global_batch
    try:
        ahead = (cfg.data.num_workers * cfg.data.prefetch_factor + 2) * micro * args.nproc
        windows = min(args.steps * global_batch + ahead, max(args.max_windows, micro * args.nproc))
        bench.write_shards(cfg, args.preset, shards, windows)
        curves, rates = {}, {}
        for name, (*_, run_dir) in runs.items():
            if run_dir.exists():
                shutil.rmtree(run_dir)
            bench.run_trainer(args, argvs[name], run_dir)
            curves[name], rates[name] = losses(run_dir), throughput(run_dir, skip=min(3, args.steps - 1))
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'step':>5} {'bf16':>10} {label:>10} {'|diff|':>10}")
    for step, (a, b) in enumerate(zip(curves["bf16"], curves[label]), 1):
        print(f"{step:>5} {a:>10.5f} {b:>10.5f} {abs(a - b):>10.5f}")
    stats = compare(curves["bf16"], curves[label])
    parity = stats["ratio"] is not None and stats["ratio"] <= args.max_ratio
    result = bench.emit(
        {
            "check": "fp8_parity",
            "preset": args.preset,
            "float8": args.float8,
            "moments": args.moments,
            "reduce_dtype": args.reduce_dtype,
            "world_size": args.nproc,
            "steps": args.steps,
            "micro_batch": micro,
            "global_batch": global_batch,
            "trainer_extra": extra,
            **stats,
            "max_ratio": args.max_ratio,
            "parity": parity,
            "samples_per_s_per_gpu_bf16": rates["bf16"],
            "samples_per_s_per_gpu_other": rates[label],
            "loss_bf16": curves["bf16"],
            "loss_other": curves[label],
            "gpu": bench.device_name(device),
            "torch": torch.__version__,
            **bench.provenance(argv),
        },
        args.out,
    )
    if not parity:
        ratio = "undefined" if stats["ratio"] is None else f"{stats['ratio']:.3g}"
        raise SystemExit(
            f"no loss parity: mean |{label} - bf16| loss {stats['mean_abs_diff']:.4g} is {ratio} x the "
            f"bf16 step-to-step noise {stats['bf16_step_noise']:.4g} (--max-ratio {args.max_ratio})"
        )
    return result


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
