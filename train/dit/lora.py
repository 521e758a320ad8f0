"""LoRA fine-tuning, the official recipe's `train_architecture: lora`: every DiT parameter frozen, a rank-r update
on the linears whose names end in a target suffix (q, k, v, o, ffn.0, ffn.2: both attentions and the FFN, not
k_img / v_img), and the action/state encoder and decoder trained in full.

A targeted `nn.Linear` becomes a `LoRALinear` holding the same `weight` and `bias` objects plus `lora_A` [r, in]
and `lora_B` [out, r]: output = base(x) + (x A^T B^T) * alpha / r. The base keeps its official names, so
--model.init-from loads it as for full fine-tuning; the adapters are no checkpoint tensors of the official layout
(train/dit/weights.py leaves them out) and get their own seeded init after the load (`init_lora`). Apply before
FSDP2 (`fully_shard` keeps each parameter's requires_grad). A module of our own rather than PEFT: PEFT renames
every key (`base_model.model.…base_layer.weight`), which the loader, the DCP checkpoints and the exports would all
have to undo; the PEFT names appear only in the lora-only export (`peft_name`).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from wampipe.errors import UsageError
from wampipe.train.config import LoRAConfig
from wampipe.train.dit.weights import fill_rows, model_tensors, official_name

ADAPTERS = ("lora_A", "lora_B")
# the official recipe re-enables these (new in DreamZero) after freezing the DiT
TRAINABLE = ("state_encoder", "action_encoder", "action_decoder")
# an official LoRA checkpoint's DiT keys: the DiT wrapped by PEFT (adapter "default")
PEFT_PREFIX = "action_head.model.base_model.model."


class LoRALinear(nn.Linear):
    """`base` (its own weight and bias) plus the low-rank update; dropout 0."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.scale = alpha / rank
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **like))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, rank, **like))

    def forward(self, x):
        return super().forward(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale


def is_target(name: str, suffixes: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) for s in suffixes)


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> int:
    """Freeze `model` but `TRAINABLE`, swap the targeted linears for LoRALinear (adapters uninitialised: call
    `init_lora` once the weights are in place). Returns the number of adapted layers (0 with rank 0: untouched)."""
    if cfg.rank == 0:
        return 0
    targets = [
        (name, m) for name, m in model.named_modules() if type(m) is nn.Linear and is_target(name, cfg.suffixes())
    ]
    if not targets:
        raise UsageError(f"--lora.targets {cfg.targets}: no nn.Linear of the model has a name ending in one")
    model.requires_grad_(False)
    for name in TRAINABLE:
        getattr(model, name).requires_grad_(True)
    for name, linear in targets:
        parent, _, leaf = name.rpartition(".")
        model.get_submodule(parent).register_module(leaf, LoRALinear(linear, cfg.rank, cfg.alpha))
    # what checkpoints record (`lora_fields`); torch types a module's attributes as tensors and modules only
    model.lora = cfg  # pyright: ignore[reportArgumentType]
    return len(targets)


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """PEFT's default init of every adapter: A kaiming-uniform(a=sqrt(5)), B zeros (the update starts at 0). A is
    drawn in full from a generator seeded by (seed, layer name), so every rank and every layout (plain, sharded,
    meta-built) gets the same values; each rank copies its own rows."""
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            key = official_name(name)
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (1 << 63))
            _copy_rows(m.lora_A, nn.init.kaiming_uniform_(torch.empty(m.lora_A.shape), a=math.sqrt(5), generator=gen))
            _copy_rows(m.lora_B, torch.zeros(m.lora_B.shape))


def _copy_rows(t: torch.Tensor, full: torch.Tensor) -> None:
    fill_rows(t, lambda rows: full if rows is None else full[rows[0] : rows[1]])


def lora_fields(model: nn.Module) -> dict:
    """{'lora': rank, alpha, targets} of a LoRA model, {} otherwise: part of what a checkpoint must match."""
    cfg = getattr(model, "lora", None)
    return {"lora": {"rank": cfg.rank, "alpha": cfg.alpha, "targets": list(cfg.suffixes())}} if cfg else {}


def fold(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in fp32 (what PEFT's merge_and_unload computes)."""
    return weight.float() + scale * (lora_B.float() @ lora_A.float())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class Folded:
    """A LoRALinear's merged weight, computed when an export gathers it (`full_tensor`, collective when sharded):
    one layer's full weight at a time, never the whole merged model."""

    def __init__(self, layer: LoRALinear):
        self.layer = layer
        self.shape = layer.weight.shape

    def numel(self) -> int:
        return self.layer.weight.numel()

    def full_tensor(self) -> torch.Tensor:
        m = self.layer
        return fold(_full(m.weight), _full(m.lora_A), _full(m.lora_B), m.scale)


def merged_tensors(model: nn.Module) -> dict[str, tuple]:
    """`model_tensors` with every LoRALinear weight replaced by its `Folded` merge: the official keys of plain
    weights (identical to model_tensors for a model without LoRA)."""
    return {
        k: (Folded(owner), owner) if isinstance(owner, LoRALinear) and k.endswith(".weight") else (t, owner)
        for k, (t, owner) in model_tensors(model).items()
    }


def peft_name(name: str) -> str:
    """Our parameter name -> its key in an official LoRA checkpoint, e.g. blocks.0.self_attn.q.lora_A ->
    action_head.model.base_model.model.blocks.0.self_attn.q.lora_A.default.weight."""
    layer, _, leaf = name.rpartition(".")
    return PEFT_PREFIX + (f"{layer}.{leaf}.default.weight" if leaf in ADAPTERS else name)


def lora_only_tensors(model: nn.Module, also: tuple[str, ...] = ()) -> dict[str, tuple]:
    """PEFT key suffix (after PEFT_PREFIX) -> (tensor, owner) of what an official save_lora_only checkpoint holds:
    the trainable parameters (adapters, action/state encoder and decoder), plus the frozen tensors named in `also`."""
    out = {}
    for mod_name, mod in model.named_modules():
        for leaf, p in mod.named_parameters(recurse=False):
            name = official_name(f"{mod_name}.{leaf}" if mod_name else leaf)
            if p.requires_grad or name in also:
                out[peft_name(name)[len(PEFT_PREFIX) :]] = (p, mod)
    return out
