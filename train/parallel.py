"""Parallelism applied from outside to an unmodified CausalWanModel, torchtitan's order: float8 linears (optional)
-> activation checkpointing per block -> torch.compile per block -> fully_shard per block -> fully_shard(root).

The model keeps its official parameter names: the checkpoint wrapper and compile's `_orig_mod` are stripped by
torch.distributed.checkpoint's state-dict helpers, which checkpoint.py uses for saving and exporting.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from wampipe.errors import UsageError
from wampipe.train.config import AUTO, Auto, ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# Selective recompute keeps the outputs of these (the expensive ops) and recomputes the cheap elementwise rest.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_mm.default,  # float8 matmuls
    torch.ops.aten.max.default,  # float8 scales: a full reduction to re-run, a scalar to keep (torchtitan)
}


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if op in _SAVE_OPS or "flex_attention" in str(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def ac_block_indices(num_blocks: int, ac_blocks: int | Auto) -> list[int]:
    """The `ac_blocks` of `num_blocks` blocks that recompute, spread evenly (auto = all)."""
    k = num_blocks if ac_blocks == AUTO else min(ac_blocks, num_blocks)
    return sorted({i * num_blocks // k for i in range(k)}) if k else []


def recomputed_blocks(mode: str, ac_blocks: int | Auto, num_blocks: int) -> int:
    """Blocks whose matmuls run twice under recompute `mode` (full); selective re-runs only elementwise ops."""
    return len(ac_block_indices(num_blocks, ac_blocks)) if mode == "full" else 0


def apply_ac(model: nn.Module, mode: str, ac_blocks: int | Auto = AUTO, others: str = "none") -> None:
    """Wrap blocks for recompute: 'full' recomputes the whole block in backward, 'selective' only the cheap ops
    (matmul, conv and attention outputs are kept). `ac_blocks` >= 0 wraps only that many, spread evenly; the
    other blocks get `others` ('none' or 'selective')."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"activation checkpointing must be none, full or selective, got {mode!r}")
    if others not in ("none", "selective"):
        raise ValueError(f"the blocks outside ac_blocks recompute none or selective, got {others!r}")
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = cast(nn.ModuleList, model.blocks)  # the DiT's (train/dit/model.py)
    chosen = set(ac_block_indices(len(blocks), ac_blocks))
    for i in range(len(blocks)):
        block_mode = mode if i in chosen else others
        if block_mode == "none":
            continue
        kwargs: dict[str, Any] = {"preserve_rng_state": False}
        if block_mode == "selective":
            kwargs["context_fn"] = _selective_context
        blocks.register_module(str(i), checkpoint_wrapper(blocks[i], **kwargs))


def computes_on_cuda(cfg: ParallelConfig) -> bool:
    """Whether the ranks compute on CUDA GPUs: there are some, and --parallel.backend is not gloo."""
    return torch.cuda.is_available() and cfg.backend != "gloo"


ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_settings(environ) -> str | None:
    """The CUDA allocator settings `use_expandable_segments` applies: the environment's own (PYTORCH_ALLOC_CONF, else
    PYTORCH_CUDA_ALLOC_CONF) with expandable segments added, since applying settings resets every one not named.
    None where the environment chooses itself: it names expandable_segments, or another allocator backend."""
    conf = next((environ[v] for v in ALLOC_CONF_VARS if environ.get(v)), "")
    if "expandable_segments" in conf or "backend:" in conf:
        return None
    return ",".join(filter(None, [conf, "expandable_segments:True"]))


def use_expandable_segments(device: torch.device) -> bool:
    """Let the CUDA caching allocator grow segments in place rather than cache fixed-size blocks, unless the
    environment chooses (`allocator_settings`). Why: near the memory ceiling fixed blocks fragment; the 14B float8
    mix with 28 selective blocks on 4 H200 failed to allocate 0.8 GiB with 9.3 GiB reserved but unused, and runs at
    131 GiB with this. Set at runtime (before the first allocation), so it holds whatever imported torch first.
    Returns whether it set it."""
    settings = allocator_settings(os.environ)
    if device.type != "cuda" or settings is None:
        return False
    torch._C._accelerator_setAllocatorSettings(settings)
    return True


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """torch.compile each block separately (all blocks share one graph: same shapes, same code)."""
    blocks = cast(nn.ModuleList, model.blocks)  # the DiT's (train/dit/model.py)
    for i, block in enumerate(blocks):
        # a compiled module is a module (OptimizedModule), though torch.compile is typed as returning a callable
        blocks.register_module(str(i), cast(nn.Module, torch.compile(block, backend=backend, fullgraph=True)))


