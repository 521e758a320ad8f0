"""Write tiny random-init frozen-encoder checkpoints in every on-disk format the loaders accept
(the layout is listed in devtools/tiny_checkpoints.py).

    python scripts/make_tiny_checkpoints.py --out DIR [--size full]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from devtools.tiny_checkpoints import write_tiny_checkpoints


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny",
                        help="full: VAEs and CLIP at their released widths (benchmarks); umT5 stays tiny")
    args = parser.parse_args(argv)
    write_tiny_checkpoints(args.out, args.seed, args.size)
    print(f"{args.size} checkpoints written to {args.out}")


if __name__ == "__main__":
    main()
