"""State and action of one window (docs/REFERENCE.md#5-state-action-and-normalization): slicing and relative actions.

Pure functions: the preprocessor stores raw float32 windows after slicing and the relative conversion; the
trainer normalizes them with metadata.json statistics and pads them (shardformat.stats).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.lerobot import Episode, ModalityEntry
from wampipe.preprocess.windows import Window
from wampipe.shardformat.embodiments import Embodiment


# ---------------------------------------------------------------- slicing


def columns_for(entries: Mapping[str, ModalityEntry], keys: Sequence[str]) -> list[str]:
    """Parquet columns an episode must be read with to slice `keys`."""
    return list(dict.fromkeys(entries[k].original_key for k in keys if k in entries))


def slice_keys(
    episode: Episode, entries: Mapping[str, ModalityEntry], keys: Sequence[str], path=None
) -> dict[str, np.ndarray]:
    """Sub-key -> [L, d] array of the whole episode, for the embodiment's `keys` in order."""
    missing = [k for k in keys if k not in entries]
    if missing:
        raise DatasetError(path, episode.index, f"modality has no sub-keys {missing} (has {sorted(entries)})")
    return {k: episode.slice(entries[k], path) for k in keys}


# ---------------------------------------------------------------- one window


def relative_to_chunk_start(action_td: np.ndarray, state_at_chunk_start_kd: np.ndarray, horizon: int) -> np.ndarray:
    """Subtract from each chunk of `horizon` action rows the raw state at that chunk's first row
    (docs/REFERENCE.md#5-state-action-and-normalization)."""
    k = action_td.shape[0] // horizon
    if action_td.shape[0] != k * horizon or state_at_chunk_start_kd.shape[0] != k:
        raise ValueError(
            f"{action_td.shape[0]} action rows and {state_at_chunk_start_kd.shape[0]} reference states "
            f"do not form chunks of {horizon}"
        )
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
