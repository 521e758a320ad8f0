"""Float8 training (--parallel.float8, torchao): which linears convert, names and numerics kept, FSDP2's float8
all-gather on two real gloo ranks, the one-line refusals, and scripts/check_fp8_parity.py's plumbing.

torch's CPU build runs float8 matmuls (`aten._scaled_mm`), so everything but the speed is exercised here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import start_processes
from torchao.float8.float8_linear import Float8Linear  # torchao: a dev dependency (pyproject.toml)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from devtools import bench, synthetic
from wampipe.train import checkpoint
from wampipe.train.planning.auto import resolve_auto
from wampipe.train.builder import sharded_model
from wampipe.train.config import CheckpointConfig, Config, OptimConfig, parse_args
from wampipe.train.dit.export import export_weights
from wampipe.train.dit.loss import FlowMatchScheduler, flow_matching_loss
from wampipe.train.dit.model import build_model, preset, random_batch
from wampipe.train.optim import build_optimizer, clip_grad_norm
from wampipe.train.parallel import float8_after_step

from tests.helpers import ROOT

WORLD = 2
OFFICIAL = set(build_model("tiny").state_dict())
# per block: self-attention q k v o, cross-attention q k v o + k_img v_img, the two FFN linears
PER_BLOCK = 12


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8_shards") / "tiny"
    synthetic.make_synthetic_shards(out, "tiny", episodes=2, windows_per_episode=4, seed=3)
    return out


@pytest.mark.e2e
def test_the_trainer_refuses_float8_without_a_capable_gpu(shards, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train" / "main.py"),
            "--preset",
            "tiny",
            "--data.shards",
            str(shards),
            "--checkpoint.dir",
            str(tmp_path / "run"),
            "--parallel.float8",
            "tensorwise",
            "--data.num-workers",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "29631"},
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "--parallel.float8 tensorwise needs a CUDA GPU of compute "
        "capability >= 8.9 (float8 matmuls), found no CUDA device"
    )
    assert not (tmp_path / "run").exists()  # refused before anything was written


def _train_steps(model, rank: int, steps: int, mode: str) -> tuple[list[float], torch.optim.Optimizer]:
    opt = build_optimizer(model, OptimConfig(lr=1e-3), torch.device("cpu"))
    losses = []
    for step in range(steps):
        batch = random_batch(model.cfg, 2, (9, 4, 4), generator=torch.Generator().manual_seed(10 * step + rank))
        loss, _ = flow_matching_loss(model, batch, FlowMatchScheduler(), generator=torch.Generator().manual_seed(step))
        loss.backward()
        clip_grad_norm(model, 1.0)
        opt.step()
        float8_after_step(model, mode)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, opt


def _full(model) -> dict[str, torch.Tensor]:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], full)  # a model's state: tensors only


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        models = {}
        for mode in ("none", "tensorwise"):  # the trainer's build: meta device, float8, FSDP2, init on the shards
            cfg = Config()
            cfg.model.init_device, cfg.parallel.float8 = "meta", mode
            models[mode] = sharded_model(preset("tiny"), cfg, torch.device("cpu"))
        fp8 = models["tensorwise"]
        out = {
            "init": (_full(models["none"]), _full(fp8)),
            "float8_gather": [
                type(cast(DTensor, m.weight)._local_tensor) is WeightWithDynamicFloat8CastTensor
                for m in fp8.modules()
                if isinstance(m, Float8Linear)
            ],
        }
        out["losses"], opt = _train_steps(fp8, rank, 2, "tensorwise")
        cfg = Config()  # --parallel.no-float8-all-gather: FSDP gathers bf16, the linears cast in their forward
        cfg.model.init_device, cfg.parallel.float8, cfg.parallel.float8_all_gather = "meta", "tensorwise", False
        bf16_gather = sharded_model(preset("tiny"), cfg, torch.device("cpu"))
        out["bf16_gather"] = [
            type(cast(DTensor, m.weight)._local_tensor) is torch.Tensor
            for m in bf16_gather.modules()
            if isinstance(m, Float8Linear)
        ]
        out["bf16_gather_losses"] = _train_steps(bf16_gather, rank, 2, "tensorwise")[0]
        out["scales_precomputed"] = all(
            cast(WeightWithDynamicFloat8CastTensor, cast(DTensor, m.weight)._local_tensor)._precomputed_scale
            is not None
            for m in fp8.modules()
            if isinstance(m, Float8Linear)
        )
        trained = _full(fp8)
        cfg = CheckpointConfig(dir=Path(tmp) / "run")
        checkpoint.save(cfg, 2, fp8, opt, {"step": 2})
        with torch.no_grad():
            for p in fp8.parameters():
                p.zero_()
        checkpoint.load(checkpoint.step_dir(cfg.dir, 2), fp8, opt)
        out["restored"] = all(torch.equal(v, trained[k]) for k, v in _full(fp8).items())
        export_weights(fp8, Path(tmp) / "export", dtype=torch.float32)
        cfg = Config()  # a float8 run starting from the float8 run's export: --model.init-from
        cfg.model.init_device, cfg.model.init_from, cfg.parallel.float8 = "meta", Path(tmp) / "export", "tensorwise"
        out["reloaded"] = all(
            torch.equal(v, trained[k])
            for k, v in _full(sharded_model(preset("tiny"), cfg, torch.device("cpu"))).items()
        )
        if rank == 0:
            out["trained"] = trained
            torch.save(out, f"{tmp}/out.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_gathers_float8_weights_and_checkpoints_exports_and_reloads_official_names(tmp_path):
    from safetensors.torch import load_file

    start_processes(_worker, args=(str(tmp_path),), nprocs=WORLD, start_method="spawn")
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    bf16_init, fp8_init = out["init"]
    assert fp8_init.keys() == bf16_init.keys() == OFFICIAL
    for k in OFFICIAL:  # the same seeded init on the shards, float8 or not
        assert torch.equal(fp8_init[k], bf16_init[k]), k
    assert len(out["float8_gather"]) == PER_BLOCK * 2 and all(out["float8_gather"])  # tensorwise: float8 all-gather
    assert out["scales_precomputed"]  # one all-reduce after each optimizer step
    # without the float8 all-gather: plain weights, the same training up to where the weights round (fp32 -> float8
    # directly, or through bf16)
    assert len(out["bf16_gather"]) == PER_BLOCK * 2 and all(out["bf16_gather"])
    for loss, ref in zip(out["bf16_gather_losses"], out["losses"], strict=True):
        assert loss == pytest.approx(ref, rel=1e-2)
    assert all(math.isfinite(loss) for loss in out["losses"])
    assert not torch.equal(out["trained"]["blocks.0.ffn.0.weight"], fp8_init["blocks.0.ffn.0.weight"])  # it trained
    assert out["restored"] and out["reloaded"]  # DCP round trip; export -> --model.init-from
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert exported.keys() == OFFICIAL
    for k, v in exported.items():
        assert type(v) is torch.Tensor and torch.equal(v, out["trained"][k]), k


@pytest.mark.slow
def test_parity_script_trains_twice_on_the_same_data_and_compares_the_curves(shards, tmp_path):
    out = tmp_path / "parity"
    # the smoke form: bf16 twice, deterministic, with the auto settings resolved (and printed) by both trainers
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "check_fp8_parity.py"),
            "--preset",
            "tiny",
            "--float8",
            "none",
            "--steps",
            "2",
            "--shards",
            str(shards),
            "--out",
            str(out),
            "--",
            "--parallel.deterministic",
            "--data.num-workers",
            "0",
            "--parallel.activation-checkpoint",
            "auto",
            "--data.micro-batch-size",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r == json.loads((out / "result.json").read_text())
    assert len(r["loss_bf16"]) == 2 and r["loss_other"] == r["loss_bf16"]
    assert r["mean_abs_diff"] == 0 and r["bf16_step_noise"] > 0 and r["ratio"] == 0 and r["parity"]
    line = "auto settings for tiny on CPU: no recompute, micro-batch 2, reshard after forward (the preset's recipe)"
    assert done.stdout.count(line) == 2
    # the bench's check that its bound uses what the trainer resolved, against a real trainer's config.yaml
    argv = ["--preset", "tiny", "--data.shards", str(shards), "--parallel.activation-checkpoint", "auto"]
    cfg, _ = resolve_auto(parse_args(argv), None, 1)
    bench.check_same_resolution(cfg, out / "run-bf16")
    with pytest.raises(
        SystemExit,
        match=r"config.yaml: the trainer resolved other settings than the bound uses: "
        r"data.micro_batch_size 2 \(here 4\)$",
    ):
        bench.check_same_resolution(replace(cfg, data=replace(cfg.data, micro_batch_size=4)), out / "run-bf16")
    # a float8 comparison where float8 cannot run stops before writing anything
    refused = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "check_fp8_parity.py"),
            "--preset",
            "tiny",
            "--float8",
            "rowwise",
            "--out",
            str(tmp_path / "refused"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 1 and "needs a CUDA GPU of compute capability >= 8.9" in refused.stderr
    assert not (tmp_path / "refused" / "shards").exists()
