"""Parallelism, optimizer and checkpoint pieces in one process (gloo, world size 1)."""

import math
from functools import partial
from typing import cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from tests.helpers import tiny_model
from wampipe.errors import UsageError
from wampipe.train import checkpoint
from wampipe.train.config import CheckpointConfig, OptimConfig, ParallelConfig
from wampipe.train.dit.loss import FlowMatchScheduler, flow_matching_loss
from wampipe.train.dit.model import build_model, random_batch
from wampipe.train.optim import build_optimizer, build_scheduler, clip_grad_norm, lr_factor
from wampipe.train.parallel import (
    HostGradientSum,
    ac_block_indices,
    allocator_settings,
    apply_ac,
    check_host_memory,
    host_memory_available,
    offload_host_bytes,
    parallelize,
    prepare_micro_batch,
    recomputed_blocks,
    use_expandable_segments,
)

torch.set_num_threads(2)


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _backward(model) -> torch.Tensor:
    batch = random_batch(model.cfg, 2, (9, 4, 4), generator=torch.Generator().manual_seed(1))
    loss, _ = flow_matching_loss(model, batch, FlowMatchScheduler(), generator=torch.Generator().manual_seed(2))
    loss.backward()
    return loss.detach()


def _loss_and_grads(model):
    return _backward(model), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_names_loss_and_grads(mode):
    ref_loss, ref_grads = _loss_and_grads(tiny_model())
    model = tiny_model()
    apply_ac(model, mode)
    assert set(model.state_dict()) == set(build_model("tiny").state_dict())  # official names survive the wrapper
    loss, grads = _loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss)
    grads = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in grads.items()}
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], msg=k)


def test_partial_recompute_wraps_evenly_spread_blocks_and_keeps_grads():
    assert ac_block_indices(40, 25) == sorted(set(ac_block_indices(40, 25))) and len(ac_block_indices(40, 25)) == 25
    assert ac_block_indices(40, 20) == list(range(0, 40, 2)) and ac_block_indices(30, "auto") == list(range(30))
    assert ac_block_indices(30, 0) == [] and ac_block_indices(4, 9) == [0, 1, 2, 3]
    assert recomputed_blocks("full", 25, 40) == 25
    assert recomputed_blocks("selective", "auto", 40) == 0
    ref_loss, ref_grads = _loss_and_grads(tiny_model())
    model = tiny_model()
    apply_ac(model, "full", ac_blocks=1)
    wrapped = [type(b).__name__ for b in model.blocks]
    assert wrapped.count("CheckpointWrapper") == 1 and wrapped[0] == "CheckpointWrapper"
    loss, grads = _loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss)
    for k, g in grads.items():
        torch.testing.assert_close(g, ref_grads[k.replace("._checkpoint_wrapped_module", "")], msg=k)


def test_full_recompute_on_some_blocks_and_selective_on_the_others_keeps_grads():
    ref_loss, ref_grads = _loss_and_grads(tiny_model())
    model = tiny_model()
    apply_ac(model, "full", ac_blocks=1, others="selective")
    # every block wrapped; only block 0 without the selective policy (full recompute)
    assert all(type(b).__name__ == "CheckpointWrapper" for b in model.blocks)
    policies = ["context_fn" in cast(partial, b.checkpoint_fn).keywords for b in model.blocks]
    assert policies == [False] + [True] * (len(model.blocks) - 1)
    loss, grads = _loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss)
    for k, g in grads.items():
        torch.testing.assert_close(g, ref_grads[k.replace("._checkpoint_wrapped_module", "")], msg=k)
    with pytest.raises(ValueError, match="none or selective"):
        apply_ac(tiny_model(), "full", ac_blocks=1, others="full")


