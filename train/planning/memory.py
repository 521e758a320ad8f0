"""GPU memory of a training configuration, estimated before any work, so auto settings never pick one that runs
out of memory after a step, and a run that cannot fit refuses in one line naming what would.

Per GPU, in bytes, for P parameters (T of them trainable) sharded over N ranks:

    state          fp32 master shards 4P/N, AdamW moments 8T/N, 4T/N in bf16 (host memory with --parallel.cpu-offload)
    gradients      fp32: the rank's shard 4T/N, or, accumulated over several micro-batches without
                   --parallel.reduce-every-micro-batch, FSDP2's unsharded buffer 4T (it replaces the shard)
    gathered       bf16 parameters: the whole model (2P) when nothing reshards after forward, else two blocks
    activations    per sample and block, in units of one bf16 hidden state (tokens x dim x 2 bytes): what the
                   recompute mode keeps through the forward, plus one block's working set in backward
    overhead       CUDA context, compiled kernels' workspaces, NCCL buffers, allocator slack

The activation coefficients are fitted to the peaks measured with `scripts/bench_train.py` (docs/TRAINING.md
lists them; tests/unit/test_memory.py checks the estimate against each). One rank keeps no unsharded gradient buffer:
its reduce-scatter output is the gradient itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from wampipe import configs
from wampipe.errors import UsageError
from wampipe.train.config import AUTO, Auto
from wampipe.train.dit.lora import LoRAConfig, apply_lora
from wampipe.train.dit.model import CausalWanModel, DiTConfig, preset

GIB = 2**30
# Bytes per sample and block, in bf16 hidden states (tokens x dim x 2 bytes), kept through the forward by mode.
KEPT_PER_BLOCK = {"full": 1.0, "selective": 14.5, "none": 34.0}
WORKING_SET = 38.0  # the recomputed block's activations and gradients in backward, per sample (same unit)
# With the state in host memory, the peaks measured at micro-batches of 128 and 256 lie ~22 hidden states per sample
# above the resident runs' (not explained; the one measured at 32 does not show it): counted, so the largest
# micro-batch picked for an offloaded run fits (at 32 the estimate errs ~25 % high, which only costs speed).
OFFLOADED_WORKING_SET = 22.0
OVERHEAD = 4.5 * 10**9
MOMENT_BYTES = {"fp32": 8, "bf16": 4}
FIT_FRACTION = 0.95  # of the card's memory: what the allocator can hand out before fragmentation bites


@dataclass(frozen=True)
class ModelSize:
    """What memory depends on in the model: parameter counts and the token shape of one sample."""

    params: int
    trainable: int
    block_params: int
    blocks: int
    tokens: int
    dim: int

    @property
    def hidden_state(self) -> int:
        """Bytes of one bf16 hidden state of one sample."""
        return self.tokens * self.dim * 2


@dataclass(frozen=True)
class Plan:
    """The memory-relevant parts of a configuration."""

    ac: str
    micro: int
    reshard: bool
    reduce_every: bool
    accumulation: int  # micro-batches per step
    world: int
    cpu_offload: bool = False
    ac_blocks: int | Auto = AUTO  # blocks under `ac` (the rest under ac_others); auto = all
    ac_others: str = "none"
    moment_bytes: int = 8  # both AdamW moments per trainable parameter: fp32 8, bf16 4 (--optim.moments)


@dataclass(frozen=True)
class Estimate:
    state: int
    gradients: int
    gathered: int
    activations: int
    overhead: float  # OVERHEAD, a float

    @property
    def total(self) -> float:
        return self.state + self.gradients + self.gathered + self.activations + self.overhead

    @property
    def gib(self) -> float:
        return self.total / GIB


def model_size(dit: DiTConfig, latents: tuple[int, int, int], lora: LoRAConfig | None = None) -> ModelSize:
    """Parameter counts of `dit` (built on the meta device: no memory, no init cost worth naming) with `lora`, and
    the tokens of one sample whose latents are (frames, height, width)."""
    with torch.device("meta"):
        model = CausalWanModel(dit)
    if lora is not None:
        apply_lora(model, lora)
    count = lambda ps: sum(p.numel() for p in ps)  # noqa: E731
    frames, h, w = latents
    tokens = dit.layout(frames, (h // 2) * (w // 2)).seq_len
    return ModelSize(
        count(model.parameters()),
        count(p for p in model.parameters() if p.requires_grad),
        count(model.blocks[0].parameters()),
        len(model.blocks),
        tokens,
        dit.dim,
    )


def recipe_size(name: str, lora: LoRAConfig | None = None, num_layers: int | Auto = AUTO) -> ModelSize | None:
    """`model_size` of a recipe's DiT at its sample shape (configs/<name>.yaml, sections dit and synthetic)."""
    shape = configs.recipe(name).get("synthetic", {}).get("latents")
    dit = preset(name, **({} if num_layers == AUTO else {"num_layers": num_layers}))
    return None if shape is None else model_size(dit, tuple(shape[1:]), lora)


