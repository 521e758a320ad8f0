"""Summarize a LeRobot dataset (layout, cameras, modality, episodes) and optionally decode every frame of it.

Decoding checks each video's frame count and timestamps against the parquet rows, so `--decode` is also a quick
health check of a dataset before a long preprocessing run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import tyro
from tqdm import tqdm

from wampipe.errors import UsageError
from wampipe.preprocess.decode import BACKENDS
from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.lerobot import LeRobotDataset


@dataclass
class Args:
    root: tyro.conf.Positional[Path]
    """LeRobot dataset root (the folder holding meta/info.json)."""
    decode: bool = False
    """Decode every frame of every camera and check counts and timestamps."""
    backend: str = "torchcodec"
    """Frame decoder: torchcodec or pyav."""
    max_episodes: int | None = None
    """Look at only the first N episodes."""


def run(args: Args) -> int:
    """Prints the summary (and the decode's failures); returns the exit status (1: a frame failed to decode)."""
    if args.backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {BACKENDS}")
    ds = LeRobotDataset(args.root)
    print(f"{ds.root}: LeRobot {ds.version}, {len(ds)} episodes, {ds.total_frames} frames, {ds.fps:g} fps")
    for short, key in ds.modality.video.items():
        h, w, _ = ds.camera_shape(key)
        print(f"  camera {short:<24} {key} ({ds.camera_storage(key)}, {h}x{w})")
    for kind, entries in (("state", ds.modality.state), ("action", ds.modality.action)):
        for sub, e in entries.items():
            print(f"  {kind:<6} {sub:<24} {e.original_key}[{e.start}:{e.end}]")
    print(f"  annotations: {list(ds.modality.annotation.values()) or ['task_index']}; {len(ds.tasks)} tasks")
    indices = ds.episode_indices[: args.max_episodes]
    if not args.decode:
        return 0
    frames, failures, start = 0, [], time.perf_counter()
    for index in tqdm(indices, desc="decode", unit="episode"):
        try:
            episode = ds.episode(index)
            for source in episode.cameras.values():
                frames += len(source.read(backend=args.backend))
        except DatasetError as err:
            failures.append(str(err))
    elapsed = time.perf_counter() - start
    print(f"decoded {frames} frames from {len(indices)} episodes in {elapsed:.1f} s ({frames / elapsed:.0f} frames/s)")
    for failure in failures:
        print(f"  FAILED {failure}")
    return 1 if failures else 0
