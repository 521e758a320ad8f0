"""Train a DreamZero DiT on precomputed shards with FSDP2.

    torchrun --nproc-per-node=8 train/main.py --preset libero-5b --data.shards shards/libero
    torchrun --nproc-per-node=2 train/main.py --preset tiny --data.shards build/shards-tiny   # CPU, gloo

One optimizer step = `accum` micro-batches of `data.micro_batch_size` per rank, accum = global batch /
(micro-batch x world size); gradients are reduce-scattered only on the last micro-batch. The model init is the same
on every rank (seeded by `--seed`); noise and timesteps come from a per-rank generator whose state is checkpointed.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

if __package__ in (None, ""):  # `torchrun train/main.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from train import checkpoint
from train.config import Config, parse_args
from train.data import ShardLoader, data_dims
from train.flops import dit_flops
from train.loss import FlowMatchScheduler, flow_matching_loss
from train.metrics import MetricsLogger, StepProfiler, device_peak_flops
from train.model import CausalWanModel, DiTBatch, preset
from train.optim import build_optimizer, build_scheduler, clip_grad_norm
from train.parallel import parallelize, recomputed_blocks

MODEL_INPUTS = [f.name for f in fields(DiTBatch)]


def setup_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and cfg.parallel.backend != "gloo"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = cfg.parallel.backend if cfg.parallel.backend != "auto" else ("nccl" if cuda else "gloo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # also runs as a plain `python train/main.py`
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if cuda else None)
    return rank, world, device


def model_config(cfg: Config):
    """The preset's DiT config, matched to the shards: the tiny preset takes its data-facing widths from them (so it
    trains on shards of any shape, e.g. those built with tiny encoders); a real preset must agree with them."""
    dims = data_dims(cfg.data.shards)
    model_cfg = preset(cfg.model.name)
    if cfg.model.num_layers:
        model_cfg = replace(model_cfg, num_layers=cfg.model.num_layers)
    if cfg.model.name == "tiny":
        return replace(model_cfg, **dims)
    text_len = dims.pop("text_len")
    wrong = {k: (getattr(model_cfg, k), v) for k, v in dims.items() if getattr(model_cfg, k) != v}
    if wrong or text_len > model_cfg.text_len:
        details = ", ".join(f"{k}: model {m}, shards {d}" for k, (m, d) in wrong.items())
        if text_len > model_cfg.text_len:
            details += f"{', ' if details else ''}longest prompt {text_len} tokens > text_len {model_cfg.text_len}"
        raise SystemExit(f"{cfg.data.shards} does not fit --model.name {cfg.model.name}: {details}")
    return model_cfg


def build(cfg: Config, device: torch.device) -> CausalWanModel:
    """Same init on every rank, then parallelize; parameters end up as fp32 shards on `device`."""
    model_cfg = model_config(cfg)
    torch.manual_seed(cfg.seed)
    if cfg.model.init_device == "meta":
        if cfg.model.init_from is not None:
            raise SystemExit("--model.init-from needs --model.init-device cpu (weights are loaded before sharding)")
        with torch.device("meta"):
            model = CausalWanModel(model_cfg)
        parallelize(model, cfg.parallel)
        model.to_empty(device=device)
        model._masks = {}
        with torch.no_grad():
            model.init_weights()
    else:
        model = CausalWanModel(model_cfg)
        if cfg.model.init_from is not None:
            from train.weights import load_weights
            load_weights(model, cfg.model.init_from)
        parallelize(model, cfg.parallel)
        model.to(device)
    model.attention_backend = cfg.model.attention
    model.flex_mask_options = cfg.model.flex_mask_options()
    return model


def noise_generator(cfg: Config, rank: int, device: torch.device, step: int = 0) -> torch.Generator:
    """Per-rank noise/timestep RNG: distinct across ranks, a pure function of (seed, rank, step)."""
    return torch.Generator(device).manual_seed(1_000_003 * (cfg.seed + 1) + rank + 7919 * step)


def train(cfg: Config) -> dict:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack, for hangs
    rank, world, device = setup_distributed(cfg)
    if cfg.parallel.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    micro = cfg.data.micro_batch_size
    global_batch = cfg.parallel.global_batch_size or micro * world
    accum, rem = divmod(global_batch, micro * world)
    if rem or accum < 1:
        raise SystemExit(f"global batch {global_batch} is not a multiple of micro-batch {micro} x {world} ranks")
    run_dir = Path(cfg.checkpoint.dir)

    model = build(cfg, device)
    optimizer = build_optimizer(model, cfg.optim, device)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps)
    loader = ShardLoader(cfg.data, model.cfg, rank, world, device)
    gen = noise_generator(cfg, rank, device)
    fm = FlowMatchScheduler(cfg.loss.num_train_timesteps, cfg.loss.shift).to(device)

    step = 0
    found = checkpoint.complete_checkpoints(run_dir) if cfg.checkpoint.resume else []
    if found:
        extra = checkpoint.load(found[-1][1], model, optimizer)
        step = extra["step"]
        scheduler.load_state_dict(extra["scheduler"])
        loader.load_state_dict(extra["data"])
        if extra["same_rank"]:
            gen.set_state(extra["rng"])
        else:  # another world size: fresh per-rank streams
            gen = noise_generator(cfg, rank, device, step)
        if rank == 0:
            print(f"resumed from {found[-1][1]} at step {step} (epoch {loader.epoch}, batch {loader.next_batch})",
                  flush=True)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=1, default=str) + "\n")
        print(f"{cfg.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {world} ranks "
              f"({device.type}), micro-batch {micro}, accum {accum}, global batch {global_batch}, "
              f"{loader.num_windows} windows, {loader.batches_per_epoch} batches/epoch/rank", flush=True)

    batches = iter(loader)
    first = next(batches)
    latent_shape = tuple(first["latents"].shape[2:])
    # compact text: the first batch's text rows stand for all (prompt lengths vary little within a dataset)
    flops_per_sample = dit_flops(model.cfg, latent_shape, text_rows=first["text"].shape[1])
    recomputed = recomputed_blocks(cfg.parallel.activation_checkpoint, cfg.parallel.ac_blocks, model.cfg.num_layers)
    flops = flops_per_sample.train_step(recompute=recomputed / model.cfg.num_layers)
    metrics = MetricsLogger(cfg.metrics, run_dir, rank, device, cfg.steps, step, flops,
                            device_peak_flops(device, cfg.parallel.peak_tflops), world)
    end = cfg.steps if not cfg.stop_after else min(cfg.steps, step + cfg.stop_after)
    profiler = StepProfiler(cfg.metrics, run_dir, rank, device)
    profiler.after_step(step)  # a profile that starts at the first step
    pending = first
    start_step = step
    while step < end:
        terms_sum: dict[str, torch.Tensor] = {}
        for i in range(accum):
            batch, pending = (pending, None) if pending is not None else (next(batches), None)
            model.set_requires_gradient_sync(i == accum - 1)
            inputs = DiTBatch(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
            loss, terms = flow_matching_loss(model, inputs, fm, cfg.loss, generator=gen)
            (loss / accum).backward()
            for k, v in terms.items():
                terms_sum[k] = terms_sum.get(k, 0) + v / accum
        grad_norm = clip_grad_norm(model, cfg.optim.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        metrics.step({**terms_sum, "grad_norm": grad_norm}, micro * accum)
        profiler.after_step(step)
        if step % cfg.metrics.interval == 0 or step == end:
            metrics.log(step, lr, loader.wait_s)
        if (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0) or (
                step == cfg.steps and cfg.checkpoint.save_final):
            extra = {"step": step, "scheduler": scheduler.state_dict(), "data": loader.state_dict(),
                     "rng": gen.get_state(), "world_size": world}
            checkpoint.save(cfg.checkpoint, step, model, optimizer, extra)
    metrics.close()
    summary = {"rank": rank, "steps": step - start_step, "last_step": step, "next_batch": loader.next_batch,
               "epoch": loader.epoch, "samples": (step - start_step) * micro * accum}
    (run_dir / f"summary-rank{rank:05d}.json").write_text(json.dumps(summary) + "\n")
    if step == cfg.steps and cfg.checkpoint.export:
        path = checkpoint.export(cfg.checkpoint, model, metadata={"step": step, "preset": cfg.preset,
                                                                  "model": cfg.model.name})
        if rank == 0:
            print(f"exported {path}", flush=True)
    dist.destroy_process_group()
    return summary


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