def run_size(cfg) -> ModelSize | None:
    """`recipe_size` of a trainer Config (its DiT, block count and LoRA)."""
    return recipe_size(cfg.model.name, cfg.lora if cfg.lora.rank else None, cfg.model.num_layers)


def estimate(size: ModelSize, plan: Plan) -> Estimate:
    n, p, t = plan.world, size.params, size.trainable
    state = 0 if plan.cpu_offload else 4 * p // n + plan.moment_bytes * t // n
    accumulating = plan.accumulation > 1 and not plan.reduce_every and n > 1
    if plan.cpu_offload:
        gradients = 4 * size.block_params  # a block's unsharded fp32 gradients on their way to the host
    else:
        gradients = 4 * t if accumulating else 4 * t // n
    gathered = 2 * p if not plan.reshard else 2 * 2 * size.block_params
    ac_blocks = size.blocks if plan.ac_blocks == AUTO else min(plan.ac_blocks, size.blocks)
    kept = ac_blocks * KEPT_PER_BLOCK[plan.ac] + (size.blocks - ac_blocks) * KEPT_PER_BLOCK[plan.ac_others]
    working = WORKING_SET + (OFFLOADED_WORKING_SET if plan.cpu_offload else 0.0)
    activations = int(plan.micro * size.hidden_state * (kept + working))
    return Estimate(state, gradients, gathered, activations, OVERHEAD)


def offload_traffic(size: ModelSize, plan: Plan, gather_once: bool = False) -> tuple[int, int]:
    """Bytes one rank copies between host and GPU per optimizer step with --parallel.cpu-offload: in, its fp32
    parameter shard before every all-gather (each micro-batch's forward, and its backward again after resharding;
    once a step with `gather_once`); out, its fp32 gradient shard after every reduce-scatter (every micro-batch's
    with `plan.reduce_every`, else the step's last). The last block stays gathered from forward to backward
    (train/parallel.py); the root is gathered again."""
    regathered = size.params - size.block_params if plan.reshard else 0
    gathered = size.params + regathered if not gather_once else size.params
    micro_batches = 1 if gather_once else plan.accumulation
    reduces = plan.accumulation if plan.reduce_every else 1
    return micro_batches * 4 * gathered // plan.world, reduces * 4 * size.trainable // plan.world


def fits(size: ModelSize, plan: Plan, gpu_gib: float) -> bool:
    return estimate(size, plan).gib <= FIT_FRACTION * gpu_gib


