"""`preprocess shards --image-features pixels`: the shards hold CLIP's input pixels instead of its features and the
trainer runs CLIP. Against the default (encoded) build of the same inputs: every other member is the same byte for
byte, CLIP on the stored pixels gives the stored features bit for bit, and training on the pixels logs exactly the
losses of training on the features. Missing or other CLIP weights are refused at start, a rerun with the other
choice is refused, and `check` catches frame 0 stored otherwise than the manifest says."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch

from wampipe.encoders.image_encoder import load_image_encoder
from wampipe.errors import UsageError
from wampipe.preprocess.check import check
from wampipe.shardformat.members import decode_members
from tests.helpers import ROOT, build, manifest, shard_samples
from wampipe.train.builder import frozen_image_encoder, model_config
from wampipe.train.config import parse_args

import shutil
from wampipe.preprocess import outdir
from wampipe.shardformat.manifest import MANIFEST, read_sealed_json, write_sealed_json


@pytest.fixture(scope="module")
def pixel_shards(tmp_path_factory, droid_root, tiny_checkpoints) -> Path:
    """droid_shards' build (same arguments, same default threads), frame 0 stored as CLIP's input pixels."""
    out = tmp_path_factory.mktemp("pixels") / "droid"
    build(droid_root, out, "droid", tiny_checkpoints, "--image-features", "pixels")
    return out


def clip_path(shards: Path) -> str:
    return manifest(shards)["encoders"]["image_encoder"]["path"]


def test_pixels_replace_only_the_clip_member_and_give_its_features(droid_shards, pixel_shards):
    assert check(pixel_shards) == []
    encoded, pixels = manifest(droid_shards), manifest(pixel_shards)
    assert (encoded["image_features"], pixels["image_features"]) == ("encoded", "pixels")
    assert "clip_pixels.npy" not in encoded["member_bytes"] and "clip.npy.zst" not in pixels["member_bytes"]
    threads = json.loads((droid_shards / "inputs.json").read_text())["threads_per_worker"]
    dtype = getattr(torch, pixels["encoders"]["dtype"])  # the build's encoder dtype: float32 on CPU
    clip = load_image_encoder(clip_path(pixel_shards), dtype=dtype)
    previous, count = torch.get_num_threads(), 0
    torch.set_num_threads(threads)  # the build's: CPU reductions may depend on it
    try:
        for shard in sorted(droid_shards.glob("shard-*.tar")):
            for (key, a), (other, b) in zip(
                shard_samples(shard), shard_samples(pixel_shards / shard.name), strict=True
            ):
                assert key == other
                assert {k: v for k, v in a.items() if not k.startswith(("clip.", "meta."))} == {
                    k: v for k, v in b.items() if not k.startswith(("clip_pixels.", "meta."))
                }
                (meta_a, tensors_a), (meta_b, tensors_b) = decode_members(a), decode_members(b)
                record_a, record_b = meta_a["tensors"].pop("clip"), meta_b["tensors"].pop("clip_pixels")
                assert meta_a == meta_b
                assert (record_b["dtype"], record_b["shape"]) == (str(dtype).removeprefix("torch."), [3, 224, 224])
                features = clip.encode_pixels(torch.from_numpy(np.asarray(tensors_b["clip_pixels"]))[None])
                stored = cast(torch.Tensor, tensors_a["clip"])  # bf16: decoded as a tensor
                assert record_a["shape"] == list(features.shape[1:])
                assert torch.equal(features[0].to(torch.bfloat16).view(torch.int16), stored.view(torch.int16)), key
                count += 1
    finally:
        torch.set_num_threads(previous)
    assert count == encoded["totals"]["samples"] > 0


def _start_training(shards: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    """A 2-step tiny run on `shards`: one single-process rank on a free port, one thread (two run side by side)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir.mkdir()
    with open(run_dir / "stderr.log", "w") as log:  # a file, not a pipe: two runs write while neither is read
        return subprocess.Popen(
            [
                sys.executable,
                "train/main.py",
                "--preset",
                "tiny",
                "--data.shards",
                str(shards),
                "--checkpoint.dir",
                str(run_dir),
                "--steps",
                "2",
                "--metrics.interval",
                "1",
                "--metrics.no-progress",
                "--metrics.no-tensorboard",
                "--checkpoint.no-save-final",
                "--checkpoint.no-export",
                "--parallel.deterministic",
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(port)},
        )


def _losses(run: subprocess.Popen, run_dir: Path) -> list[tuple]:
    """(step, loss, action loss, dynamics loss, gradient norm) per step, from the run's metrics.jsonl."""
    assert run.wait(timeout=600) == 0, (run_dir / "stderr.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["loss_action"], r["loss_dynamics"], r["grad_norm"]) for r in rows]


def test_training_on_pixels_logs_exactly_the_losses_of_training_on_features(droid_shards, pixel_shards, tmp_path):
    features = _start_training(droid_shards, tmp_path / "features")
    pixels = _start_training(pixel_shards, tmp_path / "pixels", "--model.image-encoder", clip_path(pixel_shards))
    on_features, on_pixels = _losses(features, tmp_path / "features"), _losses(pixels, tmp_path / "pixels")
    assert [row[0] for row in on_features] == [1, 2]
    assert on_pixels == on_features


def test_the_trainer_refuses_pixel_shards_without_their_clip_weights(pixel_shards, droid_shards, tiny_checkpoints):
    cpu = torch.device("cpu")
    assert frozen_image_encoder(parse_args(["--data.shards", str(droid_shards)]), cpu) is None  # features: no CLIP
    needs = "holds CLIP's input pixels, not its features (preprocess --image-features pixels): pass the CLIP weights"
    cfg = parse_args(["--data.shards", str(pixel_shards)])
    for refused in (lambda: frozen_image_encoder(cfg, cpu), lambda: model_config(cfg)):
        with pytest.raises(UsageError, match=rf"^{pixel_shards} {re.escape(needs)}"):
            refused()
    # the same CLIP weights in the other layout are another file: their features need not be the same bits
    folder = Path(clip_path(pixel_shards)).parent / "image_encoder"
    other = parse_args(["--data.shards", str(pixel_shards), "--model.image-encoder", str(folder)])
    with pytest.raises(UsageError, match="not the CLIP weights .* was built with .*: its features would differ"):
        frozen_image_encoder(other, cpu)
    missing = parse_args(["--data.shards", str(pixel_shards), "--model.image-encoder", str(folder / "nothing.pth")])
    with pytest.raises(UsageError, match="nothing.pth: not found"):
        frozen_image_encoder(missing, cpu)


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
