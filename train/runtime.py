"""The trainer's process: its place in the process group, its signals and its exit.

Each rank dies with torchrun (`exit_with_launcher`), dumps every thread's stack on SIGUSR1 (for hangs), turns SIGTERM
into a checkpoint and a clean exit (`Preemption`), and leaves after a failure with one report and no teardown
(`leave_now`). Before its optimizer step, each step all-reduces two flags (`step_flags`): a non-finite loss or
gradient norm on any rank, and SIGTERM on any rank, so every rank skips, stops or saves at the same step.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import os
import signal
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NoReturn, cast

import torch
import torch.distributed as dist

from wampipe.errors import RunError, WampipeError
from wampipe.shardformat.storage import remove_temporary_copies
from wampipe.train import checkpoint
from wampipe.train.planning.auto import device_memory_gib, resolve_auto
from wampipe.train.config import BatchPlan, Config, batch_plan, validate
from wampipe.train.data import ShardIndex
from wampipe.train.metrics import check_wandb
from wampipe.train.dit.model import MODEL_INPUTS
from wampipe.train.parallel import (
    auto_float8_missing,
    check_float8,
    computes_on_cuda,
    use_expandable_segments,
)
from wampipe.train.state import TrainState

if TYPE_CHECKING:
    from wampipe.shardformat.index import Window

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def start(cfg: Config) -> tuple[Preemption, int, int, torch.device]:
    """This rank's process set up for training: (its SIGTERM handler, rank, world size, device)."""
    exit_with_launcher()
    preemption = Preemption()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack, for hangs
    return (preemption, *setup_distributed(cfg))


def setup_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = computes_on_cuda(cfg.parallel)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        use_expandable_segments(device)
    backend = cfg.parallel.backend if cfg.parallel.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and cfg.parallel.cpu_offload:
        # the host-offloaded shards' collectives (gradient norm, checkpoints, export) run on host tensors, and the
        # optimizer steps on the host: its cores split over this node's ranks (torchrun's default is 1 thread each)
        backend = "cuda:nccl,cpu:gloo"
        cores = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(torch.get_num_threads(), cores))
    if "nccl" in backend:
        # every collective here is a block's all-gather or reduce-scatter (tens to hundreds of MB); NCCL picked its
        # low-latency protocol for them, whose kernels hold the SMs longer beside the matmuls, and steps came out
        # uneven (docs/PERFORMANCE.md). The environment's own NCCL_PROTO wins.
        os.environ.setdefault("NCCL_PROTO", "Simple")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # also runs as a plain `python train/main.py`
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if cuda else None)
    return rank, world, device


@contextmanager
def alike() -> Iterator[None]:
    """Checks every rank makes alike (the same files, the same flags): a refusal (any WampipeError) leaves as a
    RunError of the same line and exit status, which rank 0 alone prints; the other ranks exit 1 in silence."""
    try:
        yield
    except RunError:
        raise
    except WampipeError as refusal:
        every_rank = RunError(str(refusal))
        every_rank.exit_status = refusal.exit_status
        raise every_rank from refusal


def settle(cfg: Config, device: torch.device, world: int, rank: int) -> tuple[Config, BatchPlan]:
    """`cfg` with its auto settings resolved for these devices, checked again, and its batch plan; a refusal stops
    every rank (they decide alike) with one line from rank 0."""
    with alike():
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        cfg, auto = resolve_auto(
            cfg, device_memory_gib(device), world, auto_float8_missing(cfg.parallel.float8, capability)
        )
        validate(cfg)  # again: what auto resolved may not go with a given flag
        plan = batch_plan(cfg, world)
    check_float8(cfg.parallel.float8, capability)
    check_wandb(cfg.metrics)
    if rank == 0 and auto:
        print(auto, flush=True)
    if cfg.parallel.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return cfg, plan