def test_fsdp_mixed_precision_trains_with_fp32_masters_and_official_names(tmp_path):
    model = tiny_model()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    parallelize(model, ParallelConfig(param_dtype="bfloat16", activation_checkpoint="full"))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    opt = build_optimizer(model, OptimConfig(lr=1e-3), torch.device("cpu"))
    loss, _ = _loss_and_grads(model)
    assert torch.isfinite(loss)
    norm = clip_grad_norm(model, 1.0)
    assert norm > 0 and not isinstance(norm, DTensor)
    opt.step()
    full = cast(
        dict[str, torch.Tensor],  # a model's state: tensors only
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
    )
    assert full.keys() == reference.keys()
    assert not torch.equal(full["blocks.0.self_attn.q.weight"], reference["blocks.0.self_attn.q.weight"])
    cfg = CheckpointConfig(dir=tmp_path / "run", keep_last=2)
    sched = build_scheduler(opt, OptimConfig(), 10)
    for step in (1, 2, 3):
        checkpoint.save(cfg, step, model, opt, {"step": step, "scheduler": sched.state_dict()})
    (cfg.dir / "step-000009").mkdir()  # a save killed before DCP wrote .metadata: not a checkpoint
    assert [s for s, _ in checkpoint.complete_checkpoints(cfg.dir)] == [2, 3]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    extra = checkpoint.load(checkpoint.step_dir(cfg.dir, 3), model, opt)
    assert extra["step"] == 3 and extra["same_rank"]
    restored = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for k in full:
        torch.testing.assert_close(restored[k], full[k], rtol=0, atol=0)


def _offloaded(module) -> list[bool]:
    """Whether FSDP2 keeps each of `module`'s sharded parameters in host memory (its CPUOffloadPolicy)."""
    return [p.offload_to_cpu for p in module._get_fsdp_state()._fsdp_param_group.fsdp_params]


def test_cpu_offload_keeps_every_shard_in_host_memory_and_trains_the_same():
    """--parallel.cpu-offload: every FSDP unit (blocks and root) offloads its fp32 shards and gradients, and the
    optimizer is the fused AdamW (the fast one on the CPU); on a CPU device the step is the same as without."""
    grads, weights = {}, {}
    for offload in (False, True):
        model = tiny_model()
        parallelize(model, ParallelConfig(cpu_offload=offload))
        assert all(_offloaded(model)) == offload and all(all(_offloaded(b)) == offload for b in model.blocks)
        opt = build_optimizer(
            model, OptimConfig(lr=1e-3, fused=True if not offload else "auto"), torch.device("cpu"), offloaded=offload
        )
        assert opt.defaults["fused"]
        _, grads[offload] = _loss_and_grads(model)
        clip_grad_norm(model, 1.0)
        opt.step()
        weights[offload] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for k in grads[False]:
        torch.testing.assert_close(grads[True][k], grads[False][k], rtol=0, atol=0)
        torch.testing.assert_close(weights[True][k], weights[False][k], rtol=0, atol=0)


def test_host_gradient_sum_gives_fsdps_own_accumulation_bit_for_bit():
    """Offloaded gradients summed over three micro-batches outside FSDP2 (`HostGradientSum`: taken away after each
    backward but the last, added back after it) are FSDP2's own accumulated gradients, bit for bit; in between the
    parameters hold no gradient, so FSDP2's next reduce finds none (its fast copy path)."""
    grads = {}
    for own in (False, True):
        model = tiny_model()
        cfg = ParallelConfig(cpu_offload=True, reduce_every_micro_batch=True)
        parallelize(model, cfg)
        sums = HostGradientSum() if own else None
        for index in range(3):
            prepare_micro_batch(model, cfg, index, 3)
            batch = random_batch(model.cfg, 2, (9, 4, 4), generator=torch.Generator().manual_seed(10 + index))
            noise = torch.Generator().manual_seed(index)
            loss, _ = flow_matching_loss(model, batch, FlowMatchScheduler(), generator=noise)
            loss.backward()
            if sums is not None:
                sums.after_backward(model, last=index == 2)
                assert all(p.grad is None for p in model.parameters()) == (index < 2)
        assert sums is None or not sums.sums  # emptied for the next step
        grads[own] = {k: cast(DTensor, p.grad).full_tensor() for k, p in model.named_parameters()}
    assert grads[True].keys() == grads[False].keys()
    for k in grads[False]:
        torch.testing.assert_close(grads[True][k], grads[False][k], rtol=0, atol=0)


