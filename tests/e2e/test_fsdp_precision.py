"""FSDP2 mixed precision keeps the training math: two real ranks (gloo), bf16 parameters, fp32 reduce.

The timesteps, the RoPE tables and the compact-text log-weights must reach the model unrounded (FSDP2 casts every
floating forward input to the parameter dtype unless told not to), and the sharded gradients must equal those of an
unsharded model under the same semantics: bf16 parameters, fp32 inputs, the model's own casts.
"""

from __future__ import annotations

import copy
from typing import cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import start_processes

from tests.helpers import tiny_model
from wampipe.train.config import ParallelConfig
from wampipe.train.dit.loss import FlowMatchScheduler, flow_matching_loss
from wampipe.train.dit.model import DiTBatch, random_batch
from wampipe.train.parallel import parallelize
from wampipe.train.dit.text import compact_text
from wampipe.train.runtime import leave_finished

WORLD = 2


def _batch(cfg) -> tuple[DiTBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    batch = random_batch(cfg, 2, (9, 4, 4), generator=g)
    # compact text, so the text log-weights are in play
    texts = [t[: int((t.abs().sum(-1) > 0).sum())] for t in batch.text]
    batch.text, batch.text_lengths = compact_text(texts, cfg.text_len, bucket=8)
    # timestep ids (frame 0 its own, then one per block of two frames) whose values bf16 would round
    frame_ids = torch.tensor([[5, 997, 997, 512, 512, 3, 3, 801, 801], [999, 1, 1, 250, 250, 640, 640, 17, 17]])
    return batch, frame_ids


def _loss_grads(model, batch, frame_ids):
    loss, _ = flow_matching_loss(
        model, batch, FlowMatchScheduler(), generator=torch.Generator().manual_seed(2), frame_ids=frame_ids
    )
    loss.backward()
    return loss.detach().float()


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        model = tiny_model()
        reference = copy.deepcopy(model).to(torch.bfloat16)  # unsharded, same semantics: bf16 params, own casts
        parallelize(model, ParallelConfig(param_dtype="bfloat16", reduce_dtype="float32"))

        seen = {}
        model.register_forward_pre_hook(lambda m, args: seen.setdefault("root", args))  # after FSDP's own hook
        model.blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("block", args))
        batch, frame_ids = _batch(model.cfg)
        loss = _loss_grads(model, batch, frame_ids)
        ref_loss = _loss_grads(reference, batch, frame_ids)

        t_frames, t_actions = seen["root"][1], seen["root"][4]
        (cos, sin), text_log_weight = seen["block"][3], seen["block"][5]
        fm = FlowMatchScheduler()
        out = {
            "t_dtype": (t_frames.dtype, t_actions.dtype),
            "t_exact": torch.equal(t_frames, fm.timesteps[frame_ids]),
            "rope_dtype": (cos.dtype, sin.dtype),
            "text_weight_dtype": text_log_weight.dtype,
            "loss": (loss.item(), ref_loss.item()),
            "grads": {},
        }
        ref_grads = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            full = cast(DTensor, p.grad).full_tensor()
            out["grads"][name] = (full, cast(torch.Tensor, ref_grads[name].grad).float())
        if rank == 0:
            torch.save(out, f"{tmp}/out.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # a finished rank leaves as the trainer's do: the interpreter's teardown of the gloo group's C++ objects can
    # abort a rank whose work is done ("terminate called without an active exception")
    leave_finished()


@pytest.mark.e2e
def test_fsdp2_keeps_fp32_timesteps_rope_and_text_weights_and_matches_unsharded_grads(tmp_path):
    start_processes(_worker, args=(str(tmp_path),), nprocs=WORLD, start_method="spawn")
    out = torch.load(tmp_path / "out.pt")
    assert out["t_dtype"] == (torch.float32, torch.float32) and out["t_exact"]
    assert out["rope_dtype"] == (torch.float32, torch.float32)
    assert out["text_weight_dtype"] == torch.float32
    assert out["loss"][0] == out["loss"][1]
    for name, (sharded, unsharded) in out["grads"].items():
        # both ranks saw the same batch: the fp32 average of two equal bf16 gradients is that gradient
        torch.testing.assert_close(sharded, unsharded, rtol=0, atol=0, msg=name)
