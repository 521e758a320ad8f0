"""Write a small but genuine LeRobot dataset: the on-disk layouts of DROID (v2.1), LIBERO (v2.0) and LIBERO (v3.0).

The cameras film a scene that moves with the robot (devtools/sample_data.py); deterministic for a seed.

    python scripts/make_sample_dataset.py --layout droid --out sample_data/droid --episodes 4 --seed 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from devtools.sample_data import LAYOUTS, write_sample_dataset


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", required=True, choices=LAYOUTS,
                        help="droid: LeRobot v2.1, 3 mp4 cameras 180x320 at 15 fps, DROID's state/action columns and 3 "
                             "annotation columns; libero: v2.0, 2 PNG cameras 256x256 inside parquet, 10 fps; "
                             "libero-v3: the same content as libero in the v3.0 layout with mp4 videos")
    parser.add_argument("--out", required=True, type=Path, help="dataset root to create (replaced if it exists)")
    parser.add_argument("--episodes", type=int, default=4, help="number of episodes (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes the same data")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes that render and compress frames (droid and libero layouts; the same files for any "
                             "number)")
    parser.add_argument("--codec", choices=["h264", "av1"], default="h264",
                        help="video codec for mp4 layouts: h264 (libx264, as DROID) or av1 (SVT-AV1, LeRobot's default)")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be at least 1")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    write_sample_dataset(args.out, args.layout, args.episodes, args.seed, args.codec, args.workers)
    print(f"wrote {args.layout} sample dataset with {args.episodes} episodes to {args.out}")


if __name__ == "__main__":
    main()
