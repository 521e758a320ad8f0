"""AdamW, linear warmup + cosine decay, global gradient-norm clipping (docs/REFERENCE.md#10-optimizer-recipe)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from wampipe.train.config import AUTO, OptimConfig
from wampipe.train.parallel import local_tensor


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, offloaded: bool = False, seed: int = 0
) -> torch.optim.Optimizer:
    """AdamW on every trainable parameter with the same weight decay (as RLinf; the official trainer exempts biases
    and LayerNorms). `offloaded`: the state lives in host memory (--parallel.cpu-offload). `seed` seeds the
    stochastic rounding of bf16 moments (--optim.moments auto, where the auto settings did not resolve it, is fp32)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.moments == "bf16":
        return AdamWBf16Moments(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, seed=seed
        )
    fused = (device.type == "cuda" or offloaded) if cfg.fused == AUTO else cfg.fused
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused
    )


def round_stochastic(value: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`value` (float32) rounded to one of its two neighbouring bf16 values with probabilities that make the
    rounding unbiased: random bits are added below bf16's 16-bit mantissa cut, then cut off."""
    bits = value.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    return ((bits + noise) & -(1 << 16)).view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are 0


class AdamWBf16Moments(torch.optim.Optimizer):
    """torch's AdamW update (decoupled weight decay, bias-corrected moments, computed in float32) with both moments
    stored in bf16: 4 bytes per parameter instead of 8, which is what fits the 14B's state on 80 GB cards. The
    moments are rounded stochastically: to nearest, the second moment's per-step change ((1 - beta2) of it) is below
    bf16's resolution and would be lost. The rounding bits come from a generator seeded by (seed, step, rank), so a
    resumed run continues exactly as an uninterrupted one."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.seed = seed

    def _generator(self, device: torch.device, step: int) -> torch.Generator:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return torch.Generator(device).manual_seed(hash((self.seed, step, rank)) & (2**63 - 1))

    @torch.no_grad()
    def step(self, closure=None):
        generators = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                step = int(state["step"].item())  # a host tensor: no device sync
                param, grad = local_tensor(p), local_tensor(p.grad).float()
                exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
                m = exp_avg.float().lerp_(grad, 1 - beta1)
                v = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
                param.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**step))
                key = (param.device, step)
                if key not in generators:
                    generators[key] = self._generator(param.device, step)
                exp_avg.copy_(round_stochastic(m, generators[key]))
                exp_avg_sq.copy_(round_stochastic(v, generators[key]))


def warmup_steps(cfg: OptimConfig, steps: int) -> int:
    return int(math.ceil(cfg.warmup_ratio * steps)) if cfg.warmup_steps == AUTO else cfg.warmup_steps


def lr_factor(step: int, warmup: int, steps: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warmup from lr/warmup to lr
    over `warmup` steps, then a half cosine to `min_ratio` x lr at `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, steps: int, start: int = 0, warmup: int | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr of optimizer step `start` + i is a pure function of the step, so nothing of it is checkpointed. A
    resumed run passes its step and the warmup it started with: a longer --steps continues the cosine over the new
    total from the current step (the lr rises to the new curve's value there), without warming up again."""
    warm = warmup_steps(cfg, steps) if warmup is None else warmup
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(start + i, warm, steps, cfg.min_lr_ratio))


def apply_hyperparameters(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> None:
    """The flags' peak lr, betas, eps and weight decay, over those a loaded checkpoint restored; call before
    `build_scheduler` (it scales `initial_lr`)."""
    for group in optimizer.param_groups:
        group.update(initial_lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


HOST_NORM_CHUNK = 1 << 24  # elements per task of the host gradient norm


def host_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of host tensors, in chunks over torch's intra-op threads. Why: torch's norm kernels reduce a host
    tensor on one core (2.75 s for the 5B's 22 GB of fp32 gradients in host memory, longer than the GPU's step)."""
    chunks = [
        flat[i : i + HOST_NORM_CHUNK]
        for t in tensors
        for flat in (t.detach().reshape(-1),)
        for i in range(0, flat.numel(), HOST_NORM_CHUNK)
    ]
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:  # torch releases the GIL inside each norm
        norms = list(pool.map(lambda c: torch.linalg.vector_norm(c, dtype=torch.float32), chunks))
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of `grads` (DTensor shards: over every rank)."""
    if not grads or grads[0].device.type != "cpu":
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # sums the squared shard norms over ranks
    if not isinstance(grads[0], DTensor):
        return host_norm(grads)
    squares = host_norm([cast(DTensor, g).to_local() for g in grads]) ** 2  # one model's: all sharded alike
    dist.all_reduce(squares, group=grads[0].device_mesh.get_group())
    return squares.sqrt()


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (over every rank's shards), clipped to `max_norm` when it is > 0."""
    norm = total_norm([p.grad for p in model.parameters() if p.grad is not None])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters()], max_norm, norm, foreach=True)
    return norm