def _plan(setting, cfg, world: int, offload: bool) -> Plan:
    given = cfg.parallel.global_batch_size
    global_batch = setting.micro * world if given == AUTO else given
    return Plan(
        setting.ac,
        setting.micro,
        setting.reshard,
        setting.reduce_every or offload,
        max(1, global_batch // (setting.micro * world)),
        world,
        offload,
        setting.ac_blocks,
        setting.ac_others,
        MOMENT_BYTES[setting.moments],
    )


def fits_fp32_moments(size: ModelSize | None, cfg, setting, gpu_gib: float, world: int) -> bool:
    """Whether `setting` is estimated to fit `world` GPUs of `gpu_gib` with fp32 AdamW moments (--optim.moments auto
    takes a setting measured with bf16 moments only where they are needed). `size`: `run_size(cfg)`."""
    plan = _plan(replace(setting, moments="fp32"), cfg, world, cfg.parallel.cpu_offload)
    return size is not None and fits(size, plan, gpu_gib)


def _candidates(setting, auto: dict, global_batch: int | Auto, world: int, offload: bool):
    """`setting`, then what trades speed for memory among the auto parts: the per-micro-batch reduce, then smaller
    micro-batches (each keeping the global batch a whole number of micro-batches per rank). With the state in host
    memory every micro-batch copies all gradients to the host and adds them there, so there the largest micro-batch
    that fits comes first, from one micro-batch per step down."""
    whole = lambda micro: global_batch == AUTO or global_batch % (micro * world) == 0  # noqa: E731
    if offload and auto["micro"] and global_batch != AUTO:
        for micro in range(global_batch // world, 0, -1):
            if whole(micro):
                yield replace(setting, micro=micro)
        return
    yield setting
    if auto["reduce"]:
        setting = replace(setting, reduce_every=True)
        yield setting
    if auto["micro"]:
        for micro in range(setting.micro - 1, 0, -1):
            if whole(micro):
                yield replace(setting, micro=micro)


def _gib(size: ModelSize, plan: Plan) -> str:
    return f"~{estimate(size, plan).gib:.0f} GiB"


def fitting_setting(cfg, size: ModelSize, setting, auto: dict, gpu_gib: float, world: int):
    """The first of `_candidates` estimated to fit `world` GPUs of `gpu_gib`, with a line saying so; else
    UsageError with one line naming what would fit (LoRA, the host offload, more GPUs of this size)."""
    p = cfg.parallel
    given = {
        "ac": None if auto["ac"] else p.activation_checkpoint,
        "micro": None if auto["micro"] else cfg.data.micro_batch_size,
        "reshard": None if auto["reshard"] else p.reshard_after_forward,
        "reduce_every": None if auto["reduce"] else p.reduce_every_micro_batch,
    }
    setting = replace(setting, **{k: v for k, v in given.items() if v is not None})
    # with --optim.moments auto: bf16 moments only where nothing fits with fp32 ones
    moments = ["fp32", "bf16"] if cfg.optim.moments == "auto" else [cfg.optim.moments]
    for candidate in (
        c
        for m in moments
        for c in _candidates(replace(setting, moments=m), auto, p.global_batch_size, world, p.cpu_offload)
    ):
        plan = _plan(candidate, cfg, world, p.cpu_offload)
        if fits(size, plan, gpu_gib):
            return candidate, f"estimated to fit, {_gib(size, plan)} of {gpu_gib:.0f} (train/planning/memory.py)"
    need = estimate(size, plan)  # the last candidate's: what trades the most for memory
    options = []
    if not cfg.lora.rank:
        lora = recipe_size(cfg.model.name, LoRAConfig(rank=16), cfg.model.num_layers)
        assert lora is not None  # the recipe has a sample shape: `size` was sized from it
        as_given = _plan(setting, cfg, world, p.cpu_offload)
        if fits(lora, as_given, gpu_gib):
            options.append(f"--lora.rank 16 ({_gib(lora, as_given)})")
    bf16 = replace(_plan(candidate, cfg, world, p.cpu_offload), moment_bytes=MOMENT_BYTES["bf16"])
    if cfg.optim.moments == "fp32" and not p.cpu_offload and fits(size, bf16, gpu_gib):
        options.append(f"--optim.moments bf16 ({_gib(size, bf16)})")
    offloaded = _plan(setting, cfg, world, True)
    if not p.cpu_offload and p.float8 == "none" and fits(size, offloaded, gpu_gib):
        options.append(
            f"--parallel.cpu-offload ({_gib(size, offloaded)} per GPU, the fp32 state's "
            f"{16 * size.params / 1e9:.0f} GB and more in host memory)"
        )
    more = next(
        (
            n
            for n in (2, 4, 8, 16, 32, 64)
            if n > world and fits(size, _plan(candidate, cfg, n, p.cpu_offload), gpu_gib)
        ),
        None,
    )
    if more:
        options.append(f"{more} GPUs of this size")
    gpus = f"{world} GPU{'s' if world > 1 else ''} of {gpu_gib:.0f} GiB"
    raise UsageError(
        f"{cfg.preset} does not fit {gpus}: even {candidate.describe()} needs ~{need.gib:.0f} GiB per "
        f"GPU ({(need.state + need.gradients) / GIB:.0f} GiB of weights, moments and gradients); "
        + (
            f"would fit: {', '.join(options)}"
            if options
            else "neither LoRA, the host offload nor up to 64 such GPUs would fit it"
        )
    )
