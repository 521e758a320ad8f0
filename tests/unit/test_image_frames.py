"""`preprocess shards --image-features pixels`: the shards hold CLIP's input pixels instead of its features and the
trainer runs CLIP. Against the default (encoded) build of the same inputs: every other member is the same byte for
byte, CLIP on the stored pixels gives the stored features bit for bit, and training on the pixels logs exactly the
losses of training on the features. Missing or other CLIP weights are refused at start, a rerun with the other
choice is refused, and `check` catches frame 0 stored otherwise than the manifest says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from wampipe.preprocess import outdir
from wampipe.preprocess.check import check
from wampipe.shardformat.manifest import MANIFEST, read_sealed_json, write_sealed_json
from tests.helpers import build


@pytest.fixture(scope="module")
def pixel_shards(tmp_path_factory, droid_root, tiny_checkpoints) -> Path:
    """droid_shards' build (same arguments, same default threads), frame 0 stored as CLIP's input pixels."""
    out = tmp_path_factory.mktemp("pixels") / "droid"
    build(droid_root, out, "droid", tiny_checkpoints, "--image-features", "pixels")
    return out


def test_a_rerun_with_the_other_choice_is_refused(pixel_shards):
    recorded = json.loads((pixel_shards / "inputs.json").read_text())
    problems, units_differ = outdir.conflicts(pixel_shards, {**recorded, "image_features": "encoded"})
    assert problems == ["--image-features: pixels -> encoded"] and units_differ


def test_check_catches_frame_0_stored_otherwise_than_the_manifest_says(pixel_shards, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(pixel_shards, copy)
    wrong = {**read_sealed_json(copy / MANIFEST), "image_features": "encoded"}
    write_sealed_json(copy / MANIFEST, wrong)
    problems = check(copy)
    assert problems and all(
        "holds ['clip_pixels'] for frame 0, image_features 'encoded' needs ['clip']" in p for p in problems
    ), problems[:3]
