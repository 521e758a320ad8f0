"""State and action of one window (spec §4): slicing, relative actions, q99 normalization, padding with masks.

Pure functions, shared by the preprocessor (which stores raw float32 windows after slicing and the relative
conversion) and the trainer (which normalizes with metadata.json statistics and pads).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from preprocess.embodiments import Embodiment
from preprocess.errors import DatasetError
from preprocess.lerobot import Episode, ModalityEntry
from preprocess.windows import Window

MAX_STATE_DIM = 64  # max_state_dim of every shipped recipe
MAX_ACTION_DIM = 32  # max_action_dim


# ---------------------------------------------------------------- slicing


def columns_for(entries: Mapping[str, ModalityEntry], keys: Sequence[str]) -> list[str]:
    """Parquet columns an episode must be read with to slice `keys`."""
    return list(dict.fromkeys(entries[k].original_key for k in keys if k in entries))


def slice_keys(episode: Episode, entries: Mapping[str, ModalityEntry], keys: Sequence[str], path=None) -> dict[str, np.ndarray]:
    """Sub-key -> [L, d] array of the whole episode, for the embodiment's `keys` in order."""
    missing = [k for k in keys if k not in entries]
    if missing:
        raise DatasetError(path, episode.index, f"modality has no sub-keys {missing} (has {sorted(entries)})")
    return {k: episode.slice(entries[k]) for k in keys}


# ---------------------------------------------------------------- one window


def relative_to_chunk_start(action_td: np.ndarray, state_at_chunk_start_kd: np.ndarray, horizon: int) -> np.ndarray:
    """Subtract from each chunk of `horizon` action rows the raw state at that chunk's first row (spec §4.2)."""
    k = action_td.shape[0] // horizon
    if action_td.shape[0] != k * horizon or state_at_chunk_start_kd.shape[0] != k:
        raise ValueError(f"{action_td.shape[0]} action rows and {state_at_chunk_start_kd.shape[0]} reference states "
                         f"do not form chunks of {horizon}")
    chunks = action_td.reshape(k, horizon, -1) - state_at_chunk_start_kd[:, None, :]
    return chunks.reshape(action_td.shape)


def window_state_action(
    states: Mapping[str, np.ndarray], actions: Mapping[str, np.ndarray], window: Window, embodiment: Embodiment
) -> tuple[np.ndarray, np.ndarray]:
    """Raw (unnormalized) float32 state [K, Ds] and action [K*H, Da] of a window, sub-keys concatenated in the
    embodiment's order; relative action keys made relative to the same-named state sub-key per chunk."""
    horizon = embodiment.window.action_horizon
    chunk_starts = window.action_rows[::horizon]
    state = np.concatenate([np.asarray(states[k], np.float64)[window.state_rows] for k in embodiment.state_keys], 1)
    parts = []
    for key in embodiment.action_keys:
        part = np.asarray(actions[key], np.float64)[window.action_rows]
        if key in embodiment.relative_action_keys:
            part = relative_to_chunk_start(part, np.asarray(states[key], np.float64)[chunk_starts], horizon)
        parts.append(part)
    return state.astype(np.float32), np.concatenate(parts, 1).astype(np.float32)


# ---------------------------------------------------------------- normalization (q99 mode, spec §4.3)


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


# ---------------------------------------------------------------- padding (spec §4.5)


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


def model_state_action(
    state_kd: np.ndarray | torch.Tensor,
    action_td: np.ndarray | torch.Tensor,
    statistics: Mapping,
    embodiment: Embodiment,
) -> dict[str, torch.Tensor]:
    """Raw window -> what the model sees: normalized, padded state [K, 64] / action [K*H, 32] with masks."""
    keys = {"state": embodiment.state_keys, "action": embodiment.action_keys}
    out = {}
    for name, x, width in (("state", state_kd, MAX_STATE_DIM), ("action", action_td, MAX_ACTION_DIM)):
        x = torch.as_tensor(x)
        q01 = stat_vector(statistics, name, keys[name], "q01")
        q99 = stat_vector(statistics, name, keys[name], "q99")
        if q01.size != x.shape[-1]:
            raise ValueError(f"{name} has {x.shape[-1]} dims, statistics have {q01.size}")
        out[name], out[f"{name}_mask"] = pad_with_mask(normalize_q99(x, q01, q99), width)
    return out
