"""Training throughput of the real trainer against the bare bound of the same blocks, measured in one run.

    python scripts/bench_train.py --preset libero-5b --micro-batch 16 --global-batch 32         # 1 GPU
    python scripts/bench_train.py --preset libero-5b --nproc 2 --micro-batch 16 --global-batch 64
    python scripts/bench_train.py --preset droid-14b --nproc 2 -- --parallel.no-reshard-after-forward
    python scripts/bench_train.py --preset libero-5b --nproc 4 -- --parallel.float8 tensorwise   # auto settings, fp8
    python scripts/bench_train.py --preset tiny --warmup-steps 2 --steps 4                        # CPU smoke run

1. Synthetic shards of the preset's exact sample shapes (devtools/synthetic.py, the project's writer),
   enough windows that the measured steps never revisit one (up to --max-windows).
2. The real trainer: `torchrun train/main.py` (FSDP2, the shard loader, AdamW) for warm-up + measured steps; the
   measured window is read from its metrics.jsonl (warm-up steps, compile included, are excluded).
3. The bound, in this process on one device after the trainer exits: the model's own `Block` stack in bf16 at the
   trainer's token layout and context length, fwd+bwd with random inputs (no FSDP, data or optimizer), with the
   trainer's activation checkpointing and compile settings, and again without recompute. A batch that does not fit
   is halved until it does (the batch used is reported).

Everything after `--` is passed to the trainer unchanged (and to the config the bound is built from). The presets'
auto settings (recompute, micro-batch, resharding) are resolved here as the trainer resolves them on these GPUs
(train/planning/auto.py resolve_auto), and checked against the trainer's config.yaml. Prints the trainer's own log, then
one
final JSON line.
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn as nn
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe.configs.cli import cli, refuse
from wampipe.errors import entry_point
from devtools import synthetic
from devtools.bench import (
    check_same_resolution,
    device_name,
    emit,
    measured_window,
    provenance,
    run_trainer,
    split_passthrough,
    trainer_argv,
    trainer_device,
    write_shards,
)
from wampipe.train.dit.attention import make_attention_mask
from wampipe.train.planning.auto import device_memory_gib, resolve_auto
from wampipe.train.builder import model_config
from wampipe.train.config import Auto, batch_plan
from wampipe.train.config import parse_args as parse_trainer_args
from wampipe.train.data import data_dims
from wampipe.train.dit.flops import dit_flops
from wampipe.train.planning.memory import Plan, offload_traffic, run_size
from wampipe.train.metrics import device_peak_flops
from wampipe.train.dit.model import Block, DiTConfig, rope_tables, text_key_log_weight
from wampipe.train.parallel import (
    apply_ac,
    apply_compile,
    apply_float8,
    auto_float8_missing,
    recomputed_blocks,
    use_expandable_segments,
)
from wampipe.train.dit.text import compact_text_rows


if TYPE_CHECKING:  # the names are computed at run time, so a type checker sees a string
    Preset = str
else:  # tyro's choices of --preset and --mix: the synthetic sample shapes' names
    Preset = Literal[tuple(sorted(synthetic.SHAPES))]


@dataclass
class Args:
    preset: Preset = "libero-5b"
    """Trainer preset (train/config.py) and synthetic sample shapes."""
    nproc: int = 1
    """Trainer processes (GPUs) on this host."""
    micro_batch: int | None = None
    """Samples per rank per forward/backward (None: the preset's)."""
    global_batch: int | None = None
    """Samples per optimizer step over all ranks (None: the preset's; 0 = micro-batch x nproc)."""
    warmup_steps: int = 5
    """Optimizer steps excluded from the measurement."""
    steps: int = 20
    """Measured optimizer steps."""
    ac: Literal["auto", "none", "full", "selective"] | None = None
    """Activation checkpointing per block (None: the preset's; auto = resolved for these GPUs)."""
    compile: tyro.conf.DisallowNone[bool | None] = None
    """torch.compile each block (None: the preset's)."""
    bound_only: bool = False
    """Time the bare bound only (no trainer; a few windows are written: they fix tiny's widths)."""
    trainer_only: bool = False
    """Run the trainer only (no bound)."""
    skip_no_recompute_bound: bool = False
    """Do not also time the bound without activation recompute (it is timed when --ac is not none)."""
    bound_warmup: int = 3
    """Untimed bound steps (compile, autotune)."""
    bound_steps: int = 10
    """Timed bound forward+backward steps."""
    shards: Path | None = None
    """Shard directory to reuse if it holds a manifest (written there otherwise); None: <out>/shards."""
    max_windows: int = 2048
    """Write at most this many windows (past them the loader starts a new epoch; re-reading costs the same, the
    freshly written shards sit in the page cache either way); 0 = no cap."""
    out: Path | None = None
    """Work directory (shards, trainer run dir, result.json); None: a temporary one, deleted."""
    device: str | None = None
    """Bound device (None: cuda if available, else cpu)."""
    mix: tuple[Preset, ...] | None = None
    """Train an equal-weight mixture of synthetic shards of these recipes' sample shapes (e.g. droid-5b libero-5b;
    the model is --preset's) instead of --preset's shapes alone; trainer only."""


def parse_args(argv: list[str] | None = None) -> tuple[Args, list[str]]:
    argv, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    args = cli(Args, args=argv, description=__doc__)
    if args.bound_only and args.trainer_only:
        refuse("--bound-only and --trainer-only exclude each other")
    if args.mix and (not args.trainer_only or len(set(args.mix)) != len(args.mix)):
        refuse("--mix needs --trainer-only (the bound is one shape's) and distinct recipes")
    if args.steps < 1 or args.warmup_steps < 0 or args.bound_steps < 1:
        refuse("--steps and --bound-steps must be >= 1, --warmup-steps >= 0")
    return args, extra


# ---------------------------------------------------------------- the bound


class BlockStack(nn.Module):
    """The DiT's transformer blocks alone (train.dit.model.Block), built in `dtype` on `device` one block at a time."""

    def __init__(self, cfg: DiTConfig, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(cfg.num_layers):
            with torch.device(device):
                block = Block(cfg)
            with torch.no_grad():  # the reference init of the block's linears (values barely matter for timing)
                for m in block.modules():
                    if isinstance(m, nn.Linear):
                        nn.init.xavier_uniform_(m.weight)
                        nn.init.zeros_(m.bias)
            self.blocks.append(block.to(dtype))

    def forward(self, x, e0, context, rope, mask, text_log_weight=None):
        for block in self.blocks:
            x = block(x, e0, context, rope, mask, text_log_weight)
        return x


def _time_bound_once(
    cfg: DiTConfig,
    latent_fhw,
    batch: int,
    ac: str,
    ac_blocks: int | Auto,
    text_rows: int,
    compile_: bool,
    attention: str,
    mask_options: dict,
    device: torch.device,
    warmup: int,
    steps: int,
    ac_others: str = "none",
    float8: str = "none",
    float8_linears: str = "all",
) -> dict:
    nf, h, w = latent_fhw
    grid = (h // 2, w // 2)
    layout = cfg.layout(nf, grid[0] * grid[1])
    n_ctx = text_rows + (cfg.image_len if cfg.model_type != "t2v" else 0)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    stack = BlockStack(cfg, device, dtype)
    apply_float8(stack, float8, float8_linears)  # the trainer's order: float8 linears, recompute wrapper, then compile
    apply_ac(stack, ac, ac_blocks, ac_others)
    if compile_:
        apply_compile(stack)
    mask = make_attention_mask(layout, device, attention, **mask_options)
    rope = rope_tables(layout, grid, cfg.head_dim, device, torch.float32)
    # inputs as the trainer's blocks see them: bf16 activations that need gradients (embeddings sit before them)
    x = torch.randn(batch, layout.seq_len, cfg.dim, device=device, dtype=dtype, requires_grad=True)
    # the time projection's rows (train.dit.model.per_token): the clean copy's, one per noisy frame, one per register
    e0 = tuple(
        (0.1 * torch.randn(batch, rows, 6, cfg.dim, device=device, dtype=dtype)).requires_grad_()
        for rows in (1, nf, layout.register_len)
    )
    context = torch.randn(batch, n_ctx, cfg.dim, device=device, dtype=dtype, requires_grad=True)
    text_log_weight = None  # compact text: the trainer's weighted kernel, every prompt one row short of text_rows
    if text_rows < cfg.text_len:
        lengths = torch.full((batch,), text_rows - 1, device=device)
        text_log_weight = text_key_log_weight(lengths, text_rows, cfg.text_len)
    grad_out = torch.randn(batch, layout.seq_len, cfg.dim, device=device, dtype=dtype)
    cuda = device.type == "cuda"

    def step():
        stack(x, e0, context, rope, mask, text_log_weight).backward(grad_out)
        for t in (x, *e0, context, *stack.parameters()):
            t.grad = None

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    dt = (time.perf_counter() - t0) / steps
    recomputed = recomputed_blocks(ac, ac_blocks, cfg.num_layers)
    flops = dit_flops(cfg, latent_fhw, text_rows).blocks_forward * (3 + recomputed / cfg.num_layers)
    peak = device_peak_flops(device)
    sps = batch / dt
    return {
        "samples_per_s": sps,
        "batch": batch,
        "ac": ac,
        "step_s": dt,
        "mfu_pct": 100 * sps * flops / peak if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    }


def time_bound(
    cfg: DiTConfig,
    latent_fhw,
    batch: int,
    ac: str,
    ac_blocks: int | Auto,
    text_rows: int,
    compile_: bool,
    attention: str,
    mask_options: dict,
    device: torch.device,
    warmup: int,
    steps: int,
    ac_others: str = "none",
    float8: str = "none",
    float8_linears: str = "all",
) -> dict:
    """Bound samples/s; a batch that runs out of device memory is halved (per-sample rate, so comparable); {} with a
    note when not even one sample fits."""
    while True:
        torch._dynamo.reset()  # a fresh compile per attempt: no recompile limit, no automatic dynamic batch dim
        gc.collect()  # outside any except block: no traceback pins the last attempt's tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            return _time_bound_once(
                cfg,
                latent_fhw,
                batch,
                ac,
                ac_blocks,
                text_rows,
                compile_,
                attention,
                mask_options,
                device,
                warmup,
                steps,
                ac_others,
                float8,
                float8_linears,
            )
        except Exception as e:  # noqa: BLE001 - compiled code may wrap the OOM in its own exception type
            if "out of memory" not in str(e).lower():
                raise
            if batch == 1:
                note = "does not fit one device at batch 1"
        if batch == 1:
            print(f"bound (ac {ac}): {note}", flush=True)
            return {"note": note}
        print(f"bound (ac {ac}): batch {batch} does not fit, trying {batch // 2}", flush=True)
        batch //= 2


def pinned_copy_gb_s(device: torch.device, gib: int = 1, reps: int = 3) -> tuple[float, float]:
    """Best of `reps` copies of `gib` GiB between pinned host memory and `device`: (to the device, to the host)."""
    host = torch.empty(gib << 30, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty_like(host, device=device)
    rates = []
    for dst, src in ((on_device, host), (host, on_device)):
        best = float("inf")
        for _ in range(reps):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        rates.append(host.numel() / best / 1e9)
    del on_device
    torch.cuda.empty_cache()  # the bounds measured next get the whole device
    return rates[0], rates[1]


def offload_split(cfg, plan, world: int, device: torch.device, samples_per_s: float | None) -> dict:
    """Where an offloaded step goes: the state-transfer bound (the bytes one rank copies in and out per step,
    train/planning/memory.py `offload_traffic`, at this GPU's pinned-copy rates measured alone, so a lower bound when
    ranks share the host's links) beside the measured step and its CPU-optimizer share (the trainer's log)."""
    size = run_size(cfg)
    if size is None:  # a recipe without a sample shape: nothing to count
        return {}
    traffic = Plan(
        cfg.parallel.activation_checkpoint,
        plan.micro,
        cfg.parallel.reshard_after_forward,
        bool(cfg.parallel.reduce_every_micro_batch),
        plan.accum,
        world,
        cpu_offload=True,
    )
    bytes_in, bytes_out = offload_traffic(size, traffic, cfg.parallel.gather_once_per_step)
    to_device, to_host = pinned_copy_gb_s(device)
    return {
        "offload_in_gb": bytes_in / 1e9,
        "offload_out_gb": bytes_out / 1e9,
        "pinned_to_gpu_gb_s": to_device,
        "pinned_to_host_gb_s": to_host,
        "offload_copy_bound_s": bytes_in / 1e9 / to_device + bytes_out / 1e9 / to_host,
        "step_s": plan.micro * plan.accum / samples_per_s if samples_per_s else None,
    }


def main(argv: list[str] | None = None) -> dict:
    args, extra = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_train-")) if args.out is None else args.out
    work.mkdir(parents=True, exist_ok=True)
    shards = args.shards or work / "shards"
    run_dir = work / "run"
    argv_trainer = trainer_argv(args, shards, run_dir, extra)
    sets = {preset: work / f"shards-{preset}" for preset in args.mix or ()}
    if sets:  # the sets instead of one directory; the first set stands for the shapes below
        i = argv_trainer.index("--data.shards")
        argv_trainer[i : i + 2] = ["--data.mixture", *(f"{d}=1" for d in sets.values())]
        shards = next(iter(sets.values()))
    cfg = parse_trainer_args(argv_trainer)
    device = trainer_device(cfg)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    cfg, auto = resolve_auto(
        cfg, device_memory_gib(device), args.nproc, auto_float8_missing(cfg.parallel.float8, capability)
    )
    if auto:
        print(auto, flush=True)
    plan = batch_plan(cfg, args.nproc)
    micro, global_batch, accum = plan.micro, plan.global_batch, plan.accum
    total_steps = args.warmup_steps + args.steps
    result: dict = {
        "bench": "train",
        "preset": args.preset,
        "mix": args.mix,
        "model": cfg.model.name,
        "world_size": args.nproc,
        "micro_batch": micro,
        "global_batch": global_batch,
        "accum": accum,
        "ac": cfg.parallel.activation_checkpoint,
        "compile": cfg.parallel.compile,
        "attention": cfg.model.attention,
        "reshard_after_forward": cfg.parallel.reshard_after_forward,
        "reduce_every_micro_batch": cfg.parallel.reduce_every_micro_batch,
        "float8": cfg.parallel.float8,
        "float8_linears": cfg.parallel.float8_linears,
        "cpu_offload": cfg.parallel.cpu_offload,
        "auto": auto,
        "warmup_steps": args.warmup_steps,
        "steps": args.steps,
        "trainer_extra": extra,
    }
    try:
        # windows for every step, plus the batches the loader workers have prefetched when the run ends
        ahead = (cfg.data.num_workers * cfg.data.prefetch_factor + 2) * micro * args.nproc
        windows = total_steps * global_batch + ahead
        if args.max_windows:
            windows = min(windows, max(args.max_windows, micro * args.nproc))
        for preset, directory in (sets or {args.preset: shards}).items():
            write_shards(cfg, preset, directory, micro if args.bound_only else windows)
        model_cfg = model_config(replace(cfg, data=replace(cfg.data, shards=shards, mixture=())))
        latent_fhw = tuple(synthetic.SHAPES[args.preset].latents[1:])
        layout = model_cfg.layout(latent_fhw[0], (latent_fhw[1] // 2) * (latent_fhw[2] // 2))
        # compact text: the rows of a batch holding the longest prompt (the trainer's batches have at most these)
        text_rows = (
            compact_text_rows(data_dims(shards)["text_len"], model_cfg.text_len)
            if cfg.data.compact_text
            else model_cfg.text_len
        )
        result.update(
            latent=list(latent_fhw),
            seq_len=layout.seq_len,
            compact_text=cfg.data.compact_text,
            ac_blocks=cfg.parallel.ac_blocks,
            ac_others=cfg.parallel.ac_others,
            text_rows=text_rows,
            context_len=text_rows + (model_cfg.image_len if model_cfg.model_type != "t2v" else 0),
        )

        trainer = {}
        if not args.bound_only:
            if run_dir.exists():
                shutil.rmtree(run_dir)  # a fresh run: no resume, a metrics.jsonl of this run only
            result["trainer_wall_s"] = run_trainer(args, argv_trainer, run_dir)
            check_same_resolution(cfg, run_dir)
            trainer = measured_window(run_dir, args.warmup_steps, micro * accum)
        result.update(
            {
                k: trainer.get(k)
                for k in (
                    "samples_per_s_per_gpu",
                    "mfu_pct",
                    "data_wait_pct",
                    "peak_mem_gib",
                    "peak_reserved_gib",
                    "alloc_retries_per_step",
                    "cpu_optimizer_s",
                    "measured_steps",
                    "measured_s",
                    "loss_last",
                )
            }
        )

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        use_expandable_segments(device)  # the trainer's allocator, for the bound too
        result.update(device=device.type, gpu=device_name(device), torch=torch.__version__, **provenance(argv))
        if cfg.parallel.cpu_offload and device.type == "cuda":
            split = offload_split(cfg, plan, args.nproc, device, result["samples_per_s_per_gpu"])
            result.update(split)
            print(f"offload: {split}, CPU optimizer {result['cpu_optimizer_s']} s/step", flush=True)
        bounds = {}
        if not args.trainer_only:
            ac = cfg.parallel.activation_checkpoint
            settings = [("bound", ac)] + (
                [("bound_no_recompute", "none")] if ac != "none" and not args.skip_no_recompute_bound else []
            )
            for name, mode in settings:
                bounds[name] = time_bound(
                    model_cfg,
                    latent_fhw,
                    micro,
                    mode,
                    cfg.parallel.ac_blocks,
                    text_rows,
                    cfg.parallel.compile,
                    cfg.model.attention,
                    cfg.model.flex_mask_options(),
                    device,
                    args.bound_warmup,
                    args.bound_steps,
                    cfg.parallel.ac_others,
                    cfg.parallel.float8,
                    cfg.parallel.float8_linears,
                )
                print(f"{name}: {bounds[name]}", flush=True)
        sps = result["samples_per_s_per_gpu"]
        for name in ("bound", "bound_no_recompute"):
            b = bounds.get(name, {})
            result[f"{name}_samples_per_s"] = b.get("samples_per_s")
            result[f"{name}_batch"] = b.get("batch")
            result[f"{name}_mfu_pct"] = b.get("mfu_pct")
            result[f"{name}_peak_mem_gib"] = b.get("peak_mem_gib")
            suffix = name.removeprefix("bound")
            result[f"ratio_to_bound{suffix}"] = sps / b["samples_per_s"] if sps and b.get("samples_per_s") else None
            if "note" in b:
                result[f"{name}_note"] = b["note"]
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    # 6 significant digits, not 4 decimals: a small ratio (a CPU smoke run's ~0.03) keeps its relative precision
    return emit({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in result.items()}, args.out)


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
