"""Parallelism, optimizer and checkpoint pieces in one process (gloo, world size 1)."""

import gc
from typing import cast

import pytest
import torch
import torch.distributed as dist
from torch.autograd.profiler_util import EventList
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import start_processes

from tests.helpers import tiny_model
from wampipe.train.config import OptimConfig, ParallelConfig
from wampipe.train.dit.loss import FlowMatchScheduler, flow_matching_loss
from wampipe.train.dit.model import Block, random_batch
from wampipe.train.optim import build_optimizer
from wampipe.train.parallel import (
    offload_host_bytes,
    parallelize,
    prepare_micro_batch,
)
from wampipe.train.runtime import leave_finished

torch.set_num_threads(2)


def _backward(model) -> torch.Tensor:
    batch = random_batch(model.cfg, 2, (9, 4, 4), generator=torch.Generator().manual_seed(1))
    loss, _ = flow_matching_loss(model, batch, FlowMatchScheduler(), generator=torch.Generator().manual_seed(2))
    loss.backward()
    return loss.detach()


def _gloo_rank(rank: int, work, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        work(rank, out)
    finally:
        dist.destroy_process_group()
    # a finished rank leaves as the trainer's do: the interpreter's teardown of the gloo group's C++ objects can
    # abort a rank whose work is done ("terminate called without an active exception")
    leave_finished()


def _on_two_gloo_ranks(work, tmp_path) -> str:
    """Run `work(rank, out)` in two spawned processes joined by a gloo process group; returns `out`, a path under
    `tmp_path` for their results."""
    out = str(tmp_path / "out")
    start_processes(_gloo_rank, args=(work, str(tmp_path / "store"), out), nprocs=2, start_method="spawn")
    return out


def _all_gathers_per_step(rank: int, out: str) -> None:
    """On each of two gloo ranks: the parameter all-gathers of one optimizer step of 3 micro-batches, and whether
    the first block's parameters are sharded again (DTensors) after each micro-batch's backward; without and with
    --parallel.gather-once-per-step."""
    found = {}
    for once in (False, True):
        cfg = ParallelConfig(reshard_after_forward=False, gather_once_per_step=once)
        model = tiny_model()
        parallelize(model, cfg)
        sharded_after = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i in range(3):
                prepare_micro_batch(model, cfg, i, 3)
                _backward(model)
                sharded_after.append(isinstance(cast(Block, model.blocks[0]).self_attn.q.weight, DTensor))
        found[once] = sum(e.name == "c10d::_allgather_base_" for e in cast(EventList, prof.events())), sharded_after
    if rank == 0:
        torch.save(found, out)


@pytest.mark.e2e
def test_gathering_once_per_step_keeps_the_parameters_gathered_until_the_last_micro_batch(tmp_path):
    """--parallel.gather-once-per-step: one all-gather per FSDP unit and optimizer step, where the default without
    resharding after forward gathers every unit once per micro-batch; the parameters are sharded again after the
    last micro-batch's backward, ready for the optimizer step."""
    found = torch.load(_on_two_gloo_ranks(_all_gathers_per_step, tmp_path))
    units = len(tiny_model().blocks) + 1  # every block and the root
    assert found[False] == (3 * units, [True, True, True])
    assert found[True] == (units, [False, False, True])


def _offloaded_host_bytes(rank: int, out: str) -> None:
    estimate = offload_host_bytes(tiny_model(), 2, pinned=False)
    model = tiny_model()
    parallelize(model, ParallelConfig(cpu_offload=True))
    opt = build_optimizer(model, OptimConfig(lr=1e-3), torch.device("cpu"), offloaded=True)
    _backward(model)
    opt.step()
    # the shards' storage (FSDP2 pads it to the same size on every rank), their gradients, AdamW's moments
    held = [cast(DTensor, p).to_local().untyped_storage().nbytes() for p in model.parameters()]
    held += [
        t.numel() * t.element_size()
        for t in [cast(DTensor, p.grad).to_local() for p in model.parameters()]
        + [
            v.to_local() if isinstance(v, DTensor) else v
            for state in opt.state.values()
            for k, v in state.items()
            if k in ("exp_avg", "exp_avg_sq")
        ]
    ]
    devices = {cast(DTensor, p).to_local().device.type for p in model.parameters()}
    torch.save((estimate, sum(held), devices), f"{out}.{rank}")


@pytest.mark.e2e
def test_offloaded_state_takes_the_host_memory_estimated_before_the_build(tmp_path):
    """`offload_host_bytes` from the unsharded shapes is what rank 0 of two holds in host memory after a step with
    --parallel.cpu-offload (shards, gradients, AdamW's moments; unpinned, as on CPU ranks), and the most of any rank:
    rank 1's chunks are smaller where a dimension does not split evenly."""
    out = _on_two_gloo_ranks(_offloaded_host_bytes, tmp_path)
    (estimate, rank0, devices), (_, rank1, _) = (torch.load(f"{out}.{r}") for r in (0, 1))
    assert devices == {"cpu"} and estimate == rank0 and rank1 <= rank0


def _live_cpu_bytes() -> int:
    """Bytes of every live CPU tensor storage (each storage once): what a process holds, without an allocator API."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _gradient_bytes_between_micro_batches(rank: int, out: str) -> None:
    held = {}
    for reduce_now in (False, True):  # the default's non-final micro-batch; --parallel.reduce-every-micro-batch
        model = tiny_model()
        params = sum(p.numel() for p in model.parameters())
        parallelize(model, ParallelConfig(param_dtype="bfloat16", reduce_dtype="float32"))
        cast(FSDPModule, model).set_requires_gradient_sync(reduce_now)  # parallelize made it one
        before = _live_cpu_bytes()
        _backward(model)
        held[reduce_now] = (_live_cpu_bytes() - before) / (4 * params)  # in fp32 copies of the whole model
        del model
    if rank == 0:
        torch.save(held, out)


@pytest.mark.e2e
def test_reducing_every_micro_batch_holds_a_shard_of_the_gradients_not_all(tmp_path):
    """Between micro-batches, FSDP2 without a reduce keeps the whole model's gradients unsharded in fp32 (the
    default on every micro-batch but the last: 4 bytes per parameter on every rank); reducing after each one keeps
    this rank's fp32 shard (4 / world bytes). Measured as live tensor bytes on two gloo ranks."""
    held = torch.load(_on_two_gloo_ranks(_gradient_bytes_between_micro_batches, tmp_path))
    assert 0.95 < held[False] < 1.15, held  # one fp32 copy of every gradient
    assert 0.45 < held[True] < 0.65, held  # half of it: this rank's shard
