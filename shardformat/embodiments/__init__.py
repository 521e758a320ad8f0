"""Embodiment registry: everything that differs between robots when a DreamZero sample is built.

One small module per robot defines an `Embodiment` and names it `EMBODIMENT`; `_MODULES` below lists those modules.
Adding a robot = one new module + one line in `_MODULES`. Numbers follow docs/REFERENCE.md
(window patterns, views, state/action keys, embodiment ids, prompt templates).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

CanvasLayout = Literal["droid_2x2", "side_by_side"]


@dataclass(frozen=True)
class WindowPattern:
    """DreamZero's multi-anchor window: K chunks, one anchor every `macro_stride` rows
    (docs/REFERENCE.md#2-windows-and-anchor-sampling).

    Each anchor contributes `len(video_offsets)` video frames, `action_horizon` action rows and one state row.
    """

    macro_stride: int  # S: rows between consecutive chunk anchors
    video_offsets: tuple[int, ...]  # V: video frames of one anchor, relative to it (uniformly spaced)
    action_horizon: int  # H: action rows per chunk
    num_chunks: int = 4  # K = max_chunk_size

    @property
    def boundary_stride(self) -> int:
        """Distance of the appended boundary frame from the last frame (RLinf: V[1] - V[0])."""
        return self.video_offsets[1] - self.video_offsets[0] if len(self.video_offsets) > 1 else 1

    @property
    def num_frames(self) -> int:
        """8K + 1 for V of length 8."""
        return len(self.video_offsets) * self.num_chunks + 1

    @cached_property
    def frame_offsets(self) -> tuple[int, ...]:
        """Video frames of a full window relative to its start a0: the sorted union of the K anchors' frames
        (anchors a0 + c*S), cut to 8K+1, plus the boundary frame."""
        frames = sorted({c * self.macro_stride + v for c in range(self.num_chunks) for v in self.video_offsets})
        frames = frames[: self.num_frames - 1]
        return tuple(frames) + (frames[-1] + self.boundary_stride,)

    @property
    def action_offsets(self) -> tuple[int, ...]:
        return tuple(range(self.num_chunks * self.action_horizon))

    @property
    def state_offsets(self) -> tuple[int, ...]:
        return tuple(c * self.macro_stride for c in range(self.num_chunks))

    @property
    def extent(self) -> int:
        """A window starting at a0 is full iff a0 + extent < L (RLinf's acceptance rules)."""
        last_anchor = (self.num_chunks - 1) * self.macro_stride
        video = max(max(self.frame_offsets), last_anchor + max(max(self.video_offsets), self.action_horizon - 1))
        action = last_anchor + self.action_horizon  # every anchor needs a + H < L
        state = last_anchor + self.macro_stride  # every anchor needs a + S < L
        return max(video, action, state)


@dataclass(frozen=True)
class Preset:
    """Sizes for one model recipe."""

    target_hw: tuple[int, int]  # model resolution of the whole canvas (target_video_height, target_video_width)
    view_hw: tuple[int, int] | None = None  # per-view resize; None = the embodiment's default


@dataclass(frozen=True)
class Embodiment:
    tag: str  # embodiment_tag as written in metadata.json
    embodiment_id: int  # id in the reference's tag mapping (selects the prompt template there)
    cameras: tuple[str, ...]  # modality.json short camera names, in the reference's video_concat_order
    view_hw: tuple[int, int]  # default per-view resize (height, width) after the 95 % crop
    layout: CanvasLayout  # how the views form one canvas (docs/REFERENCE.md#3-views-canvas-and-resize)
    window: WindowPattern
    state_keys: tuple[str, ...]  # state sub-keys in concat order
    action_keys: tuple[str, ...]  # action sub-keys in concat order
    relative_action_keys: tuple[str, ...]  # action sub-keys made relative to the same-named state sub-key
    prompt_prefix: str  # prompt = prefix + instruction + prompt_middle + instruction
    prompt_middle: str
    presets: dict[str, Preset] = field(default_factory=dict)  # model recipe name -> sizes
    annotation_columns: tuple[str, ...] = ()  # parquet instruction columns; () = the dataset's own (task_index)

    def preset(self, name: str) -> Preset:
        if name not in self.presets:
            raise KeyError(f"embodiment {self.tag!r} has no preset {name!r}; choose one of {sorted(self.presets)}")
        return self.presets[name]

    def view_size(self, preset: str | None = None) -> tuple[int, int]:
        if preset is None or self.preset(preset).view_hw is None:
            return self.view_hw
        return self.preset(preset).view_hw  # type: ignore[return-value]


# One line per robot module; each defines `EMBODIMENT`.
_MODULES = (
    "oxe_droid",
    "libero_sim",
    "franka_pnp",
)

EMBODIMENTS: dict[str, Embodiment] = {}
for _name in _MODULES:
    _emb = importlib.import_module(f"{__name__}.{_name}").EMBODIMENT
    EMBODIMENTS[_emb.tag] = _emb


def get_embodiment(tag: str) -> Embodiment:
    try:
        return EMBODIMENTS[tag]
    except KeyError:
        raise KeyError(f"unknown embodiment {tag!r}; known: {sorted(EMBODIMENTS)}") from None
