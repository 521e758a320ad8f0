"""The Wan VAE decoder against the official decoder, and `python -m preprocess preview` on a real build.

tests/assets/wan_vae_decode.safetensors holds, per variant, bf16 latents [1, C, 3, 2, 3] (seeded normal) and what the
official Wan code decodes from them on the tiny VAE weights this project writes (devtools.tiny_checkpoints, seed 0),
in float32 on CPU: Wan2.1 `wan/modules/vae.py` and Wan2.2 `wan/modules/vae2_2.py`, `_video_vae(pth).decode(z, [mean,
1 / std])` then `.float().clamp_(-1, 1)` as their `WanVAE.decode` / `Wan2_2_VAE.decode` do, loading the original-layout
`.pth` strictly.
"""

import shutil
import subprocess
import sys
from pathlib import Path
from typing import cast

import av
import numpy as np
import pytest
import torch
from PIL import Image

from wampipe.encoders.vae import load_vae
from wampipe.preprocess.preview import first_samples, to_canvas_frames
from wampipe.shardformat.members import decode_members
from tests.helpers import ROOT, manifest, shard_samples

VAE_FILES = {"wan2.1": "wan2.1/Wan2.1_VAE.pth", "wan2.2": "wan2.2/Wan2.2_VAE.pth"}


def preview(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "preprocess", "preview", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def read_mp4(path: Path) -> np.ndarray:
    with av.open(str(path)) as f:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in f.decode(video=0)])


def coarse_error(a: np.ndarray, b: np.ndarray, block: int = 8) -> float:
    """Mean absolute difference of two uint8 videos [T, H, W, 3] after averaging block x block pixels."""
    t, h, w, _ = a.shape

    def means(x):
        return x.astype(np.float64).reshape(t, h // block, block, w // block, block, 3).mean(axis=(2, 4))

    return float(np.abs(means(a) - means(b)).mean())


def test_preview_writes_the_decoded_window_and_a_sheet(droid_shards, droid_root, tiny_checkpoints, tmp_path):
    built = manifest(droid_shards)
    tar = droid_shards / built["shards"][0]["shard"]
    key, members = shard_samples(tar)[0]  # the first sample in manifest order
    vae_path = tiny_checkpoints / VAE_FILES[built["transform"]["vae_variant"]]
    done = preview(droid_shards, "--vae", vae_path, "--samples", 1, "--out", tmp_path / "out", "--src", droid_root)
    assert done.returncode == 0 and done.stderr == "", done.stderr  # quiet: no library warnings
    assert done.stdout == f"wrote {tmp_path / 'out' / key}.mp4 and .png\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{key}.mp4", f"{key}.png"]

    frames = read_mp4(tmp_path / "out" / f"{key}.mp4")
    height, width = built["transform"]["target_hw"]
    assert frames.shape == (33, height, width, 3)  # 9 latent frames -> the window's 33
    # the causal decoder's first 2 latent frames give the first 5 frames (a quarter of the work of all 9)
    _, tensors = decode_members(members)
    vae = load_vae(vae_path, keep_decoder=True, dtype=torch.float32)
    decoded = to_canvas_frames(vae.decode(cast(torch.Tensor, tensors["latents"])[None, :, :2]))[0]
    frames = frames[:5]
    # the file holds the decoded frames, upright, unmirrored and in time order. Compared on 8x8 block means: H.264
    # (yuv420p, crf 23) loses much of the random-weight decoder's pixel-level noise, not the coarse picture.
    error = coarse_error(frames, decoded)
    assert error < 3
    for wrong in (decoded[:, ::-1], decoded[:, :, ::-1], decoded[::-1]):
        assert coarse_error(frames, wrong) > 2 * error

    sheet = Image.open(tmp_path / "out" / f"{key}.png")
    sheet.load()
    assert sheet.width > 800 and sheet.height > 400


def test_samples_are_the_first_in_manifest_order(droid_shards):
    from wampipe.train.data import SampleReader, ShardIndex
    from wampipe.train.dit.model import DiTConfig

    built = manifest(droid_shards)
    in_order = [key for s in built["shards"] for key, _ in shard_samples(droid_shards / s["shard"])]
    first = built["shards"][0]["count"]
    assert len(in_order) > first + 1  # the pick below crosses a shard boundary
    reader = SampleReader(ShardIndex(droid_shards), DiTConfig())
    for n in (0, 1, first + 1, len(in_order) + 5):
        picked = list(first_samples(reader, n))
        assert [key for key, _, _ in picked] == in_order[:n]
    key, meta, tensors = picked[-1]
    assert meta["window_start"] == int(key.split("-s")[1][:5]) and tensors["latents"].dtype == torch.bfloat16


def test_preview_refuses_another_vae_or_dataset_in_one_line(droid_shards, droid_root, tiny_checkpoints, tmp_path):
    built = manifest(droid_shards)
    vae = tiny_checkpoints / VAE_FILES[built["transform"]["vae_variant"]]
    other_vae = tiny_checkpoints / "wan2.2" / "vae"  # the same weights as the build's file, but not that file
    other_src = tmp_path / "droid_copy"
    shutil.copytree(droid_root, other_src)
    (other_src / "data" / "extra.parquet").write_bytes(b"")  # one more file: another dataset
    out = tmp_path / "out"
    cases = {
        ("--vae", other_vae): f"--vae {other_vae}: not the VAE {droid_shards} was built with "
        f"({built['encoders']['vae']['path']}, sha256 "
        f"{built['encoders']['vae']['sha256'][:12]}): pass that file",
        ("--vae", tmp_path / "none.pth"): f"--vae {tmp_path / 'none.pth'}: not found",
        ("--vae", vae, "--src", other_src): f"--src {other_src}: not the dataset {droid_shards} was built from "
        f"({built['source']['root']}, fingerprint "
        f"{built['source']['fingerprint'][:12]}): pass that dataset",
    }
    for args, message in cases.items():
        done = preview(droid_shards, *args, "--out", out)
        assert done.returncode != 0 and done.stderr.strip() == message
    assert not out.exists()


@pytest.mark.e2e
def test_preview_refuses_shards_without_a_vae(tiny_shards, tiny_checkpoints, tmp_path):
    done = preview(tiny_shards, "--vae", tiny_checkpoints / VAE_FILES["wan2.2"], "--out", tmp_path / "out")
    assert done.returncode != 0
    assert done.stderr.strip() == (
        f"{tiny_shards}: the manifest records no VAE (synthetic shards): nothing to decode with"
    )