def test_offload_estimate_pads_shards_and_rounds_pinned_ones_and_refuses_what_does_not_fit():
    linear = torch.nn.Linear(3, 5)  # 2 ranks: weight rows 5 -> 3 per rank (36 bytes), bias 5 -> 3 (12 bytes)
    assert offload_host_bytes(linear, 2, pinned=False) == 4 * (36 + 12)
    # pinned shards and gradients rounded up to 64 and 16 bytes, the moments not pinned
    assert offload_host_bytes(linear, 2, pinned=True) == 2 * (64 + 16) + 2 * (36 + 12)
    # summing the gradients over micro-batches (HostGradientSum): one pinned gradient shard more
    assert offload_host_bytes(linear, 2, pinned=True, accumulating=True) == 3 * (64 + 16) + 2 * (36 + 12)
    linear.weight.requires_grad_(False)  # frozen (LoRA's base): its shard only
    assert offload_host_bytes(linear, 2, pinned=True) == 64 + 2 * 16 + 2 * 12
    check_host_memory(80 * 10**9, 4, 400 * 10**9)
    check_host_memory(80 * 10**9, 4, None)  # no /proc/meminfo: not checked
    with pytest.raises(
        UsageError,
        match=r"--parallel.cpu-offload: this node's 4 rank\(s\) need ~344 GB of host "
        r"memory \(84.0 GB each .*2 GB for the process\), 340 GB is available",
    ):
        check_host_memory(84 * 10**9, 4, 340 * 10**9)  # the state alone (336 GB) would fit
    available = host_memory_available()
    assert available is not None and available > 0  # this Linux machine's MemAvailable


def test_expandable_segments_keep_the_environments_other_allocator_settings():
    """Applying allocator settings resets every one not named: the environment's own are applied with them."""
    assert allocator_settings({}) == "expandable_segments:True"
    assert (
        allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,garbage_collection_threshold:0.8"})
        == "max_split_size_mb:512,garbage_collection_threshold:0.8,expandable_segments:True"
    )
    assert (
        allocator_settings({"PYTORCH_ALLOC_CONF": "max_split_size_mb:256", "PYTORCH_CUDA_ALLOC_CONF": "x:1"})
        == "max_split_size_mb:256,expandable_segments:True"
    )  # the newer name first
    # the environment chooses: expandable segments named either way, or another allocator backend
    assert allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is None
    assert allocator_settings({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}) is None
    assert not use_expandable_segments(torch.device("cpu"))


def test_adamw_defaults_and_schedule():
    cfg = OptimConfig()
    assert (cfg.lr, cfg.betas, cfg.weight_decay, cfg.grad_clip) == (1e-5, (0.95, 0.999), 1e-5, 1.0)
    warm, steps = 5, 105
    assert lr_factor(0, warm, steps) == pytest.approx(0.2)
    assert lr_factor(4, warm, steps) == pytest.approx(1.0)
    assert lr_factor(5, warm, steps) == pytest.approx(1.0)
    assert lr_factor(55, warm, steps) == pytest.approx(0.5)
    assert lr_factor(105, warm, steps) == pytest.approx(0.0)
    assert lr_factor(55, warm, steps, min_ratio=0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = build_scheduler(opt, cfg, 100)  # warmup 5 % = 5 steps
    lrs = []
    for _ in range(100):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(cfg.lr / 5) and lrs[4] == pytest.approx(cfg.lr)
    assert lrs[52] == pytest.approx(cfg.lr * 0.5 * (1 + math.cos(math.pi * 47 / 95)))
    assert opt.param_groups[0]["betas"] == (0.95, 0.999) and opt.param_groups[0]["weight_decay"] == 1e-5
