"""Prompt templates (docs/REFERENCE.md#4-prompts) and instruction parsing."""

from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.preprocess.prompts import format_prompt, instruction_text, window_prompts
from wampipe.shardformat.embodiments import get_embodiment

DROID = (
    "A multi-view video shows that a robot put the marker in the cup The video is split into three views: The top "
    "view shows the camera view from the robot's wrist, the bottom-left view shows the camera view from the left "
    "exterior camera, and the bottom-right view shows the camera view from the right exterior camera. During "
    "training, one of the two bottom exterior views may be a black screen (dropped view). The robot put the "
    "marker in the cup"
)
LIBERO = (
    "A multi-view video shows that a robot turn on the stove The video is split into two horizontal views: the "
    "left view shows the exterior camera and the right view shows the wrist camera. The robot turn on the stove"
)


def test_templates():
    assert format_prompt("Put the Marker in the cup", get_embodiment("oxe_droid")) == DROID
    assert format_prompt("Turn on the STOVE", get_embodiment("libero_sim")) == LIBERO
    assert format_prompt("Turn on the STOVE", get_embodiment("franka_pnp")) == LIBERO


def test_instruction_literals():
    assert instruction_text("['Open the drawer', 'other']") == "Open the drawer"
    assert instruction_text("('close it',)") == "close it"
    assert instruction_text("pick up the cup") == "pick up the cup"
    assert instruction_text("'quoted'") == "quoted"
    assert instruction_text("42") == "42"
    assert format_prompt("['Open The Drawer']", get_embodiment("libero_sim")).endswith("The robot open the drawer")


def test_droid_keeps_all_three_columns(droid_root):
    emb = get_embodiment("oxe_droid")
    ds = LeRobotDataset(droid_root)
    first = window_prompts(ds.episode(ds.episode_indices[0]), 0, emb)
    assert list(first) == list(emb.annotation_columns)
    prefix = emb.prompt_prefix
    assert all(p.startswith(prefix) for p in first.values())
    second = window_prompts(ds.episode(ds.episode_indices[1]), 0, emb)
    # the sample writer leaves instruction_2 empty ("not provided") on odd episodes, as DROID's converter does
    assert second["annotation.language.language_instruction_2"] == format_prompt("not provided", emb)


def test_libero_uses_the_task(libero_root):
    emb = get_embodiment("libero_sim")
    ds = LeRobotDataset(libero_root)
    episode = ds.episode(ds.episode_indices[0])
    prompts = window_prompts(episode, 5, emb)
    assert list(prompts) == ["task_index"]
    assert prompts["task_index"] == format_prompt(str(episode.annotations["task_index"][5]), emb)
    assert str(episode.annotations["task_index"][5]).lower() in prompts["task_index"]
