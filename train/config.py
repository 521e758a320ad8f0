"""Trainer configuration: nested tyro dataclasses and the named presets (the recipes in configs/).

    torchrun --nproc-per-node=8 train/main.py --preset libero-5b --data.shards shards/libero --optim.lr 2e-5
    torchrun --nproc-per-node=8 train/main.py --config checkpoints/libero-5b/config.yaml --checkpoint.dir again

`--preset` picks the defaults (configs/<preset>.yaml, section train); `--config FILE` overrides them with a file's
train section (a run directory's config.yaml reproduces that run); every other flag overrides one field on top (all
listed by `--help`).
"""

from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import tyro

from wampipe import configs
from wampipe.configs.cli import cli
from wampipe.errors import UsageError
from wampipe.shardformat.layout import MANIFEST

# "Not set" has one spelling: `auto`, a setting the trainer works out itself, as each field's help says (flags and
# config files alike; the three on/off settings that also take auto stay None in Python, since tyro gives a bool its
# --x/--no-x pair only without a third value). None stays for an input not given at all: no path, no project.
AUTO = "auto"
Auto = Literal["auto"]
# the numbers that spelled auto before it was one word, still read (a run directory's older config.yaml, a flag)
LEGACY_AUTO = {
    ("data", "micro_batch_size"): 0,
    ("data", "variant"): -1,
    ("data", "text_column"): "",
    ("model", "num_layers"): 0,
    ("optim", "warmup_steps"): -1,
    ("parallel", "global_batch_size"): 0,
    ("parallel", "ac_blocks"): -1,
    ("parallel", "peak_tflops"): 0,
    ("metrics", "val_batch"): 0,
}

if TYPE_CHECKING:  # the recipe names are files, known only at run time
    RecipeName = str
else:
    RecipeName = Literal[tuple(configs.names())]


@dataclass(frozen=True)
class ShardSet:
    """One shard set of a mixture and its sampling weight."""

    shards: str
    """Shard directory or URL, as --data.shards."""
    weight: float = 1.0
    """Sampling weight (> 0), normalised over the mixture (--data.mixture-weighting)."""


def _parse_sets(args: list[str]) -> tuple[ShardSet, ...]:
    sets = []
    for arg in args:
        shards, sep, weight = arg.rpartition("=")
        try:
            sets.append(ShardSet(shards, float(weight)) if sep else ShardSet(arg))
        except ValueError:
            raise ValueError(f"--data.mixture {arg}: the weight after the last '=' is not a number") from None
    return tuple(sets)


MIXTURE_FLAG = tyro.constructors.PrimitiveConstructorSpec(
    nargs="*",
    metavar="DIR[=WEIGHT] ...",
    instance_from_str=_parse_sets,
    is_instance=lambda v: isinstance(v, tuple) and all(isinstance(s, ShardSet) for s in v),
    str_from_instance=lambda sets: [f"{s.shards}={s.weight:g}" for s in sets],
)


