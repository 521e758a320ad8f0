"""Write tiny random-init frozen-encoder checkpoints in every on-disk format the loaders accept
(the layout is listed in devtools/tiny_checkpoints.py).

    python scripts/make_tiny_checkpoints.py --out DIR [--size full]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from devtools.tiny_checkpoints import write_tiny_checkpoints


@dataclass
class Args:
    out: Path
    """Output folder (created)."""
    seed: int = 0
    """Seed of the random weights."""
    size: Literal["tiny", "full"] = "tiny"
    """full: the VAEs and CLIP at their released widths (benchmarks); umT5 stays tiny."""


def main(argv: list[str] | None = None) -> None:
    args = cli(Args, args=argv, description=__doc__)
    write_tiny_checkpoints(args.out, args.seed, args.size)
    print(f"{args.size} checkpoints written to {args.out}")


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