def exit_with_launcher() -> None:
    """Under torchrun, die with the launcher: torchrun starts each rank in its own session, so a SIGKILLed torchrun
    would leave its ranks training (and holding GPUs). The kernel sends SIGKILL when the parent exits
    (PR_SET_PDEATHSIG); a parent that exited before that shows as another parent pid."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent == 1 or os.getppid() != parent:
        raise RunError("torchrun exited before this rank started")


class Preemption:
    """SIGTERM asks for a checkpoint of the current step and a clean exit (0). Schedulers send it before they
    preempt a job, and torchrun forwards it to each rank's process group, which holds the rank's loader workers too:
    a worker killed mid-step would make the DataLoader raise in the rank, so `shielding_forks` forks them with
    SIGTERM blocked (they exit when the rank closes the loader, or dies)."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum, frame) -> None:
        self.requested = True

    @contextmanager
    def shielding_forks(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            yield
        finally:  # a SIGTERM that came meanwhile is delivered now
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def step_flags(losses: list[torch.Tensor], grad_norm: torch.Tensor, preempted: bool) -> tuple[bool, bool]:
    """The step's one collective: (any rank's loss or the gradient norm is non-finite, any rank got SIGTERM), so
    every rank skips, stops or saves at the same step."""
    bad = ~torch.isfinite(torch.stack(losses)).all() | ~torch.isfinite(grad_norm)
    flags = torch.stack([bad.float(), torch.tensor(float(preempted), device=bad.device)])
    dist.all_reduce(flags)
    nonfinite, stop = flags.tolist()
    return nonfinite > 0, stop > 0


def drop_step(
    cfg: Config,
    state: TrainState,
    micro_batches: list[tuple[dict, dict]],
    grad_norm: torch.Tensor,
    indexes: list[ShardIndex],
) -> None:
    """Collective, for a step with a non-finite loss or gradient norm: its batches dropped with a warning naming
    them, or the run stopped (nothing saved) beyond --optim.skip-nonfinite such steps."""
    state.skipped += 1
    report = nonfinite_report(state.step + 1, micro_batches, grad_norm, indexes)
    if state.skipped > cfg.optim.skip_nonfinite:
        last = checkpoint.complete_checkpoints(Path(cfg.checkpoint.dir))
        raise RunError(
            f"{report}: stopped, nothing saved (last checkpoint: "
            f"{last[-1][1] if last else 'none'}); --optim.skip-nonfinite N skips up to N such "
            f"steps"
        )
    if dist.get_rank() == 0:
        print(
            f"{report}: its batches dropped, the step runs again on the next ones ({state.skipped} of "
            f"--optim.skip-nonfinite {cfg.optim.skip_nonfinite})",
            flush=True,
        )


def describe_samples(batch: dict, indexes: list[ShardIndex]) -> list[str]:
    """`window in shard files (non-finite inputs)` per sample of a micro-batch: those with a NaN/Inf input if any,
    else all (the model itself overflowed)."""
    index = indexes[int(batch["set"])]
    described = []
    for j, w in enumerate(batch["window"].tolist()):
        window = cast("Window", index.windows[w])  # one window per int (Windows returns a list only for a slice)
        shards = ", ".join(sorted({str(index.shards[index.table.shard(r)]) for r in window.rows}))
        bad = [
            k
            for k in MODEL_INPUTS
            if k in batch and batch[k].is_floating_point() and not torch.isfinite(batch[k][j]).all()
        ]
        described.append((bad, f"{window.name} in {shards}" + (f" (non-finite {', '.join(bad)})" if bad else "")))
    return [d for bad, d in described if bad] or [d for _, d in described]


def nonfinite_report(
    step: int, micro_batches: list[tuple[dict, dict]], grad_norm: torch.Tensor, indexes: list[ShardIndex]
) -> str:
    """Collective (the error path only): one line naming the step and, over all ranks, the samples whose loss went
    non-finite; `micro_batches`: the step's (batch, loss terms)."""
    mine = [
        d
        for batch, terms in micro_batches
        if not torch.isfinite(terms["loss"])
        for d in describe_samples(batch, indexes)
    ]
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    samples = [d for part in gathered for d in part]
    if not samples:
        return f"step {step}: non-finite gradient norm {grad_norm.item()} (every loss finite)"
    more = f" and {len(samples) - 8} more" if len(samples) > 8 else ""
    return f"step {step}: non-finite loss on {'; '.join(samples[:8])}{more}"


def report(failure: BaseException, rank: int) -> int:
    """Print what `failure` leaves on this rank's stderr and return the rank's exit status: a RunError's one line on
    rank 0 alone (every rank raised it alike; the others exit 1 in silence), any other project error's one line (no
    traceback) on the rank that raised it, a SystemExit as Python reports it, anything else with its traceback."""
    if isinstance(failure, SystemExit):
        code = 0 if failure.code is None else failure.code
        if not isinstance(code, int):  # a message: printed, exit status 1
            print(code, file=sys.stderr)
            code = 1
        return code
    if isinstance(failure, RunError) and rank != 0:
        return 1
    if isinstance(failure, WampipeError):
        print(failure, file=sys.stderr)
        return failure.exit_status
    traceback.print_exception(failure)
    return 1


def leave_now(failure: BaseException) -> NoReturn:
    """Report `failure` (`report`, for this process's rank in the process group, 0 without one), then end the
    process without Python's teardown. Why: after a failure this rank's GPU may still hold a collective waiting for
    ranks that will never join it (they failed too, or wait elsewhere), and freeing CUDA memory or the process group
    at exit then blocks for good: four ranks out of GPU memory printed their errors and stayed alive, so torchrun
    never ended the job. Checkpoints are complete or absent either way (train/checkpoint.py writes them
    atomically)."""
    code = report(failure, dist.get_rank() if dist.is_initialized() else 0)
    remove_temporary_copies()  # the exit handlers that would delete them are skipped
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_finished() -> NoReturn:
    """A finished torchrun worker's exit: Python's exit handlers run, then the process ends without the interpreter's
    teardown. Why: that teardown destroys the process group's C++ objects in no set order, and under load a rank whose
    run was complete aborted there ("terminate called without an active exception", exit status -6), failing the
    whole torchrun job."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shut_down() -> None:
    """The run directory unlocked and the process group closed (after a finished or a caught failed run)."""
    checkpoint.release_run_dir()
    if dist.is_initialized():
        dist.destroy_process_group()
