"""The validation loss of a run's newest complete checkpoint (the seeded init without one), printed as JSON by rank 0
(train/evaluation/validation.py computes it, as the trainer does every --metrics.val-interval steps).

    torchrun --nproc-per-node=2 train/validate.py --preset tiny --data.shards shards/droid --checkpoint.dir RUN
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# `torchrun train/validate.py` from a checkout: its root leads the path, not train/ (docs/IMPORTS.md)
if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch.distributed as dist  # noqa: E402

from wampipe.errors import UsageError, WampipeError, entry_point  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """The validation loss of a run's newest complete checkpoint (or of the seeded init), printed as JSON by rank 0."""
    from wampipe.train import checkpoint
    from wampipe.train.builder import build, frozen_image_encoder
    from wampipe.train.config import parse_args
    from wampipe.train.data import open_sets
    from wampipe.train.dit.loss import FlowMatchScheduler
    from wampipe.train.evaluation.validation import Validation
    from wampipe.train.optim import build_optimizer
    from wampipe.train.runtime import report, setup_distributed

    with entry_point():  # a bad flag or config file: its one line on every rank
        cfg = parse_args(argv)
    rank, _, device = setup_distributed(cfg)
    try:
        image_encoder = frozen_image_encoder(cfg, device)
        indexes = open_sets(cfg.data)
        model = build(cfg, device, image_encoder, indexes)
        found = checkpoint.resumable(Path(cfg.checkpoint.dir))
        step = 0
        if found:
            step = checkpoint.load(found[-1][1], model, build_optimizer(model, cfg.optim, device))["step"]
        fm = FlowMatchScheduler(cfg.loss.num_train_timesteps, cfg.loss.shift).to(device)
        validation = Validation(cfg, model, indexes, fm, device, image_encoder)
        if not validation.batches:
            raise UsageError("nothing to validate: no set has a validation split, or --metrics.val-interval is 0")
        record = {"step": step, **validation.evaluate()}
        if rank == 0:
            print(json.dumps(record), flush=True)
    except WampipeError as failure:  # its one line, from rank 0 alone for a refusal every rank makes (a RunError)
        raise SystemExit(report(failure, rank)) from None
    finally:
        dist.destroy_process_group()
    if __name__ == "__main__":
        from wampipe.train.runtime import leave_finished

        leave_finished()


if __name__ == "__main__":
    main()
