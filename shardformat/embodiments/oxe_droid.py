"""DROID (GEAR-Dreams/DreamZero-DROID-Data, 15 fps, three 180x320 cameras); docs/REFERENCE.md sections 1-5."""

from wampipe.shardformat.embodiments import Embodiment, Preset, WindowPattern

EMBODIMENT = Embodiment(
    tag="oxe_droid",
    embodiment_id=17,
    cameras=("exterior_image_1_left", "exterior_image_2_left", "wrist_image_left"),
    view_hw=(176, 320),
    layout="droid_2x2",
    window=WindowPattern(macro_stride=24, video_offsets=tuple(range(0, 24, 3)), action_horizon=24),
    state_keys=("joint_position", "gripper_position"),
    action_keys=("joint_position", "gripper_position"),
    relative_action_keys=("joint_position",),
    prompt_prefix="A multi-view video shows that a robot ",
    prompt_middle=(
        " The video is split into three views: The top view shows the camera view from the robot's wrist, the "
        "bottom-left view shows the camera view from the left exterior camera, and the bottom-right view shows the "
        "camera view from the right exterior camera. During training, one of the two bottom exterior views may be a "
        "black screen (dropped view). The robot "
    ),
    presets={
        "14b": Preset(target_hw=(352, 640)),  # Wan2.1-I2V-14B: canvas 352x640, resize is a no-op
        "5b": Preset(target_hw=(176, 320)),  # RLinf 5B preset
        "5b-wan22": Preset(target_hw=(160, 320), view_hw=(160, 320)),  # official droid_relative_wan22.yaml
    },
    annotation_columns=(
        "annotation.language.language_instruction",
        "annotation.language.language_instruction_2",
        "annotation.language.language_instruction_3",
    ),
)
