"""Prompt rows for the DiT: per-prompt umT5 outputs padded to the model's text length (`pad_text`), or with most of
their zero rows collapsed (`compact_text`; the model re-weights the rest, train/dit/model.py `text_key_log_weight`).
The loader (train/data.py) builds its batches with these; the model reads either form.
"""

from __future__ import annotations

from typing import Literal

import torch


def kept_text_rows(
    embeddings: list[torch.Tensor], text_len: int = 512, mode: Literal["per_sample", "batch_min"] = "per_sample"
) -> list[int]:
    """umT5 rows each sample keeps: its own length ('per_sample') or the batch's shortest ('batch_min'), at most
    text_len."""
    lengths = [min(e.shape[0], text_len) for e in embeddings]
    return [min(lengths)] * len(lengths) if mode == "batch_min" else lengths


def pad_text(
    embeddings: list[torch.Tensor],
    text_len: int = 512,
    mode: Literal["per_sample", "batch_min"] = "per_sample",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Zero-pad per-prompt umT5 outputs [L_i, 4096] to [B, text_len, 4096] (into `out` when given, e.g. a
    loader worker's shared memory).

    'per_sample' keeps each prompt's own length (fixed upstream by dreamzero0/dreamzero#71; equals the official
    code at 1 sample/GPU).
    'batch_min' reproduces the official code's bug: every sample is cut at the shortest prompt in the batch.
    """
    keep = kept_text_rows(embeddings, text_len, mode)
    if out is None:
        out = embeddings[0].new_empty(len(embeddings), text_len, embeddings[0].shape[-1])
    for i, (e, n) in enumerate(zip(embeddings, keep)):
        out[i, :n] = e[:n]
        out[i, n:] = 0
    return out


def compact_text_rows(longest: int, text_len: int = 512, bucket: int = 64) -> int:
    """Rows of a compact text batch whose longest prompt has `longest` rows: at least one zero row, rounded up to
    `bucket` (few distinct shapes for compile), at most text_len."""
    return min(text_len, -(-(longest + 1) // bucket) * bucket)


def compact_text(
    embeddings: list[torch.Tensor],
    text_len: int = 512,
    mode: Literal["per_sample", "batch_min"] = "per_sample",
    bucket: int = 64,
    rows: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`pad_text` without most of its zero rows: ([B, T, 4096], lengths [B]) with T = `rows`, by default
    `compact_text_rows` of this batch (a trainer passes the dataset's, so every batch has one shape).

    Zero rows of the umT5 output all become the same key and value in cross-attention, so a sample's
    text_len - n zero rows act as one key counted text_len - n times; the model re-weights the T - n zero rows
    kept here to exactly that (`text_key_log_weight`). Same attention, same gradients, 4-8x fewer text rows.
    """
    keep = kept_text_rows(embeddings, text_len, mode)
    need = compact_text_rows(max(keep), text_len, bucket=1)
    rows = compact_text_rows(max(keep), text_len, bucket) if rows is None else rows
    if not need <= rows <= text_len:
        raise ValueError(
            f"compact text of {rows} rows cannot hold a {max(keep)}-row prompt plus a zero row (text_len {text_len})"
        )
    # every kept row is below `rows`, so padding to `rows` keeps the same rows as padding to text_len would
    # (without allocating and zero-filling the text_len rows: a third of the loader's time at the 5B shape)
    return pad_text(embeddings, rows, mode, out), torch.tensor(keep, dtype=torch.int64)
