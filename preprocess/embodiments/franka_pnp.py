"""Franka pick-and-place (RLinf franka_sft_dreamzero_5b.yaml): LIBERO's keys and views, 12-step blocks. Spec §2.2, §3.1."""

from preprocess.embodiments import Embodiment, Preset, WindowPattern

EMBODIMENT = Embodiment(
    tag="franka_pnp",
    embodiment_id=21,
    cameras=("image", "wrist_image"),
    view_hw=(256, 256),
    layout="side_by_side",
    window=WindowPattern(macro_stride=12, video_offsets=tuple(range(8)), action_horizon=12),
    state_keys=("state",),
    action_keys=("actions",),
    relative_action_keys=(),
    prompt_prefix="A multi-view video shows that a robot ",
    prompt_middle=(
        " The video is split into two horizontal views: the left view shows the exterior camera and the right view "
        "shows the wrist camera. The robot "
    ),
    presets={"5b": Preset(target_hw=(160, 320)), "14b": Preset(target_hw=(352, 640))},
)