@dataclass
class DataConfig:
    """Shard loading (train/data.py)."""

    shards: str | None = None
    """Shard directory holding manifest.json (python -m preprocess shards / scripts/make_synthetic_shards.py): a
    path or a URL (s3://bucket/prefix; endpoint and credentials from the AWS_* variables, docs/FORMAT.md)."""
    mixture: Annotated[tuple[ShardSet, ...], MIXTURE_FLAG] = ()
    """Several shard sets in one run, each `DIR=WEIGHT` (a path or URL; weight 1 without `=`); in a config file
    `mixture: [{shards: DIR, weight: W}, ...]`. Every micro-batch comes from one set, drawn per micro-batch by
    weight (docs/TRAINING.md, Mixtures). Instead of --data.shards."""
    mixture_weighting: Literal["set", "size"] = "set"
    """How a mixture's weights become the probability of drawing a set per micro-batch: set = the weight, normalised
    (RLinf, the official recipes); size = the weight x the set's visits per epoch, normalised (the official generic
    mixture's length balancing)."""
    mixture_changed: bool = False
    """Resume a checkpoint written with other data on purpose (another mixture: other sets or weights; or a set
    rebuilt, its manifest changed): the data position is kept, the draws follow this run's data."""
    cache_dir: Path | None = None
    """Local folder for whole-file copies of remote shards: each shard is downloaded whole on its first read and
    read from disk after, so it needs room for the dataset (and the text table lands here). None = one ranged
    request per sample, straight to the object store. Ignored for local shards."""
    micro_batch_size: int | Auto = 1
    """Samples per rank per forward/backward; auto = chosen with the recompute mode for the GPUs
    (train/planning/auto.py resolve_auto; the 5B and 14B presets' default), keeping the global batch."""
    num_workers: int = 2
    """Loader worker processes per rank (0 = load in the training process)."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead."""
    seed: int = 0
    """Seed of the per-epoch sample permutation and of the per-visit prompt / variant draws."""
    sampling: Literal["anchor", "uniform"] = "anchor"
    """anchor: each epoch visits every window as often as the reference's sampler, which shuffles all anchor rows,
    draws it (its anchor multiplicity: episode starts and ends 2-3x); uniform: every window once per epoch."""
    reshuffle_on_resize: bool = False
    """Allow resuming with a different world size: the data position restarts at the next epoch's permutation."""
    variant: int | Auto = AUTO
    """Augmentation variant to use; auto = a fresh random choice per visit among the window's variants."""
    text_column: str = AUTO
    """Annotation column to take the prompt from; auto = a fresh random choice per visit (the reference)."""
    pin_memory: bool = True
    """Pin host batches and copy them to the GPU asynchronously (CUDA only)."""
    compact_text: bool = True
    """Send each prompt's umT5 rows plus a few zero rows that the model weights to stand for all text_len - n
    (exact: same attention and gradients, 4-8x fewer text rows); False pads every prompt to text_len rows."""

    def sets(self) -> tuple[ShardSet, ...]:
        """The mixture, or --data.shards as a set of weight 1."""
        return self.mixture or (ShardSet(str(self.shards)),)

    def micro(self) -> int:
        """The micro-batch size, once chosen (the auto settings choose it before anything loads)."""
        if self.micro_batch_size == AUTO:
            raise UsageError("--data.micro-batch-size auto: train/planning/auto.py resolve_auto chooses it first")
        return self.micro_batch_size


@dataclass
class ModelConfig:
    """The DiT (train/dit/model.py)."""

    name: RecipeName = "tiny"
    """DiT shape: the recipe's of this name (configs/<name>.yaml, section dit; train/dit/model.py preset)."""
    num_layers: int | Auto = AUTO
    """Override the preset's block count (auto = the preset's): a shallower real-width model for debugging and
    benchmarks on fewer GPUs. Weights from --model.init-from must match."""
    init_from: Path | None = None
    """Weights to start from (DreamZero checkpoint folder, Wan base or our export; train/dit/weights.py); each rank
    reads only its own shard's rows. None = random init (the references start from a Wan base or a DreamZero
    checkpoint: docs/DIFFERENCES.md)."""
    image_encoder: Path | None = None
    """The CLIP ViT-H/14 weights the shards were built with (the same file: Wan's open-clip .pth or a Diffusers
    image_encoder/ folder), needed when they hold CLIP's input pixels (preprocess --image-features pixels): each rank
    then runs the frozen CLIP on its micro-batches, in the shards' encoder dtype."""
    init_device: Literal["cpu", "meta"] = "cpu"
    """cpu: build and init the full model on every rank (identical init from the seed), then shard;
    meta: build on the meta device, shard, then init (or load --model.init-from) on the GPU shards (large models)."""
    attention: Literal["auto", "flex", "dense"] = "auto"
    """Attention kernel: flex on CUDA, dense SDPA elsewhere (auto)."""
    flex_mask: Literal["attrs", "lookup"] = "lookup"
    """How FlexAttention evaluates the mask in partial tiles: the mask expression on token attributes
    (docs/REFERENCE.md#8-attention-mask), or a lookup in a precomputed dense [L, L] mask (scripts/bench_attention.py
    compares them)."""
    flex_block_size: int = 128
    """FlexAttention tile (BlockMask block size); smaller tiles would skip more masked pairs, but torch 2.11's
    compiled CUDA kernel rejects 64 (its own tiles are 128: "Q and KV block size must be divisible by BLOCK_M"), so
    other sizes serve the eager CPU path and experiments."""

    def flex_mask_options(self) -> dict:
        """`flex_block_mask` keyword arguments of these settings."""
        return {"lookup": self.flex_mask == "lookup", "block_size": self.flex_block_size}


