"""LIBERO (physical-intelligence/libero, 10 fps, two 256x256 cameras), RLinf's recipe; REFERENCE.md sections 1-5."""

from wampipe.shardformat.embodiments import Embodiment, Preset, WindowPattern

EMBODIMENT = Embodiment(
    tag="libero_sim",
    embodiment_id=21,
    cameras=("image", "wrist_image"),
    view_hw=(256, 256),
    layout="side_by_side",
    # RLinf: macro_stride defaults to action_horizon=16 with DROID's video offsets -> irregular 33-frame pattern.
    window=WindowPattern(macro_stride=16, video_offsets=tuple(range(0, 24, 3)), action_horizon=16),
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
