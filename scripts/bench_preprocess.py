"""Preprocessing throughput per CPU core (decode + windows + views, no encoders) and bytes per sample by member.

Runs the shard builder's own per-episode sample producer (`preprocess.pipeline.episode_samples`: decode each video
once, cut every window, crop/resize/canvas/model-resize) on generated sample datasets, pinned to one core with one
torch thread, for DROID at the 5B (176x320) and 14B (352x640) sizes and LIBERO at 160x320. The encoders are
measured separately (scripts/bench_encode.py, on a GPU); with them on a GPU, a farm of N cores produces about
min(N x this rate, the GPU's VAE rate) samples/s.

Bytes per sample: exact raw sizes of every member at the real shapes (bf16 latents, CLIP, y; float32 state and
action; meta.json), and the zstd ratio `--compress auto` gets on the members whose content is real here (state,
action, meta). Latent and CLIP compressibility needs real encoder weights and is not measured here.

    python scripts/bench_preprocess.py [--episodes 3]
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from devtools.sample_data import write_sample_dataset
from devtools.synthetic import SHAPES
from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.preprocess.pipeline import episode_samples
from wampipe.preprocess.shards import DATASETS
from wampipe.preprocess.spec import BuildSpec
from wampipe.shardformat.embodiments import get_embodiment
from wampipe.shardformat.layout import CLIP, LATENTS, Y, tensor_suffix
from wampipe.shardformat.members import encode_sample, split_member_name

RECIPES = ("droid-5b", "droid-14b", "libero-5b")


def encoded_shapes(recipe: str) -> dict[str, tuple]:
    """The encoder outputs of one sample of `recipe`, as its shards hold them (the recipe's sample shapes,
    configs/<name>.yaml; docs/REFERENCE.md#11-sizes-and-flops)."""
    shapes = SHAPES[recipe]
    return {name: shape for name, shape in ((LATENTS, shapes.latents), (CLIP, shapes.clip), (Y, shapes.y)) if shape}


def measure(root: Path, recipe: str) -> dict:
    dataset, model = SHAPES[recipe].dataset, SHAPES[recipe].model
    preset = DATASETS[dataset]
    emb = get_embodiment(preset.embodiment)
    spec = BuildSpec(
        src=str(root),
        dataset=dataset,
        embodiment=emb.tag,
        model=model,
        vae="",
        image_encoder="",
        text_encoder="",
        tokenizer="",
        metadata=None,
        device="cpu",
        dtype="float32",
        threads_per_worker=1,
        batch_size=1,
        episodes_per_unit=1,
        max_episodes=None,
        anchor_stride=1,
        augment_variants=0,
        seed=0,
        compress="auto",
        decode_backend="torchcodec",
        image_features="encoded",
        vae_compile=False,
        samples_per_shard=1,
        val_episodes=None,
        fail_fast=True,
    )
    ds = LeRobotDataset(root)
    samples, start, last = 0, time.perf_counter(), None
    for index in ds.episode_indices:
        for last in episode_samples(spec, ds, emb, index):
            samples += 1
    elapsed = time.perf_counter() - start
    if last is None:  # every episode shorter than a window (generated ones are longer): no sample to size
        raise SystemExit(f"{recipe}: the dataset at {root} gave no sample")
    key, video, tensors, meta = last.key, last.video, last.tensors, last.meta
    raw = {name: int(np.prod(shape)) * 2 + 128 for name, shape in encoded_shapes(recipe).items()}  # bf16 + header
    stored = {split_member_name(m)[1]: len(d) for m, d in encode_sample(key, tensors, meta, "auto")}
    plain = {split_member_name(m)[1]: len(d) for m, d in encode_sample(key, tensors, meta, "none")}
    members = {tensor_suffix(n, zstd=False): {"raw": b} for n, b in raw.items()}
    for m, size in stored.items():
        members[m.removesuffix(".zst")] = {"raw": plain[m.removesuffix(".zst")], "stored": size}
    return {
        "dataset": dataset,
        "model": model,
        "samples": samples,
        "seconds": elapsed,
        "samples_per_s_per_core": samples / elapsed,
        "video_shape": list(video.shape),
        "bytes_per_sample": members,
        "total_raw_bytes": sum(v["raw"] for v in members.values()),
    }


@dataclass
class Args:
    episodes: int = 3
    """Episodes per generated dataset."""
    seed: int = 0
    """Seed of the generated datasets."""


def main(argv: list[str] | None = None) -> None:
    args = cli(Args, args=argv, description=__doc__)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        roots = {
            "droid": write_sample_dataset(Path(tmp) / "droid", "droid", args.episodes, args.seed),
            "libero": write_sample_dataset(Path(tmp) / "libero", "libero", args.episodes, args.seed),
        }
        results = [measure(roots[SHAPES[recipe].dataset], recipe) for recipe in RECIPES]
    print(f"{'dataset':<8} {'model':<5} {'samples':>7} {'samples/s/core':>15} {'raw KiB/sample':>15}")
    for r in results:
        print(
            f"{r['dataset']:<8} {r['model']:<5} {r['samples']:>7} {r['samples_per_s_per_core']:>15.2f} "
            f"{r['total_raw_bytes'] / 1024:>15.0f}"
        )
    print(
        json.dumps(
            {
                "bench": "preprocess",
                "cpu": platform.processor() or platform.machine(),
                "cores": 1,
                "torch": torch.__version__,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
