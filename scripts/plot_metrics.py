"""Plot a training run's curves from its metrics.jsonl: loss terms, learning rate, throughput and data wait.

    python scripts/plot_metrics.py checkpoints/libero-5b            # writes checkpoints/libero-5b/metrics.png
    python scripts/plot_metrics.py RUN_DIR --out curves.png

A resumed run appends to the same file; where a step appears twice (rows logged after the last checkpoint of a
run that was then resumed from it), the later row wins, so the curves show what the resumed run did.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from wampipe.train.evaluation.curves import plot_run


@dataclass
class Args:
    run_dir: tyro.conf.Positional[Annotated[Path, tyro.conf.arg(metavar="RUN_DIR")]]
    """Training run directory (--checkpoint.dir) holding metrics.jsonl."""
    out: Path | None = None
    """PNG to write (None: RUN_DIR/metrics.png)."""


def main(argv: list[str] | None = None) -> Path:
    args = cli(Args, args=argv, description=__doc__)
    out = plot_run(args.run_dir, args.out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
