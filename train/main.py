"""Train a DreamZero DiT on precomputed shards with FSDP2.

    torchrun --nproc-per-node=8 train/main.py --preset libero-5b --data.shards shards/libero
    torchrun --nproc-per-node=2 train/main.py --preset tiny --data.shards build/shards-tiny   # CPU, gloo

One optimizer step = `accum` micro-batches of `data.micro_batch_size` per rank, accum = global batch /
(micro-batch x world size); gradients are reduce-scattered only on the last micro-batch. The run is built in
train/builder.py, the process around it (distributed setup, signals, exit) is train/runtime.py; this file is the
loop. A step with a non-finite loss or gradient norm on any rank stops the run naming the samples, or drops the
batches (--optim.skip-nonfinite); SIGTERM on any rank saves this step on every rank and exits 0.
docs/TRAINING.md lists the guarantees.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

if not __package__:  # `torchrun train/main.py` from a checkout: its root leads the path, not train/ (docs/IMPORTS.md)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# torch and all that builds on it load once the flags parse (in `train`, `main`): --help and a bad flag do without
from wampipe.errors import entry_point  # noqa: E402
from wampipe.train.config import Config, parse_args  # noqa: E402

if TYPE_CHECKING:
    from wampipe.train.builder import Run


def train(cfg: Config) -> dict:
    import torch

    from wampipe.train import checkpoint, runtime
    from wampipe.train.builder import announce, build_run, open_metrics
    from wampipe.train.optim import clip_grad_norm
    from wampipe.train.evaluation.sample import ActionProbe
    from wampipe.train.evaluation.validation import Validation

    preemption, rank, world, device = runtime.start(cfg)
    cfg, plan = runtime.settle(cfg, device, world, rank)
    checkpoint.claim_run_dir(cfg.checkpoint)  # before any work: another run's directory stops every rank here
    run = build_run(cfg, rank, world, device)
    announce(cfg, run, plan, device)
    model, optimizer, state = run.model, run.optimizer, run.state
    # periodic evaluations after an optimizer step, each (interval in steps, 0 = off; collective hook(step))
    evaluations: list[tuple[int, Callable[[int], None]]] = []
    with runtime.alike():  # every rank opens and checks the same evaluation sets
        probe = ActionProbe.from_config(cfg, model.cfg, rank, world, device, run.loader.indexes, run.image_encoder)
    start, end = state.step, min(cfg.steps, state.step + cfg.stop_after) if cfg.stop_after is not None else cfg.steps
    batches, metrics, stop = iter(run.loader), None, False
    try:
        with preemption.shielding_forks():  # the loader forks its workers for the first batch
            pending = next(batches)
        metrics, profiler = open_metrics(cfg, run, pending, device)
        if probe is not None:  # the open-loop action error (train/evaluation/sample.py)
            evaluations.append((cfg.metrics.action_interval, lambda step: metrics.record(probe(model, step))))
        with runtime.alike():
            validation = Validation(cfg, model, run.loader.indexes, run.flow, device, run.image_encoder)
        while state.step < end and not stop:
            micro_batches = []  # (batch, loss terms): kept for the step's checks and the per-set metrics
            for i in range(plan.accum):
                batch, pending = pending or next(batches), None
                micro_batches.append((batch, run.forward_backward(cfg, batch, i, plan)))
            host_started = host_clock(cfg, device)
            grad_norm = clip_grad_norm(model, cfg.optim.grad_clip).to(device)  # host-offloaded: a host tensor
            # checked before the optimizer step, so no NaN ever reaches the weights (one host sync per step)
            losses = [terms["loss"] for _, terms in micro_batches]
            nonfinite, stop = runtime.step_flags(losses, grad_norm, preemption.requested)
            if nonfinite:
                runtime.drop_step(cfg, state, micro_batches, grad_norm, run.loader.indexes)
                optimizer.zero_grad(set_to_none=True)
            else:
                lr = run.optimizer_step(cfg)
                state.step += 1
                per_set = [(int(batch["set"]), terms) for batch, terms in micro_batches]
                # each a tensor: sum starts at 0 but adds the terms' tensors to it
                mean = {
                    k: cast(torch.Tensor, sum(terms[k] for _, terms in per_set)) / plan.accum for k in per_set[0][1]
                }
                # the host's share of an offloaded step: the gradient norm, the step's checks and AdamW (with several
                # ranks the norm's and the checks' collectives also wait for the slowest rank)
                if cfg.parallel.cpu_offload:
                    mean["cpu_optimizer_s"] = torch.tensor(time.perf_counter() - host_started, device=device)
                metrics.step(mean | {"grad_norm": grad_norm}, plan.micro * plan.accum, per_set)
                profiler.after_step(state.step)
                val = validation.after_step(state.step, end) if not stop else {}  # collective; {} when not due
                if val or state.step % cfg.metrics.interval == 0 or state.step == end or stop:
                    metrics.log(state.step, lr, run.loader.wait_s, state.samples_seen, val)
                for interval, evaluate in evaluations:
                    if interval and state.step % interval == 0:
                        evaluate(state.step)
            if stop or (not nonfinite and checkpoint_due(cfg, state.step)):
                path = checkpoint.save(cfg.checkpoint, state.step, model, optimizer, state.state_dict())
                if stop and rank == 0:
                    print(f"SIGTERM: saved {path}, exiting", flush=True)
    finally:  # closing the loader shuts its workers down: they ignore SIGTERM, so at exit nothing else would
        batches.close()
        if metrics is not None:
            metrics.close()
    return finish(cfg, run, start, stop, plan.micro * plan.accum)


def host_clock(cfg: Config, device) -> float:
    """The time before the gradient norm. Offloaded to a GPU's host, first waits for the last gradients' copies to
    the host (which the norm waits for anyway), so what follows until the optimizer step's end is the CPU's work."""
    import torch

    if cfg.parallel.cpu_offload and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def checkpoint_due(cfg: Config, step: int) -> bool:
    interval = cfg.checkpoint.interval
    return bool(interval and step % interval == 0) or (step == cfg.steps and cfg.checkpoint.save_final)


def finish(cfg: Config, run: Run, start: int, preempted: bool, samples_per_step: int) -> dict:
    """This rank's summary (summary-rankN.json), and the export after the last step."""
    from wampipe.train import checkpoint
    from wampipe.train.dit.export import export_run

    rank, step, loader = run.state.rank, run.state.step, run.loader
    summary = {
        "rank": rank,
        "steps": step - start,
        "last_step": step,
        "next_batch": loader.next_batch,
        "epoch": loader.epoch,
        "samples": (step - start) * samples_per_step,
        "skipped": run.state.skipped,
        "preempted": preempted,
    }
    (Path(cfg.checkpoint.dir) / f"summary-rank{rank:05d}.json").write_text(json.dumps(summary) + "\n")
    if step == cfg.steps and cfg.checkpoint.export and not preempted:  # after a SIGTERM, the next run exports
        checkpoint.require_finite(run.model, "export")
        path = export_run(
            cfg.checkpoint,
            run.model,
            metadata={"step": step, "preset": cfg.preset, "model": cfg.model.name},
            shards=[s.shards for s in cfg.data.sets()],
        )
        if rank == 0:
            print(f"exported {path}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> None:
    with entry_point():  # --help and invalid flags end here, in one line on every rank
        cfg = parse_args(argv)
    from wampipe.train import runtime

    try:
        train(cfg)
    except BaseException as failure:
        if __name__ == "__main__":  # a torchrun worker; imported, the caller handles it
            runtime.leave_now(failure)
        raise
    finally:
        runtime.shut_down()
    if __name__ == "__main__":
        runtime.leave_finished()


if __name__ == "__main__":
    main()
