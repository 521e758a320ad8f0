"""Trainer configuration: nested tyro dataclasses and the named presets.

    torchrun --nproc-per-node=8 train/main.py --preset libero-5b --data.shards shards/libero --optim.lr 2e-5

`--preset` picks the defaults (the `PRESETS` table); every other flag overrides one field. `--help` lists them all.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tyro

from train.loss import LossConfig


@dataclass
class DataConfig:
    """Shard loading (train/data.py)."""

    shards: Path | None = None
    """Shard directory holding manifest.json (python -m preprocess shards / scripts/make_synthetic_shards.py)."""
    micro_batch_size: int = 1
    """Samples per rank per forward/backward."""
    num_workers: int = 2
    """Loader worker processes per rank (0 = load in the training process)."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead."""
    seed: int = 0
    """Seed of the per-epoch sample permutation and of the per-visit prompt / variant draws."""
    reshuffle_on_resize: bool = False
    """Allow resuming with a different world size: the data position restarts at the next epoch's permutation."""
    variant: int = -1
    """Augmentation variant to use; -1 = a fresh random choice per visit among the window's variants."""
    text_column: str = ""
    """Annotation column to take the prompt from; empty = a fresh random choice per visit (the reference)."""
    pin_memory: bool = True
    """Pin host batches and copy them to the GPU asynchronously (CUDA only)."""
    compact_text: bool = True
    """Send each prompt's umT5 rows plus a few zero rows that the model weights to stand for all text_len - n
    (exact: same attention and gradients, 4-8x fewer text rows); False pads every prompt to text_len rows."""


@dataclass
class ModelConfig:
    """The DiT (train/model.py)."""

    name: Literal["tiny", "5b", "5b-libero", "14b"] = "tiny"
    """DiT preset of train/model.py."""
    num_layers: int = 0
    """Override the preset's block count (0 = the preset's): a shallower real-width model for debugging and
    benchmarks on fewer GPUs. Weights from --model.init-from must match."""
    init_from: Path | None = None
    """Weights to start from (DreamZero checkpoint, Wan base or our export); None = the reference's random init."""
    init_device: Literal["cpu", "meta"] = "cpu"
    """cpu: build and init the full model on every rank (identical init from the seed), then shard;
    meta: build on the meta device, shard, then init on the GPU shards (large models)."""
    attention: Literal["auto", "flex", "dense"] = "auto"
    """Attention kernel: flex on CUDA, dense SDPA elsewhere (auto)."""
    flex_mask: Literal["attrs", "lookup"] = "lookup"
    """How FlexAttention evaluates the mask in partial tiles: the §3.6 expression on token attributes, or a lookup
    in a precomputed dense [L, L] mask (scripts/bench_attention.py compares them)."""
    flex_block_size: int = 128
    """FlexAttention tile (BlockMask block size); smaller tiles would skip more masked pairs, but torch 2.11's
    compiled CUDA kernel rejects 64 (its own tiles are 128: "Q and KV block size must be divisible by BLOCK_M"), so
    other sizes serve the eager CPU path and experiments."""

    def flex_mask_options(self) -> dict:
        """`flex_block_mask` keyword arguments of these settings."""
        return {"lookup": self.flex_mask == "lookup", "block_size": self.flex_block_size}


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay (dreamzero_model.md §5)."""

    lr: float = 1e-5
    """Peak learning rate."""
    betas: tuple[float, float] = (0.95, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 1e-5
    """Weight decay on every parameter (RLinf)."""
    warmup_steps: int = -1
    """Linear warmup steps; -1 = warmup_ratio x steps."""
    warmup_ratio: float = 0.05
    """Warmup as a fraction of the run when warmup_steps is -1."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr (cosine floor)."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = no clipping)."""
    fused: bool | None = None
    """Fused AdamW kernel; None = on for CUDA."""


@dataclass
class ParallelConfig:
    """Data parallelism and precision (train/parallel.py)."""

    global_batch_size: int = 0
    """Samples per optimizer step over all ranks; 0 = micro_batch_size x world size (no accumulation)."""
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of parameters inside forward/backward (FSDP2 MixedPrecisionPolicy); masters stay fp32."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Gradient reduce-scatter dtype."""
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    """Recompute per block: none, full (whole block) or selective (keep matmul/attention outputs)."""
    ac_blocks: int = -1
    """How many blocks recompute (spread evenly over the depth); the others do --parallel.ac-others. -1 = all."""
    ac_others: Literal["none", "selective"] = "none"
    """What the blocks left out by --parallel.ac-blocks do: keep every activation (none), or selective recompute.
    With full recompute on N blocks and selective on the rest, N trades speed for memory between the two."""
    compile: bool = False
    """torch.compile each block."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process group backend; auto = nccl with CUDA, else gloo."""
    deterministic: bool = False
    """Deterministic algorithms (bitwise-reproducible resume; slower on GPU)."""
    reshard_after_forward: bool = True
    """Free gathered block parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2-like)."""
    peak_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s of one device for MFU; 0 = detect (H100/H200: 989), unknown = no MFU."""


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (train/checkpoint.py)."""

    dir: Path = Path("checkpoints/run")
    """Run directory: step-N/ DCP checkpoints, export/, metrics.jsonl, tb/."""
    interval: int = 500
    """Save every N steps (0 = only at the end)."""
    keep_last: int = 3
    """Complete checkpoints to keep (older ones are deleted after a save)."""
    resume: bool = True
    """Resume from the newest complete checkpoint in dir, if any."""
    save_final: bool = True
    """Save a checkpoint at the last step."""
    export: bool = True
    """Export consolidated weights (safetensors, official key names) at the end."""
    export_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """dtype of the exported weights."""
    export_prefix: Literal["", "action_head.model."] = ""
    """Key prefix of the export: '' = plain DiT names; 'action_head.model.' = a DreamZero checkpoint layout."""


