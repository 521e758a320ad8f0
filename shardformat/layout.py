"""Every name in a shard directory, in one place: its files, the shard and unit file names, and a sample's members.

    shard-000000.tar / .json      SHARD_FILE (SHARD_NAME matches it), its JSON beside it (shardformat.shard)
    text/embeddings.safetensors   TEXT_TABLE, with TEXT_PROMPTS
    metadata.json                 STATISTICS
    samples.npy                   SAMPLE_INDEX: a row per sample (shardformat.samples), what readers use
    wids.json, manifest.json      WIDS_INDEX, MANIFEST (last)
    inputs.json                   INPUTS (the preprocessor's record of a build)
    work/unit-000000.tar / .json  WORK_DIR, UNIT_FILE: the preprocessor's spills, never part of a finished copy
    work/selection.json           SELECTION: which episodes and rows the build uses (preprocess.selection)

A sample's members are `<key>.<tensor>.npy` (`.npy.zst` when compressed) and `<key>.meta.json`.
"""

from __future__ import annotations

import re

MANIFEST = "manifest.json"
WIDS_INDEX = "wids.json"
STATISTICS = "metadata.json"
SAMPLE_INDEX = "samples.npy"
TEXT_TABLE = "text/embeddings.safetensors"
TEXT_PROMPTS = "text/prompts.json"
INPUTS = "inputs.json"
WORK_DIR = "work"
SELECTION = f"{WORK_DIR}/selection.json"
VAL_DIR = "val"  # the held-out split of a build (preprocess shards --val-episodes): a shard directory of its own
SHARD_FILE = "shard-{:06d}.tar"
SHARD_NAME = re.compile(r"shard-\d{6,}\.tar")
UNIT_FILE = "unit-{:06d}.tar"
UNIT_NAME = re.compile(r"unit-\d{6,}\.tar")

META = "meta.json"
NPY, ZSTD = ".npy", ".zst"
LATENTS, Y, STATE, ACTION = "latents", "y", "state", "action"
CLIP, CLIP_PIXELS = "clip", "clip_pixels"
# The frame-0 image tensor of a sample under each `--image-features` choice: CLIP's output features, or the
# preprocessed pixels the CLIP tower consumes (the trainer then runs the frozen CLIP itself).
IMAGE_MEMBER = {"encoded": CLIP, "pixels": CLIP_PIXELS}


def tensor_suffix(tensor: str, zstd: bool) -> str:
    """The member suffix of a tensor: `latents.npy`, or `latents.npy.zst` when stored compressed."""
    return f"{tensor}{NPY}{ZSTD if zstd else ''}"


def shard_file(shard: int) -> str:
    return SHARD_FILE.format(shard)


def unit_file(unit: int) -> str:
    return f"{WORK_DIR}/{UNIT_FILE.format(unit)}"