def reduce_dtype(cfg: ParallelConfig) -> str:
    """--parallel.reduce-dtype auto that the auto settings left unresolved (nothing auto, or CPU) reduces in fp32."""
    return "float32" if cfg.reduce_dtype == "auto" else cfg.reduce_dtype


def apply_fsdp(model: nn.Module, cfg: ParallelConfig, mesh=None) -> None:
    """fully_shard every block, then the root (embeddings, head, encoders). Parameters stay fp32 (the masters);
    forward/backward gather them in `param_dtype`; gradients are reduce-scattered in `reduce_dtype`.

    Forward inputs are not cast: FSDP2's default would round the timesteps (1000 values -> 294 in bf16), the fp32
    RoPE tables and the compact-text log-weights before the model sees them. The model casts its activations to
    the parameter dtype itself, as the reference's autocast does, and keeps those three in fp32.

    --parallel.cpu-offload: the fp32 shards and their gradients live in host memory (pinned where a GPU computes);
    each gather copies the shard to the GPU first, each reduce-scatter copies the result back."""
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[reduce_dtype(cfg)], cast_forward_inputs=False
    )
    # pinned host memory: asynchronous copies to and from a computing GPU
    offload = CPUOffloadPolicy(pin_memory=computes_on_cuda(cfg)) if cfg.cpu_offload else OffloadPolicy()
    blocks = list(cast(nn.ModuleList, model.blocks))  # the DiT's (train/dit/model.py)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again first in backward: keep them gathered
        reshard = cfg.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward, offload_policy=offload)