@dataclass
class MetricsConfig:
    """Logging (train/metrics.py)."""

    interval: int = 10
    """Log every N steps."""
    tensorboard: bool = True
    """Write TensorBoard events under <checkpoint.dir>/tb."""
    progress: bool = True
    """tqdm progress bar on rank 0."""
    profile_start: int = 0
    """Step after which torch.profiler records `profile_steps` steps (0 with profile_steps 0 = off)."""
    profile_steps: int = 0
    """Steps to profile; rank 0 writes <checkpoint.dir>/profile-rank0.txt (top ops) and a gzipped Chrome trace."""


@dataclass
class Config:
    """Lean FSDP2 trainer for DreamZero-style DiTs on precomputed shards."""

    preset: Literal["tiny", "libero-5b", "droid-5b", "droid-14b"] = "tiny"
    """Named defaults for everything below (given flags override them)."""
    steps: int = 1000
    """Optimizer steps to train for."""
    seed: int = 0
    """Seed of the model init (shared by all ranks); noise/timestep RNG is seed + rank-dependent."""
    stop_after: int = 0
    """Exit after this many steps of this invocation (0 = run to `steps`); the schedule still spans `steps`."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def _preset(name: str, model: str, micro: int, global_batch: int, steps: int, lr: float, warmup_ratio: float,
            ac: str, compile: bool, init_device: str, interval: int, workers: int, **top) -> Config:
    return Config(
        preset=name, steps=steps, **top,
        data=DataConfig(micro_batch_size=micro, num_workers=workers),
        model=ModelConfig(name=model, init_device=init_device),
        optim=OptimConfig(lr=lr, warmup_ratio=warmup_ratio),
        parallel=ParallelConfig(global_batch_size=global_batch, activation_checkpoint=ac, compile=compile),
        checkpoint=CheckpointConfig(dir=Path(f"checkpoints/{name}"), interval=interval),
    )


PRESETS: dict[str, Config] = {
    # CPU demo / tests: tiny DiT, high lr so the loss visibly falls within a few dozen steps
    "tiny": _preset("tiny", "tiny", 2, 0, 40, 1e-2, 0.05, "none", False, "cpu", 20, 1),
    # RLinf's 5B LIBERO recipe: 32/GPU, global 256, 50k steps, warmup 5 %
    "libero-5b": _preset("libero-5b", "5b-libero", 32, 256, 50_000, 1e-5, 0.05, "full", True, "meta", 500, 4),
    # 5B DROID (RLinf target 176x320): global 256, warmup 1 %
    "droid-5b": _preset("droid-5b", "5b", 32, 256, 50_000, 1e-5, 0.01, "full", True, "meta", 500, 4),
    # 14B DROID: 1/GPU, global 8, 2000 steps, warmup 1 %
    "droid-14b": _preset("droid-14b", "14b", 1, 8, 2_000, 1e-5, 0.01, "full", True, "meta", 200, 4),
}


def preset_config(name: str) -> Config:
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def parse_args(argv: list[str] | None = None) -> Config:
    """`--preset NAME` selects the defaults, then tyro parses every flag on top of them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = "tiny"
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            name = argv[i + 1]
        elif arg.startswith("--preset="):
            name = arg.split("=", 1)[1]
    return tyro.cli(Config, default=preset_config(name), args=argv, description=__doc__)
