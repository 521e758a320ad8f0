"""DreamZero's training windows of one episode: every distinct full window and how often it is drawn
(docs/REFERENCE.md#2-windows-and-anchor-sampling).

The reference trainers draw an anchor row f uniformly and turn it into a window with the language-bounded
multi-anchor rule. Many anchors give the same window, and episode starts/ends are hit 2-3x more often
than the middle. We enumerate each distinct full window once and keep that count as its `weight`, so a trainer
that samples windows in proportion to `weight` draws exactly what RLinf draws.

Differences from the reference (docs/DIFFERENCES.md): partial windows (fewer than K chunks) are dropped, as
RLinf does and the official DROID loader does not; video, actions and states of a window always start at the
same row a0, while RLinf's LIBERO/Franka recipe pairs the video of one window with the actions/states of
another for the last anchors of each episode. Such an anchor is counted for whichever of its two starts begins a
full window.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from wampipe.shardformat.embodiments import WindowPattern


@dataclass(frozen=True, eq=False)
class Window:
    """One full window: rows of the episode (episode-local indices)."""

    start: int  # a0
    weight: int  # number of anchor rows f that RLinf maps to this window
    video_rows: np.ndarray  # [8K+1] frames
    action_rows: np.ndarray  # [K*H]
    state_rows: np.ndarray  # [K], one per chunk


def window_at(start: int, pattern: WindowPattern, weight: int = 1) -> Window:
    """The aligned window starting at row `start`."""
    return Window(
        start,
        weight,
        start + np.asarray(pattern.frame_offsets, dtype=np.int64),
        start + np.asarray(pattern.action_offsets, dtype=np.int64),
        start + np.asarray(pattern.state_offsets, dtype=np.int64),
    )


def episode_windows(
    length: int,
    pattern: WindowPattern,
    anchor_stride: int = 1,
    language: Sequence | None = None,
) -> list[Window]:
    """All distinct full windows of an episode of `length` rows, in order of their start, every
    `anchor_stride`-th kept (weights are not rescaled). `language` = one label per row (None: constant)."""
    if anchor_stride < 1:
        raise ValueError(f"anchor_stride must be >= 1, got {anchor_stride}")
    if language is None:
        starts = _constant_language_weights(length, pattern)
    else:
        if len(language) != length:
            raise ValueError(f"language has {len(language)} labels for {length} rows")
        starts = _anchor_weights(length, pattern, np.asarray(language, dtype=object))
    return [window_at(s, pattern, w) for s, w in list(starts.items())[::anchor_stride]]


# ---------------------------------------------------------------- the reference's anchor -> window rule


@dataclass(frozen=True)
class AnchorSample:
    """What RLinf's multi-anchor sampler returns for one anchor row (empty arrays = no sample)."""

    video: np.ndarray
    action: np.ndarray
    state: np.ndarray
    num_chunks: int

    def is_full(self, pattern: WindowPattern) -> bool:
        k, h = pattern.num_chunks, pattern.action_horizon
        return self.num_chunks == k and self.action.size == k * h and self.state.size == k


def _walk(anchor: int, length: int, stride: int, language: np.ndarray | None):
    """Candidate anchors f, f-S, f+S, f-2S, f+2S, ...; a direction ends at the episode edge or a language change.
    Yields (candidate, direction) pairs; the caller stops iterating when it has enough."""
    yield anchor
    back_open = fwd_open = True
    step = 1
    while back_open or fwd_open:
        for sign in (-1, 1):
            if back_open if sign < 0 else fwd_open:
                a = anchor + sign * stride * step
                outside = a < 0 if sign < 0 else a >= length
                if outside or (language is not None and language[a] != language[anchor]):
                    if sign < 0:
                        back_open = False
                    else:
                        fwd_open = False
                else:
                    yield a
        step += 1


def rlinf_sample(anchor: int, length: int, pattern: WindowPattern, language: np.ndarray | None = None) -> AnchorSample:
    """Re-statement of RLinf's multi-anchor sampling for one anchor row
    (`RLinf/RLinf rlinf/data/datasets/dreamzero/sampling_strategy.py`)."""
    empty = np.zeros(0, dtype=np.int64)
    per_anchor = len(pattern.video_offsets)
    max_frames = pattern.num_frames
    reach = max(max(pattern.video_offsets), pattern.action_horizon - 1)
    s, h, k = pattern.macro_stride, pattern.action_horizon, pattern.num_chunks

    # video: accepted anchors' frames until 8K+1 would overflow; then the boundary frame or one chunk fewer
    frames: list[int] = []
    for a in _walk(anchor, length, s, language):
        if len(frames) >= max_frames:
            break
        if 0 <= a and a + reach < length and len(frames) + per_anchor <= max_frames:
            frames.extend(a + v for v in pattern.video_offsets)
    video = np.array(sorted(set(frames)), dtype=np.int64)[:max_frames]
    if video.size:
        extra = int(video[-1]) + pattern.boundary_stride
        if extra < length and video.size < max_frames:
            video = np.append(video, extra)
        elif video.size <= per_anchor:
            video = empty
        else:
            video = video[: -(per_anchor - 1)]
    if video.size == 0 or video.size % per_anchor != 1:
        return AnchorSample(empty, empty, empty, 0)
    n = (video.size - 1) // per_anchor

    actions: list[int] = []
    for a in _walk(anchor, length, s, language):
        if len(actions) >= h * k or len(actions) // h >= n:
            break
        if 0 <= a and a + h < length:
            actions.extend(range(a, a + h))
    action = np.array(sorted(set(actions)), dtype=np.int64)
    action = action[: (min(action.size, h * k) // h) * h]

    states: list[int] = []
    for a in _walk(anchor, length, s, language):
        if len(states) >= min(k, n):
            break
        if 0 <= a and a + s < length:
            states.append(a)
    return AnchorSample(video, action, np.array(sorted(set(states)), dtype=np.int64), n)


def _anchor_weights(length: int, pattern: WindowPattern, language: np.ndarray | None) -> dict[int, int]:
    """window start -> number of anchors whose (full) RLinf sample has that window's video."""
    offsets = np.asarray(pattern.frame_offsets, dtype=np.int64)
    weights: dict[int, int] = {}
    for f in range(length):
        sample = rlinf_sample(f, length, pattern, language)
        if not sample.is_full(pattern):
            continue  # RLinf redraws another index; we simply have no window for this anchor
        video_start, action_start = int(sample.video[0]), int(sample.action[0])
        if not np.array_equal(sample.video - video_start, offsets):
            raise AssertionError(
                f"anchor {f} of an episode of {length} rows gives video {sample.video.tolist()}, "
                f"not the pattern {offsets.tolist()}"
            )
        # Misaligned samples (video and actions from different windows, RLinf's LIBERO/Franka recipes): count the
        # anchor for the start that begins a full window (LIBERO: the video's; Franka: the actions').
        start = video_start if video_start + pattern.extent < length else action_start
        if start + pattern.extent >= length:
            raise AssertionError(f"anchor {f} of an episode of {length} rows maps to no full window")
        weights[start] = weights.get(start, 0) + 1
    return dict(sorted(weights.items()))


@lru_cache(maxsize=4096)
def _constant_language_weights(length: int, pattern: WindowPattern) -> dict[int, int]:
    # Episodes with one instruction (DROID, LIBERO) depend only on their length: cache per length.
    return _anchor_weights(length, pattern, None)
