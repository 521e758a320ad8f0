"""Plot a training run's curves from its metrics.jsonl: loss terms, learning rate, throughput and data wait.

    python scripts/plot_metrics.py checkpoints/libero-5b            # writes checkpoints/libero-5b/metrics.png
    python scripts/plot_metrics.py RUN_DIR --out curves.png

A resumed run appends to the same file; where a step appears twice (rows logged after the last checkpoint of a
run that was then resumed from it), the later row wins, so the curves show what the resumed run did.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from train.curves import plot_run


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="training run directory (--checkpoint.dir) holding metrics.jsonl")
    p.add_argument("--out", type=Path, default=None, help="PNG to write (default: RUN_DIR/metrics.png)")
    args = p.parse_args(argv)
    out = plot_run(args.run_dir, args.out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
