"""Synthetic shard directories in the real format, of a recipe's exact sample shapes (devtools/synthetic.py):

    python scripts/make_synthetic_shards.py --preset tiny --out build/shards-tiny --episodes 6

The sample shapes are the recipe's `synthetic` section (configs/).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from devtools.synthetic import SHAPES, make_synthetic_shards


@dataclass
class Args:
    out: Path
    """Shard directory to write (must not hold a manifest.json yet)."""
    preset: Literal[tuple(SHAPES)] = "tiny"  # type: ignore[valid-type]
    """Recipe whose sample shapes to write (configs/<preset>.yaml, section synthetic)."""
    episodes: int = 6
    """Synthetic episodes."""
    windows_per_episode: int = 4
    """Windows per episode."""
    augment_variants: int = 0
    """Augmentation variants per window (0 = one un-augmented sample, as the default transform)."""
    samples_per_shard: int = 7
    """Samples per shard; the last shard holds the remainder (uneven on purpose by default)."""
    episodes_per_unit: int = 2
    """Episodes per spill unit."""
    seed: int = 0
    """Seed of the data and of the shard mixing."""
    compress: Literal["auto", "none", "all"] = "auto"
    """Member compression: auto, none or all."""


def main(args: Args) -> None:
    m = make_synthetic_shards(
        args.out,
        args.preset,
        args.episodes,
        args.windows_per_episode,
        args.augment_variants,
        args.samples_per_shard,
        args.episodes_per_unit,
        args.seed,
        args.compress,
    )
    print(f"wrote {args.out}: {m['totals']['samples']} samples in {m['totals']['shards']} shards ({args.preset})")


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main(cli(Args, description=__doc__))
