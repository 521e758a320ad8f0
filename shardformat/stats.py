"""State and action normalization the trainer applies at load time: q99 statistics of metadata.json, padding."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch


def stat_vector(statistics: Mapping, modality: str, keys: Sequence[str], stat: str) -> np.ndarray:
    """Concatenate one statistic of `keys` from a metadata.json `statistics` block, e.g. q01 of all state keys."""
    block = statistics[modality]
    missing = [k for k in keys if k not in block]
    if missing:
        raise KeyError(f"statistics.{modality} has no sub-keys {missing}")
    return np.concatenate([np.asarray(block[k][stat], dtype=np.float64).reshape(-1) for k in keys])


def normalize_q99(x: torch.Tensor, q01, q99) -> torch.Tensor:
    """`2 (x - q01) / (q99 - q01) - 1` per dim, identity where q01 == q99, then everything clamped to [-1, 1]."""
    q01 = torch.as_tensor(q01).to(x.dtype)
    q99 = torch.as_tensor(q99).to(x.dtype)
    varies = q01 != q99
    span = torch.where(varies, q99 - q01, torch.ones_like(q99))
    scaled = 2 * ((x - q01) / span) - 1
    return torch.where(varies, scaled, x).clamp(-1, 1)


def unnormalize_q99(y: torch.Tensor, q01, q99) -> torch.Tensor:
    """Inverse of `normalize_q99` inside the clamp range."""
    q01 = torch.as_tensor(q01).to(y.dtype)
    q99 = torch.as_tensor(q99).to(y.dtype)
    return torch.where(q01 != q99, (y + 1) / 2 * (q99 - q01) + q01, y)


def pad_with_mask(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the last dim to `width`; the mask is True on the real dims."""
    d = x.shape[-1]
    if d > width:
        raise ValueError(f"{d} dims do not fit into {width}")
    padded = torch.zeros(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    padded[..., :d] = x
    mask = torch.zeros(*x.shape[:-1], width, dtype=torch.bool, device=x.device)
    mask[..., :d] = True
    return padded, mask