@dataclass
class LossConfig:
    """Flow-matching loss options."""

    shift: float = 5.0
    """Timestep shift of the schedule."""
    num_train_timesteps: int = 1000
    """Discrete training timesteps."""
    action_loss_over_all_dims: bool = True
    """Reference quirk: divide the action loss by all padded dims (32); False = by the real dims of each token."""
    action_weight: float = 1.0
    """Weight of the action loss relative to the dynamics loss (reference: 1)."""


@dataclass
class LoRAConfig:
    """LoRA fine-tuning (train/dit/lora.py); the official LoRA recipe is --lora.rank 4 --lora.alpha 4."""

    rank: int = 0
    """Rank of the update; 0 = off (full fine-tuning)."""
    alpha: float = 4.0
    """Scale numerator: the update is multiplied by alpha / rank."""
    targets: str = "q,k,v,o,ffn.0,ffn.2"
    """Comma-separated suffixes of the module names to adapt (PEFT's matching: the name equals one or ends in
    '.' + one); only nn.Linear layers are adapted."""

    def suffixes(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay (docs/REFERENCE.md#10-optimizer-recipe)."""

    lr: float = 1e-5
    """Peak learning rate."""
    betas: tuple[float, float] = (0.95, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 1e-5
    """Weight decay on every parameter (RLinf)."""
    warmup_steps: int | Auto = AUTO
    """Linear warmup steps; auto = warmup_ratio x steps."""
    warmup_ratio: float = 0.05
    """Warmup as a fraction of the run when warmup_steps is auto."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr (cosine floor)."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = no clipping)."""
    skip_nonfinite: int = 0
    """Optimizer steps with a non-finite loss or gradient norm to skip over the whole run (the step's batches are
    dropped with a warning naming their samples); 0 = stop at the first (exit 1, nothing saved)."""
    moments: Literal["auto", "fp32", "bf16"] = "auto"
    """Storage of AdamW's two moments: fp32, or bf16 rounded stochastically (half their memory; loss parity in
    docs/TRAINING.md). auto = fp32 unless the GPUs fit the run only with bf16 moments (the 14B on 80 GB cards)."""
    fused: bool | Auto = AUTO
    """Fused AdamW kernel (fp32 moments only); auto = on for CUDA and for host-offloaded state (--parallel.cpu-offload:
    on the CPU it steps ~14x faster than the unfused one)."""


@dataclass
class ParallelConfig:
    """Data parallelism and precision (train/parallel.py)."""

    global_batch_size: int | Auto = AUTO
    """Samples per optimizer step over all ranks; auto = micro_batch_size x world size (no accumulation)."""
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of parameters inside forward/backward (FSDP2 MixedPrecisionPolicy); masters stay fp32."""
    reduce_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Gradient reduce-scatter dtype. auto = float32 unless the run's measured auto setting reduces in bfloat16, as
    RLinf's recipe does (the 5B on >= 4 GPUs; loss parity in docs/PERFORMANCE.md)."""
    activation_checkpoint: Literal["auto", "none", "full", "selective"] = "none"
    """Recompute per block: none, full (whole block) or selective (keep matmul/attention outputs); auto = the
    fastest measured setting that fits the GPUs (train/planning/auto.py `resolve_auto`: the 5B/14B presets' default)."""
    ac_blocks: int | Auto = AUTO
    """How many blocks recompute (spread evenly over the depth); the others do --parallel.ac-others. auto = all, or
    the auto settings' choice."""
    ac_others: Literal["none", "selective"] = "none"
    """What the blocks left out by --parallel.ac-blocks do: keep every activation (none), or selective recompute.
    With full recompute on N blocks and selective on the rest, N trades speed for memory between the two."""
    compile: bool = False
    """torch.compile each block."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process group backend; auto = nccl with CUDA, else gloo."""
    deterministic: bool = False
    """Deterministic algorithms (bitwise-reproducible resume; slower on GPU)."""
    reshard_after_forward: tyro.conf.DisallowNone[bool | None] = True
    """Free gathered block parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2-like);
    auto (in a config file; the 5B/14B presets) = as --parallel.activation-checkpoint auto."""
    reduce_every_micro_batch: tyro.conf.DisallowNone[bool | None] = False
    """Reduce-scatter the gradients after every micro-batch instead of once per optimizer step. Once per step each
    rank accumulates the full model's gradients in the reduce dtype between micro-batches (fp32: 4 bytes per
    parameter, 20 GB for the 5B, 66 GB for the 14B); every micro-batch keeps only this rank's shard (4/world bytes)
    for accum-times the gradient traffic. Without accumulation (global batch = micro-batch x world) both are the same.
    auto (in a config file; the 5B/14B presets) = as --parallel.activation-checkpoint auto."""
    gather_once_per_step: tyro.conf.DisallowNone[bool | None] = False
    """All-gather each block's parameters once per optimizer step instead of once per micro-batch: they stay
    gathered from the first micro-batch's forward to the last one's backward (FSDP2 reshards after backward on the
    last micro-batch only). Needs --parallel.no-reshard-after-forward, whose peak (between forward and backward)
    already holds every block gathered. Pays with the gradients reduced every micro-batch, which frees the memory
    that the gathered weights would otherwise squeeze (docs/PERFORMANCE.md). auto (in a config file; the 5B/14B
    presets) = as --parallel.activation-checkpoint auto (never with resharding after forward)."""
    float8: Literal["auto", "none", "tensorwise", "rowwise"] = "none"
    """Float8 matmuls in the DiT blocks' linears (torchao float8 training; pip install -e '.[fp8]'; CUDA compute
    capability >= 8.9): tensorwise = one scale per tensor, FSDP all-gathers the weights in float8 (unless
    --parallel.no-float8-all-gather); rowwise = one scale per row (closer to bf16, slower). Embeddings, head,
    encoders and norms stay bf16. auto (the 5B/14B presets) = the float8 of the recipe's fastest setting measured
    on these GPUs, where torchao and float8 matmuls are there and neither --lora.rank nor --parallel.cpu-offload is
    given, else none (train/planning/auto.py; loss parity with bf16 in docs/PERFORMANCE.md); none = the official
    bf16 numerics."""
    float8_linears: Literal["all", "tokens", "ffn"] = "all"
    """Which of a block's linears --parallel.float8 converts: all; tokens = those whose rows are the sequence's
    tokens (self-attention, the cross-attention's query and output, the FFN), not the cross-attention's key and value
    projections of the few text and image rows; ffn = the FFN's two (the widest)."""
    float8_all_gather: tyro.conf.DisallowNone[bool | None] = True
    """With --parallel.float8 tensorwise: FSDP all-gathers the weights in float8 (half of bf16's bytes; each weight is
    cast eagerly before its gather, with the scale computed after the optimizer step). Off: FSDP gathers bf16 and the
    compiled linears cast the weights to float8 inside their graphs (no eager casts, the gather's bytes of bf16).
    auto (in a config file; the 5B/14B presets) = on with several GPUs, off on one, where no bytes cross a link and
    the eager casts only cost time."""
    cpu_offload: bool = False
    """Keep the fp32 master weights, their gradients and AdamW's moments in host memory (FSDP2's CPUOffloadPolicy):
    the GPUs hold only the gathered bf16 weights and the activations, and the optimizer steps on the CPU (with the
    host's cores split over the ranks of a node). For models whose state does not fit the GPUs, such as the 14B on
    80 GB cards; slower, since every gather copies the shard in from host memory. Auto settings then take those
    measured with the offload. Not with --parallel.float8."""
    peak_tflops: float | Auto = AUTO
    """Peak dense bf16 TFLOP/s of one device for MFU; auto = detect (H100/H200: 989), unknown = no MFU."""


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
    """Resume from the newest complete checkpoint in dir, if any; --checkpoint.no-resume starts over, deleting the
    step directories an earlier run left in dir (so none of them is ever taken for this run's)."""
    save_final: bool = True
    """Save a checkpoint at the last step."""
    export: bool = True
    """Export consolidated weights (safetensors, official key names) at the end."""
    export_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """dtype of the exported weights (with --checkpoint.export-base holding weights: the base's dtypes instead)."""
    export_prefix: Literal["", "action_head.model."] = ""
    """Key prefix of the export: '' = plain DiT names; 'action_head.model.' = a DreamZero checkpoint layout."""
    export_base: Path | None = None
    """Official DreamZero checkpoint folder the run started from (config.json, experiment_cfg/conf.yaml, weights;
    for a Wan-base start the first two alone): the export becomes an eval-ready folder in its layout with the
    shards' statistics (train/dit/export.py, docs/EVALUATION.md); checked at start-up. None = plain weights."""
    export_lora: Literal["merged", "lora-only"] = "merged"
    """A LoRA run's export: merged = plain weights with W + (alpha/rank) B@A folded in (eval-ready as a full
    fine-tune); lora-only = the adapters and the trained encoder/decoder under PEFT names, for the official
    load_lora on the Wan base the run started from (docs/EVALUATION.md)."""


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
    action_interval: int = 500
    """Every N steps, the open-loop action error (train/evaluation/sample.py) on `action_samples` windows of each
    `action_shards` set, logged as action_mse/<set> and action_mse_raw/<set> with its seconds as action_s (0 = off)."""
    action_shards: tuple[str, ...] = ()
    """Shard directories the action error is measured on (default: each set's validation split, else the set)."""
    action_samples: int = 16
    """Windows per set for the action error: the first N of its manifest."""
    wandb_project: str | None = None
    """Weights & Biases project to log to beside TensorBoard: rank 0 logs each interval's metrics.jsonl fields and
    the run config once, in a run named after <checkpoint.dir>, its files under $WANDB_DIR or else
    <checkpoint.dir>/wandb (needs the wandb extra). None = no W&B."""
    wandb_mode: Literal["online", "offline"] | None = None
    """online: stream to the W&B server; offline: write the run locally, for `wandb sync` later. None = $WANDB_MODE,
    else online."""
    val_interval: int = 500
    """Validation loss every N steps and at the run's last step, on each set's validation split (<shards>/val, from
    preprocess shards --val-episodes; sets without one are left out); 0 = off (train/validate.py)."""
    val_shards: tuple[str, ...] = ()
    """Shard directories to validate on instead of each set's validation split (e.g. another dataset's build), each
    logged under its folder's name."""
    val_samples: int = 64
    """Validation samples per set at most (evenly spaced over the split's sorted keys): the cost of one validation."""
    val_batch: int | Auto = AUTO
    """Samples per validation micro-batch (auto = --data.micro-batch-size); batches, and with them the noise drawn for
    each, depend on it, never on the number of ranks."""


@dataclass
class Config:
    """Lean FSDP2 trainer for DreamZero-style DiTs on precomputed shards."""

    preset: RecipeName = "tiny"
    """Recipe whose defaults everything below starts from (configs/<preset>.yaml, section train); default: the
    --config file's preset, else tiny."""
    config: str | None = None
    """Recipe name or YAML file whose train section overrides the preset (a run directory's config.yaml
    reproduces that run); flags override it in turn."""
    steps: int = 1000
    """Optimizer steps to train for."""
    seed: int = 0
    """Seed of the model init (shared by all ranks); noise/timestep RNG is seed + rank-dependent."""
    stop_after: tyro.conf.DisallowNone[int | None] = None
    """Exit after this many steps of this invocation (not given: run to `steps`); the schedule still spans `steps`."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@functools.cache
def recipe_config(name: str) -> Config:
    """The preset `name`: the defaults above with its recipe's train section (configs/<name>.yaml), read once; shared,
    so callers take `preset_config`'s copy."""
    base = Config(
        preset=name, model=ModelConfig(name=name), checkpoint=CheckpointConfig(dir=Path("checkpoints") / name)
    )
    return configs.apply(base, configs.section(configs.recipe(name), "train", name), f"configs/{name}.yaml: train")


def preset_config(name: str) -> Config:
    """A fresh copy of the preset `name` (its recipe read on first use)."""
    if name not in configs.names():
        raise UsageError(f"unknown preset {name!r}; choose one of {configs.names()}")
    return copy.deepcopy(recipe_config(name))


def file_config(name_or_file: str, preset: str | None = None) -> Config:
    """The train section of a recipe or config file over the defaults of `preset`, else of the file's own preset
    (a recipe file: its name; else tiny)."""
    path = configs.path_of(name_or_file)
    data = configs.read(path)
    if "train" not in data:
        raise UsageError(f"{path}: no train section")
    train = configs.section(data, "train", path)
    own = path.stem if path.parent.resolve() == configs.DIR else "tiny"
    if isinstance(train.get("optim"), dict) and "fused" in train["optim"] and train["optim"]["fused"] is None:
        train["optim"]["fused"] = AUTO  # its spelling of auto before it was one word (None fails its type)
    return from_legacy(configs.apply(preset_config(preset or train.get("preset") or own), train, f"{path}: train"))


def from_legacy(cfg: Config) -> Config:
    """`cfg` with each LEGACY_AUTO number (how auto was spelled before) read as auto, in place."""
    for (section, name), old in LEGACY_AUTO.items():
        part = getattr(cfg, section)
        value = getattr(part, name)
        if not isinstance(value, bool) and value == old:
            setattr(part, name, AUTO)
    if cfg.stop_after == 0:
        cfg.stop_after = None
    return cfg


def save_config(cfg: Config, path: Path) -> None:
    """Write `cfg` as a config file that --config reads back into the same Config."""
    configs.write(path, {"train": configs.plain(cfg)}, f"torchrun train/main.py --config {path}: this run's settings")


@dataclass(frozen=True)
class BatchPlan:
    """One optimizer step: `accum` micro-batches of `micro` samples on each of the ranks, `global_batch` in all."""

    micro: int
    global_batch: int
    accum: int


def batch_plan(cfg: Config, world_size: int) -> BatchPlan:
    """The step's batch plan: accum = global batch / (micro-batch x world size), the global batch being
    --parallel.global-batch-size or else one micro-batch per rank; one line when that is no whole number."""
    micro, given = cfg.data.micro(), cfg.parallel.global_batch_size
    global_batch = micro * world_size if given == AUTO else given
    accum, rem = divmod(global_batch, micro * world_size)
    if rem or accum < 1:
        raise UsageError(f"global batch {global_batch} is not a multiple of micro-batch {micro} x {world_size} ranks")
    return BatchPlan(micro, global_batch, accum)


DEFAULT_SHARDS = Path("shards/droid")  # where `make shards` writes


def default_shards() -> Path:
    if (DEFAULT_SHARDS / MANIFEST).is_file():
        return DEFAULT_SHARDS
    raise UsageError(
        f"no shards given and {DEFAULT_SHARDS / MANIFEST} does not exist: pass --data.shards DIR (a "
        f"directory written by `python -m preprocess shards` or `make shards`)"
    )


def mixture_problem(d: DataConfig) -> str | None:
    """What is wrong with --data.mixture, or None."""
    if d.mixture and d.shards is not None:
        return f"--data.shards {d.shards} and --data.mixture: give one (a single set is --data.shards)"
    seen = set()
    for s in d.mixture:
        if not s.weight > 0:  # also NaN
            return f"--data.mixture {s.shards}: weight {s.weight} (must be > 0)"
        where = str(s.shards).rstrip("/")
        if where in seen:
            return f"--data.mixture {s.shards}: listed twice (one weight per set)"
        seen.add(where)
    return None


def validate(cfg: Config) -> None:
    """Refuse settings the trainer cannot run with, in one line, before anything starts."""
    nonfinite = configs.nonfinite(cfg)
    if nonfinite:
        raise UsageError("invalid settings: " + "; ".join(f"{flag} (must be a finite number)" for flag in nonfinite))
    d, o, p, c, m = cfg.data, cfg.optim, cfg.parallel, cfg.checkpoint, cfg.metrics
    if problem := mixture_problem(d):
        raise UsageError(f"invalid settings: {problem}")
    rules = [
        ("--steps", cfg.steps, cfg.steps >= 1, ">= 1"),
        ("--stop-after", cfg.stop_after, cfg.stop_after is None or cfg.stop_after >= 1, ">= 1"),
        ("--data.micro-batch-size", d.micro_batch_size, d.micro_batch_size == AUTO or d.micro_batch_size >= 1, ">= 1"),
        ("--data.num-workers", d.num_workers, d.num_workers >= 0, ">= 0"),
        ("--data.prefetch-factor", d.prefetch_factor, d.prefetch_factor >= 1, ">= 1"),
        ("--data.variant", d.variant, d.variant == AUTO or d.variant >= 0, ">= 0 or auto"),
        ("--model.num-layers", cfg.model.num_layers, cfg.model.num_layers == AUTO or cfg.model.num_layers >= 1, ">= 1"),
        ("--loss.shift", cfg.loss.shift, cfg.loss.shift > 0, "> 0"),
        ("--loss.num-train-timesteps", cfg.loss.num_train_timesteps, cfg.loss.num_train_timesteps >= 1, ">= 1"),
        ("--optim.lr", o.lr, o.lr > 0, "> 0"),
        ("--optim.betas", o.betas, all(0 <= b < 1 for b in o.betas), "in [0, 1)"),
        ("--optim.eps", o.eps, o.eps > 0, "> 0"),
        ("--optim.weight-decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        ("--optim.warmup-steps", o.warmup_steps, o.warmup_steps == AUTO or o.warmup_steps >= 0, ">= 0 or auto"),
        ("--optim.warmup-ratio", o.warmup_ratio, 0 <= o.warmup_ratio <= 1, "in [0, 1]"),
        ("--optim.min-lr-ratio", o.min_lr_ratio, 0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
        ("--optim.grad-clip", o.grad_clip, o.grad_clip >= 0, ">= 0"),
        ("--optim.skip-nonfinite", o.skip_nonfinite, o.skip_nonfinite >= 0, ">= 0"),
        (
            "--parallel.global-batch-size",
            p.global_batch_size,
            p.global_batch_size == AUTO
            or p.global_batch_size >= 1
            and (d.micro_batch_size == AUTO or p.global_batch_size % d.micro_batch_size == 0),
            f"auto or a positive multiple of the micro-batch {d.micro_batch_size}",
        ),
        ("--parallel.ac-blocks", p.ac_blocks, p.ac_blocks == AUTO or p.ac_blocks >= 0, ">= 0 or auto"),
        ("--parallel.peak-tflops", p.peak_tflops, p.peak_tflops == AUTO or p.peak_tflops > 0, "> 0 or auto"),
        ("--checkpoint.interval", c.interval, c.interval >= 0, ">= 0"),
        ("--checkpoint.keep-last", c.keep_last, c.keep_last >= 1, ">= 1"),
        ("--metrics.interval", m.interval, m.interval >= 1, ">= 1"),
        ("--metrics.profile-start", m.profile_start, m.profile_start >= 0, ">= 0"),
        ("--metrics.profile-steps", m.profile_steps, m.profile_steps >= 0, ">= 0"),
        ("--metrics.action-interval", m.action_interval, m.action_interval >= 0, ">= 0"),
        ("--metrics.action-samples", m.action_samples, m.action_samples >= 1, ">= 1"),
        ("--metrics.val-interval", m.val_interval, m.val_interval >= 0, ">= 0"),
        ("--metrics.val-samples", m.val_samples, m.val_samples >= 1, ">= 1"),
        ("--metrics.val-batch", m.val_batch, m.val_batch == AUTO or m.val_batch >= 1, ">= 1 or auto"),
        ("--lora.rank", cfg.lora.rank, cfg.lora.rank >= 0, ">= 0"),
        ("--lora.alpha", cfg.lora.alpha, cfg.lora.alpha > 0, "> 0"),
        ("--lora.targets", cfg.lora.targets, bool(cfg.lora.suffixes()), "at least one module-name suffix"),
        (
            "--parallel.float8",
            p.float8,
            p.float8 in ("none", "auto") or not cfg.lora.rank,
            "none with --lora.rank > 0: float8 swaps out the adapted linears",
        ),
        (
            "--parallel.cpu-offload",
            p.cpu_offload,
            not p.cpu_offload or p.float8 in ("none", "auto"),
            "off with --parallel.float8: float8 casts and scales its weights on the GPU",
        ),
        (
            "--parallel.gather-once-per-step",
            p.gather_once_per_step,
            not p.gather_once_per_step or p.reshard_after_forward is not True,
            "used with --parallel.no-reshard-after-forward, given or chosen by the auto settings: resharding after "
            "forward gathers every micro-batch's parameters again",
        ),
        (
            "--checkpoint.export-lora",
            c.export_lora,
            c.export_lora == "merged" or cfg.lora.rank > 0,
            "merged without --lora.rank",
        ),
    ]
    bad = [f"{flag} {value} (must be {need})" for flag, value, ok, need in rules if not ok]
    if bad:
        raise UsageError("invalid settings: " + "; ".join(bad))


def parse_args(argv: list[str] | None = None) -> Config:
    """The preset's defaults, then --config's train section, then every flag on top (tyro); without --data.shards
    the trainer reads `make shards`' output, shards/droid. Invalid settings exit with one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    preset, file = configs.flag_value(argv, "--preset"), configs.flag_value(argv, "--config")
    default = file_config(file, preset) if file else preset_config(preset or "tiny")
    cfg = from_legacy(cli(Config, default=default, args=argv, description=__doc__))
    if cfg.data.shards is None and not cfg.data.mixture:
        # a Path where a flag gives a str: its readers take either (str(), Path(), sets())
        cfg.data.shards = default_shards()  # pyright: ignore[reportAttributeAccessIssue]
    validate(cfg)
    return cfg
