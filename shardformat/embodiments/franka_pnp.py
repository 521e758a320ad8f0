"""Franka pick-and-place (RLinf franka_sft_dreamzero_5b.yaml): LIBERO's keys, views and prompt with 12-step blocks.
docs/REFERENCE.md, Windows and Views."""

from dataclasses import replace

from wampipe.shardformat.embodiments import WindowPattern
from wampipe.shardformat.embodiments.libero_sim import EMBODIMENT as LIBERO

EMBODIMENT = replace(
    LIBERO,
    tag="franka_pnp",
    window=WindowPattern(macro_stride=12, video_offsets=tuple(range(8)), action_horizon=12),
)