def offload_host_bytes(model: nn.Module, world: int, pinned: bool, accumulating: bool = False) -> int:
    """Host memory the first of `world` ranks holds with --parallel.cpu-offload, the most of any rank (from the
    unsharded shapes, before any step; a meta model will do): per parameter, the rank's fp32 shard (dim 0 split over
    the ranks; rank 0's chunk is the padded size FSDP2 stores on every rank), its gradient and AdamW's two moments
    where it trains. Shards and gradients are pinned where a GPU computes (`pinned`), and the pinned-memory allocator
    rounds each one up to a power of two. For the 14B on 4 ranks: 83.6 GB each, 334 GB per node, where 337-341 GB
    were in use (the processes' own memory on top). `accumulating`: one gradient shard more, the sum of the step's
    earlier micro-batches (`HostGradientSum`)."""
    total = 0
    for p in model.parameters():
        rows = -(-p.shape[0] // world) if p.dim() else 1
        shard = rows * (p.numel() // p.shape[0] if p.dim() else 1) * 4
        held = 1 << (shard - 1).bit_length() if pinned and shard else shard
        total += held + (held * (2 if accumulating else 1) + 2 * shard if p.requires_grad else 0)
    return total


PROCESS_HOST_BYTES = 2 * 10**9  # a rank's own host memory besides the offloaded state (torch, CUDA context, loader)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 says "max" for no limit


def host_memory_available() -> int | None:
    """Bytes this process may still take: MemAvailable of /proc/meminfo, or less where a cgroup (a container, a
    Slurm job) limits the memory (its limit minus its use). None where neither is known."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    for limit, used in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2, then v1
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit_bytes, used_bytes = _read_int(limit), _read_int(used)
        if limit_bytes is not None and used_bytes is not None and limit_bytes < 2**60:  # v1's "no limit" is ~2**63
            found.append(max(0, limit_bytes - used_bytes))
    return min(found) if found else None


def check_host_memory(per_rank: int, local_ranks: int, available: int | None) -> None:
    """Refuse --parallel.cpu-offload in one line where this node's ranks would not fit its host memory (the kernel
    would kill a rank mid-build instead). `per_rank`: `offload_host_bytes`; each rank also takes PROCESS_HOST_BYTES.
    `available`: the least any rank found (all ranks decide alike)."""
    need = (per_rank + PROCESS_HOST_BYTES) * local_ranks
    if available is not None and need > available:
        raise UsageError(
            f"--parallel.cpu-offload: this node's {local_ranks} rank(s) need ~{need / 1e9:.0f} GB of host "
            f"memory ({per_rank / 1e9:.1f} GB each of fp32 shards, gradients and AdamW moments, "
            f"{PROCESS_HOST_BYTES / 1e9:.0f} GB for the process), {available / 1e9:.0f} GB is available; "
            f"use more nodes, or train LoRA adapters (--lora.rank)"
        )


def prepare_micro_batch(model: nn.Module, cfg: ParallelConfig, index: int, count: int) -> None:
    """FSDP2's settings for micro-batch `index` of the `count` in an optimizer step: reduce-scatter the gradients
    after its backward on the last one only (every one with --parallel.reduce-every-micro-batch); with
    --parallel.gather-once-per-step, keep the gathered parameters after backward on all but the last, so the next
    micro-batch's forward finds them gathered."""
    last = index == count - 1
    sharded = cast("FSDPModule", model)  # fully_shard made it one (apply_fsdp)
    every = cast(bool, cfg.reduce_every_micro_batch)  # None (auto) is resolved before the first step
    sharded.set_requires_gradient_sync(last or every)
    if cfg.gather_once_per_step:
        sharded.set_reshard_after_backward(last)


class HostGradientSum:
    """The step's gradient sum over micro-batches with --parallel.cpu-offload, kept outside FSDP2. FSDP2 adds a
    micro-batch's offloaded gradient shard to one already there by copying it from the GPU synchronously into fresh
    pageable host memory inside backward and adding it there while the GPU waits (its foreach_reduce); only a first
    gradient takes the overlapped copy into pinned memory. On the 5B on one H200 two micro-batches of 128 a step took
    39.5 s against 20.5 s for one of 256 (docs/PERFORMANCE.md). So after each micro-batch's backward but the last,
    its gradients are taken away (the next one's find none and take the fast path) and summed here on the host; after
    the last one the sum is added into them: the same fp32 sums bit for bit (operands swapped), one gradient shard
    of host memory more (`offload_host_bytes(..., accumulating=True)`)."""

    def __init__(self):
        self.sums: dict[nn.Parameter, torch.Tensor] = {}  # parameter -> its gradient summed so far (as FSDP2 made it)

    @torch.no_grad()
    def after_backward(self, model: nn.Module, last: bool) -> None:
        """Right after a micro-batch's `.backward()` returned: FSDP2's final callback has waited for the gradients'
        copies to the host by then (the last backward of the step, which every micro-batch's is here)."""
        for p in model.parameters():
            held = self.sums.get(p)
            if p.grad is None:  # none this time (a parameter outside this micro-batch's graph): the sum stays
                if last and held is not None:
                    p.grad = held
                continue
            if last:
                if held is not None:
                    local_tensor(p.grad).add_(local_tensor(held))
                continue
            if held is None:
                self.sums[p] = p.grad
            else:
                local_tensor(held).add_(local_tensor(p.grad))
            p.grad = None
        if last:
            self.sums.clear()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (its own storage: in-place changes land in the DTensor), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


# the cross-attention's projections of the context (text and CLIP rows: a few hundred per sample, against the
# thousand-odd token rows of every other linear), left out by --parallel.float8-linears tokens
CONTEXT_LINEARS = ("cross_attn.k", "cross_attn.v", "cross_attn.k_img", "cross_attn.v_img")
FFN_LINEARS = ("ffn.0", "ffn.2")


def float8_filter(module: nn.Module, fqn: str, linears: str = "all") -> bool:
    """The linears float8 training converts: those inside the DiT blocks whose widths are multiples of 16 (float8
    matmul kernels need them) and that `linears` names (all, tokens or ffn: --parallel.float8-linears); the
    embeddings, head and action/state encoders stay in bf16."""
    if not (
        fqn.startswith("blocks.")
        and isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    ):
        return False
    name = fqn.split(".", 2)[2]  # blocks.<i>.<name in the block>
    if linears == "tokens":
        return name not in CONTEXT_LINEARS
    return linears == "all" or name in FFN_LINEARS


def float8_missing(capability: tuple[int, int] | None) -> str | None:
    """Why float8 matmuls cannot run here, as the end of a sentence, or None where they can: torchao is not installed,
    or there is no CUDA device of compute capability >= 8.9 (`capability`; None = no CUDA device)."""
    try:  # first: the missing extra is named wherever it is asked for, a CPU machine included
        import torchao.float8  # noqa: F401
    except ImportError:
        return "needs torchao: pip install 'wampipe[fp8]'"
    if capability is None or tuple(capability) < (8, 9):
        found = "no CUDA device" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
        return f"needs a CUDA GPU of compute capability >= 8.9 (float8 matmuls), found {found}"
    return None


def auto_float8_missing(mode: str, capability: tuple[int, int] | None) -> str | None:
    """`float8_missing` as resolve_auto takes it, torchao imported only where --parallel.float8 auto could choose
    float8 (a CUDA device): on a CPU auto keeps bf16 anyway, and importing torchao there warns on stderr that its CUDA
    kernels did not load."""
    if mode != "auto":
        return None  # not consulted
    if capability is None:
        return "needs a CUDA GPU of compute capability >= 8.9 (float8 matmuls), found no CUDA device"
    return float8_missing(capability)


def check_float8(mode: str, capability: tuple[int, int] | None) -> None:
    """Refuse --parallel.float8 in one line where it cannot run (`float8_missing`)."""
    if mode != "none" and (missing := float8_missing(capability)):
        raise UsageError(f"--parallel.float8 {mode} {missing}")


def apply_float8(model: nn.Module, mode: str, linears: str = "all", all_gather: bool = True) -> int:
    """Swap `float8_filter`'s linears for torchao's Float8Linear (same parameter names, so checkpoints and exports do
    not change) with the `mode` recipe; tensorwise with `all_gather` lets FSDP all-gather the weights in float8 (then
    call `float8_after_step` after each optimizer step). Returns the number of converted linears."""
    if mode == "none":
        return 0
    if linears not in ("all", "tokens", "ffn"):  # once here, not in the filter torchao calls for every module
        raise ValueError(f"float8 linears must be all, tokens or ffn, got {linears!r}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    # pad_inner_dim: the weight gradient's matmul reduces over tokens (micro-batch x sequence, e.g. 4 x 257 CLIP rows),
    # which float8 kernels need in multiples of 16; zero rows are exact
    config = replace(
        Float8LinearConfig.from_recipe_name(mode),
        enable_fsdp_float8_all_gather=mode == "tensorwise" and all_gather,
        pad_inner_dim=True,
    )
    if mode == "rowwise":  # compiled float8 casts then round as eager ones do (torchtitan sets it too)
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    convert_to_float8_training(
        model, module_filter_fn=lambda module, fqn: float8_filter(module, fqn, linears), config=config
    )
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def float8_after_step(model: nn.Module, mode: str) -> None:
    """After an optimizer step with tensorwise float8: every float8-gathered weight's scale for the next all-gathers,
    in one all-reduce (instead of one per weight during forward); nothing when FSDP gathers them in bf16."""
    if mode == "tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def parallelize(model: nn.Module, cfg: ParallelConfig, mesh=None) -> nn.Module:
    unresolved = "auto" in (cfg.activation_checkpoint, cfg.float8) or cfg.reshard_after_forward is None
    if unresolved or cfg.float8_all_gather is None:
        raise ValueError("auto settings are unresolved: pass the config through train.planning.auto.resolve_auto first")
    apply_float8(model, cfg.float8, cfg.float8_linears, cfg.float8_all_gather)
    apply_ac(model, cfg.activation_checkpoint, cfg.ac_blocks, cfg.ac_others)
    if cfg.compile:
        apply_compile(model)
    apply_fsdp(model, cfg, mesh)
    return model
