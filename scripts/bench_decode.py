"""Frame decode throughput per CPU core: torchcodec vs PyAV, H.264 vs AV1, whole episode vs 33-frame windows.

Videos are DROID-shaped (320x180, 15 fps, 420 frames, the length of DreamZero's debug clips) and written by the
sample-data encoder: H.264 as DROID's converter writes it (x264 ultrafast, default GOP 250) and AV1 as LeRobot
writes it (SVT-AV1, GOP 2). The process is pinned to one core, so the numbers are per core.

    python scripts/bench_decode.py [--frames 420] [--windows 20] [--repeats 3]

Prints a table and one final JSON line.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from devtools.sample_data import encode_mp4, render, simulate
from wampipe.preprocess.decode import BACKENDS, decode_video


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@dataclass
class Args:
    frames: int = 420
    """Frames per test video."""
    windows: int = 20
    """33-frame windows decoded per measurement."""
    repeats: int = 3
    """Times each measurement is repeated; the best is kept."""
    seed: int = 0
    """Seed of the video content and the window starts."""


def main(argv: list[str] | None = None) -> None:
    args = cli(Args, args=argv, description=__doc__)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    rng = np.random.default_rng(args.seed)
    frames = render(simulate(rng, args.frames), args.frames, 0, 180, 320, args.seed)
    span = 3 * 32 + 1
    starts = rng.integers(0, args.frames - span, size=args.windows)
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for codec in ("h264", "av1"):
            path = Path(tmp) / f"{codec}.mp4"
            encode_mp4(path, frames, 15, codec)
            for backend in BACKENDS:
                whole = best_of(args.repeats, lambda: decode_video(path, range(args.frames), backend=backend))
                window = best_of(
                    args.repeats, lambda: [decode_video(path, s + 3 * np.arange(33), backend=backend) for s in starts]
                )
                result = {
                    "codec": codec,
                    "backend": backend,
                    "episode_frames_per_s": args.frames / whole,
                    "window_ms": 1000 * window / args.windows,
                    "window_frames_per_s": 33 * args.windows / window,
                }
                results.append(result)
                rows.append(
                    f"{codec:<5} {backend:<11} {result['episode_frames_per_s']:>10.0f} "
                    f"{result['window_ms']:>12.1f} {result['window_frames_per_s']:>14.0f}"
                )
    print(f"{'codec':<5} {'backend':<11} {'episode f/s':>10} {'window ms':>12} {'window f/s':>14}")
    print("\n".join(rows))
    print(
        json.dumps(
            {
                "bench": "decode",
                "cpu": platform.processor() or platform.machine(),
                "cores": 1,
                "video": f"320x180 {args.frames} frames 15 fps",
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
