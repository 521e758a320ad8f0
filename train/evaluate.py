"""Open-loop action error of a trained DiT on a shard directory (docs/EVALUATION.md, Open-loop action error).

    python -m train.evaluate RUN_OR_EXPORT --shards DIR [--samples N] [--out DIR]

RUN_OR_EXPORT is a run directory (its newest complete checkpoint, or --step) or an eval-ready export folder
(config.json + weights, as `--checkpoint.export-base` writes it). For each of the first N windows of the shards
the sampler (train/evaluation/sample.py) draws the first action chunk from the observation alone; OUT/open_loop.json
holds the per-dimension MSE against the recorded actions (q99-normalised and raw units, whole chunk and first action)
and OUT/open_loop.png plots predicted against recorded actions for a few samples.
"""

from __future__ import annotations

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from wampipe.train.evaluation.open_loop import Args, evaluate


def main(argv: list[str] | None = None) -> None:
    args = cli(Args, args=argv, prog="python -m train.evaluate", description=__doc__)
    with entry_point():  # a bad flag or file: its one line, no traceback
        report = evaluate(args)
    print(
        f"{report['samples']} samples: action MSE {report['chunk']['mean']:.6g} (normalised), "
        f"{report['chunk_raw']['mean']:.6g} (raw); first action {report['first']['mean']:.6g} / "
        f"{report['first_raw']['mean']:.6g}; wrote {args.out / 'open_loop.json'}"
    )


if __name__ == "__main__":
    main()
