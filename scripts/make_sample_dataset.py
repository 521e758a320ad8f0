"""Write a small but genuine LeRobot dataset: the on-disk layouts of DROID (v2.1), LIBERO (v2.0) and LIBERO (v3.0).

The cameras film a scene that moves with the robot (devtools/sample_data.py); deterministic for a seed.

    python scripts/make_sample_dataset.py --layout droid --out sample_data/droid --episodes 4 --seed 0
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe.configs.cli import cli, refuse
from wampipe.errors import entry_point
from devtools.sample_data import LAYOUTS, write_sample_dataset


@dataclass
class Args:
    layout: Literal[LAYOUTS]  # type: ignore[valid-type]
    """droid: LeRobot v2.1, 3 mp4 cameras 180x320 at 15 fps, DROID's state/action columns and 3 annotation columns
    (as DreamZero's converted DROID); droid-raw: the same layout as DROID is recorded, with idle stretches, failed
    episodes, repeated and missing instructions and each episode's recording folder and file path, plus the keep
    ranges of its moving rows in <out>_keep_ranges.json beside it (as openpi's file); libero: v2.0, 2 PNG cameras
    256x256 inside parquet, 10 fps; libero-v3: the same content as libero in the v3.0
    layout with mp4 videos."""
    out: Path
    """Dataset root to create (replaced if it exists)."""
    episodes: int = 4
    """Number of episodes (at least 1)."""
    seed: int = 0
    """Random seed; the same seed writes the same data."""
    workers: int = 1
    """Processes that render and compress frames (droid and libero layouts; the same files for any number)."""
    codec: Literal["h264", "av1"] = "h264"
    """Video codec of the mp4 layouts: h264 (libx264, as DROID) or av1 (SVT-AV1, LeRobot's default)."""


def main(argv: list[str] | None = None) -> None:
    args = cli(Args, args=argv, description=__doc__)
    if args.episodes < 1 or args.workers < 1:
        refuse("--episodes and --workers must be at least 1")
    write_sample_dataset(args.out, args.layout, args.episodes, args.seed, args.codec, args.workers)
    print(f"wrote {args.layout} sample dataset with {args.episodes} episodes to {args.out}")


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
