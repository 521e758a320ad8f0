"""Train a DreamZero DiT on precomputed shards with FSDP2.

    torchrun --nproc-per-node=8 train/main.py --preset libero-5b --data.shards shards/libero
    torchrun --nproc-per-node=2 train/main.py --preset tiny --data.shards build/shards-tiny   # CPU, gloo

One optimizer step = `accum` micro-batches of `data.micro_batch_size` per rank, accum = global batch /
(micro-batch x world size); gradients are reduce-scattered only on the last micro-batch. The model init is the same
on every rank (seeded by `--seed`); noise and timesteps come from a per-rank generator whose state is checkpointed.
Before its optimizer step, each step all-reduces two flags: a non-finite loss or gradient norm on any rank (the run
stops naming the samples, or drops the batches, --optim.skip-nonfinite) and SIGTERM on any rank (every rank saves
this step and exits 0). docs/TRAINING.md lists the guarantees.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import sys
import traceback
from contextlib import contextmanager
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from shardformat.manifest import ShardFormatError
from shardformat.storage import ShardStore
from train import checkpoint
from train.config import Config, device_memory_gib, parse_args, resolve_auto, save_config, validate
from train.data import ShardIndex, ShardLoader, mixture_dims, open_sets
from train.export import check_base, mixture_statistics
from train.flops import dit_flops
from train.lora import apply_lora, init_lora
from train.loss import FlowMatchScheduler, flow_matching_loss
from train.metrics import MetricsLogger, StepProfiler, device_peak_flops
from train.model import CausalWanModel, DiTBatch, DiTConfig, preset
from train.optim import apply_hyperparameters, build_optimizer, build_scheduler, clip_grad_norm, warmup_steps
from train.parallel import (check_float8, check_host_memory, computes_on_cuda, float8_after_step,
                            host_memory_available, offload_host_bytes, parallelize, prepare_micro_batch,
                            recomputed_blocks, use_expandable_segments)
from train.validate import Validation
from train.weights import WeightsError, load_weights

MODEL_INPUTS = [f.name for f in fields(DiTBatch)]
NEEDS_CLIP = ("{shards} holds CLIP's input pixels, not its features (preprocess --image-features pixels): pass the "
              "CLIP weights it was built with ({path}) as --model.image-encoder")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


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


def frozen_image_encoder(cfg: Config, device: torch.device):
    """The frozen CLIP tower when the shards hold its input pixels (preprocess --image-features pixels), else None.
    Every rank holds all of it (small; never sharded, never trained) in the encoders' dtype the shards record, so it
    gives the features preprocessing would have stored. Refuses missing weights, or others than the shards' own."""
    shards = cfg.data.sets()[0].shards  # the sets of a mixture agree on it (train/data.py mixture_dims)
    try:
        manifest = ShardStore(shards).manifest()
    except ShardFormatError as err:
        raise SystemExit(str(err)) from None
    if manifest.image_features == "encoded":
        return None
    built_with, path = manifest.encoders["image_encoder"], cfg.model.image_encoder
    if path is None:
        raise SystemExit(NEEDS_CLIP.format(shards=shards, path=built_with["path"]))
    from preprocess.image_encoder import load_image_encoder  # preprocessing code only for these shards
    from preprocess.outdir import weights_sha256

    if not path.exists():
        raise SystemExit(f"--model.image-encoder {path}: not found")
    if weights_sha256(path)[0] != built_with["sha256"]:
        raise SystemExit(f"--model.image-encoder {path}: not the CLIP weights {shards} was built with "
                         f"({built_with['path']}, sha256 {built_with['sha256'][:12]}): its features would differ")
    return load_image_encoder(path, device=device, dtype=getattr(torch, manifest.encoders["dtype"]))


def model_config(cfg: Config, image_encoder=None, indexes: list[ShardIndex] | None = None):
    """The preset's DiT config, matched to the shards: the tiny preset takes its data-facing widths from them (so it
    trains on shards of any shape, e.g. those built with tiny encoders); a real preset must agree with them. Shards
    of CLIP's input pixels take the CLIP widths from `image_encoder` (`frozen_image_encoder`). `indexes`: each set's
    index if already open. In a mixture each batch brings its latent grid and action horizon, so those two are
    checked for the first set only."""
    indexes = indexes or open_sets(cfg.data)
    dims = mixture_dims(indexes)
    shards = cfg.data.sets()[0].shards
    if image_encoder is not None:
        dims |= dict(zip(("image_len", "image_dim"), image_encoder.feature_shape))
    elif "image_dim" not in dims:
        raise SystemExit(NEEDS_CLIP.format(shards=shards, path="the file they were built with"))
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
        raise SystemExit(f"{shards} does not fit --model.name {cfg.model.name}: {details}")
    return model_cfg


def sharded_model(model_cfg: DiTConfig, cfg: Config, device: torch.device,
                  checkpoint_holds_all: bool = False) -> CausalWanModel:
    """The DiT of `model_cfg`, parallelized, with fp32 shards on `device` (in host memory with --parallel.cpu-offload):
    the seeded init, or --model.init-from of which each rank reads only its own rows (with --model.init-device meta
    no rank ever holds the full model).
    `checkpoint_holds_all`: a step checkpoint will overwrite every parameter (a resumed full fine-tuning), so
    --model.init-from is not read (~1 min for the 14B) and the seeded init stands in until then."""
    if cfg.parallel.cpu_offload:
        return offloaded_model(model_cfg, cfg, device, checkpoint_holds_all)
    torch.manual_seed(cfg.seed)
    meta = cfg.model.init_device == "meta"
    with torch.device("meta" if meta else "cpu"):
        model = CausalWanModel(model_cfg)
    apply_lora(model, cfg.lora)  # before sharding: FSDP2 keeps each parameter's requires_grad
    parallelize(model, cfg.parallel)
    if meta:
        model.to_empty(device=device)
        model._masks = {}
    else:
        model.to(device)
    if cfg.model.init_from is not None and not checkpoint_holds_all:
        try:
            load_weights(model, cfg.model.init_from, seed=cfg.seed)
        except WeightsError as e:
            raise SystemExit(f"--model.init-from {e}") from None
    elif meta:
        with torch.no_grad():
            model.init_weights()
    init_lora(model, cfg.seed)  # after the base weights: the adapters are not in any weights file
    return model


def offloaded_model(model_cfg: DiTConfig, cfg: Config, device: torch.device,
                    checkpoint_holds_all: bool = False) -> CausalWanModel:
    """`sharded_model` with --parallel.cpu-offload: its shards initialized or loaded on `device` without the offload,
    then copied into the offloaded model's host memory. Why: FSDP2 moves an offloaded shard to host memory the moment
    it exists, and on the host DTensor has no per-shard random streams (every rank would draw the same values)."""
    with torch.device("meta"):
        model = CausalWanModel(model_cfg)
    apply_lora(model, cfg.lora)
    held = offload_host_bytes(model, dist.get_world_size(), pinned=computes_on_cuda(cfg.parallel))
    # the least any rank found (-1: one could not tell), read before any rank allocates its state, so that every rank
    # decides alike (a host tensor: the offload's process group has a CPU backend)
    found = host_memory_available()
    least = torch.tensor([-1 if found is None else found], dtype=torch.int64)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    check_host_memory(held, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), None if least < 0 else int(least))
    # the fp32 shards on the device first (4 bytes per parameter over the ranks; the 14B on 4 GPUs: 16.5 GB each)
    on_device = sharded_model(model_cfg, replace(cfg, parallel=replace(cfg.parallel, cpu_offload=False)), device,
                              checkpoint_holds_all)
    parallelize(model, cfg.parallel)
    model.to_empty(device="cpu")  # FSDP2 pins the shards where a GPU computes
    model._masks = {}
    sources = dict(on_device.named_parameters())
    with torch.no_grad():
        for name, host in model.named_parameters():
            host.to_local().copy_(sources[name].to_local())
    del on_device, sources
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the device copy's memory back to the GPU's other users
    return model


def build(cfg: Config, device: torch.device, image_encoder=None, indexes: list[ShardIndex] | None = None,
          checkpoint_holds_all: bool = False) -> CausalWanModel:
    """Same init on every rank, then parallelize; parameters end up as fp32 shards on `device`."""
    model = sharded_model(model_config(cfg, image_encoder, indexes), cfg, device, checkpoint_holds_all)
    if cfg.checkpoint.export and cfg.checkpoint.export_base is not None:  # refuse an unusable base now, not at the end
        try:
            check_base(cfg.checkpoint.export_base, model,
                       list(mixture_statistics([s.shards for s in cfg.data.sets()])))
        except WeightsError as e:
            raise SystemExit(f"--checkpoint.export-base {e}") from None
    model.attention_backend = cfg.model.attention
    model.flex_mask_options = cfg.model.flex_mask_options()
    return model


def noise_generator(cfg: Config, rank: int, device: torch.device, step: int = 0) -> torch.Generator:
    """Per-rank noise/timestep RNG: distinct across ranks, a pure function of (seed, rank, step)."""
    return torch.Generator(device).manual_seed(1_000_003 * (cfg.seed + 1) + rank + 7919 * step)


def exit_with_launcher() -> None:
    """Under torchrun, die with the launcher: torchrun starts each rank in its own session, so a SIGKILLed torchrun
    would leave its ranks training (and holding GPUs). The kernel sends SIGKILL when the parent exits
    (PR_SET_PDEATHSIG); a parent that exited before that shows as another parent pid."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent == 1 or os.getppid() != parent:
        raise SystemExit("torchrun exited before this rank started")


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


def describe_samples(batch: dict, indexes: list[ShardIndex]) -> list[str]:
    """`window in shard files (non-finite inputs)` per sample of a micro-batch: those with a NaN/Inf input if any,
    else all (the model itself overflowed)."""
    index = indexes[int(batch["set"])]
    described = []
    for j, w in enumerate(batch["window"].tolist()):
        window = index.windows[w]
        shards = ", ".join(sorted({str(index.shards[s]) for s, _ in window.variants}))
        bad = [k for k in MODEL_INPUTS
               if k in batch and batch[k].is_floating_point() and not torch.isfinite(batch[k][j]).all()]
        described.append((bad, f"{window.name} in {shards}" + (f" (non-finite {', '.join(bad)})" if bad else "")))
    return [d for bad, d in described if bad] or [d for _, d in described]


def nonfinite_report(step: int, micro_batches: list[tuple[dict, torch.Tensor]], grad_norm: torch.Tensor,
                     indexes: list[ShardIndex]) -> str:
    """Collective (the error path only): one line naming the step and, over all ranks, the samples whose loss went
    non-finite."""
    mine = [d for batch, loss in micro_batches if not torch.isfinite(loss) for d in describe_samples(batch, indexes)]
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    samples = [d for part in gathered for d in part]
    if not samples:
        return f"step {step}: non-finite gradient norm {grad_norm.item()} (every loss finite)"
    more = f" and {len(samples) - 8} more" if len(samples) > 8 else ""
    return f"step {step}: non-finite loss on {'; '.join(samples[:8])}{more}"


def train(cfg: Config) -> dict:
    exit_with_launcher()
    preemption = Preemption()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack, for hangs
    rank, world, device = setup_distributed(cfg)
    try:
        cfg, auto = resolve_auto(cfg, device_memory_gib(device), world)
    except SystemExit as refusal:  # every rank decides alike; one says why
        raise SystemExit(refusal.code if rank == 0 else 1) from None
    validate(cfg)  # again: what auto resolved may not go with a given flag
    check_float8(cfg.parallel.float8, torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
    if rank == 0 and auto:
        print(auto, flush=True)
    if cfg.parallel.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    micro = cfg.data.micro_batch_size
    global_batch = cfg.parallel.global_batch_size or micro * world
    accum, rem = divmod(global_batch, micro * world)
    if rem or accum < 1:
        raise checkpoint.RunError(f"global batch {global_batch} is not a multiple of micro-batch {micro} x {world} "
                                  f"ranks")
    run_dir = Path(cfg.checkpoint.dir)
    checkpoint.claim_run_dir(cfg.checkpoint)  # before any work: another run's directory stops every rank here

    image_encoder = frozen_image_encoder(cfg, device)
    indexes = open_sets(cfg.data)  # once: the model's widths and the loader both read them
    found = checkpoint.resumable(run_dir) if cfg.checkpoint.resume else []
    holds_all = bool(found) and cfg.lora.rank == 0  # a LoRA checkpoint holds the adapters only: the base is re-read
    if holds_all and cfg.model.init_from is not None and rank == 0:
        print(f"resuming from {found[-1][1]}, which holds every weight: --model.init-from is not read", flush=True)
    model = build(cfg, device, image_encoder, indexes, checkpoint_holds_all=holds_all)
    optimizer = build_optimizer(model, cfg.optim, device, offloaded=cfg.parallel.cpu_offload)
    loader = ShardLoader(cfg.data, model.cfg, rank, world, device, indexes)
    gen = noise_generator(cfg, rank, device)
    fm = FlowMatchScheduler(cfg.loss.num_train_timesteps, cfg.loss.shift).to(device)

    step, skipped, warmup = 0, 0, warmup_steps(cfg.optim, cfg.steps)
    if found:
        state = checkpoint.load(found[-1][1], model, optimizer)
        step, skipped, warmup = state["step"], state["skipped"], state["warmup"]
        if step > cfg.steps:
            raise checkpoint.RunError(f"{found[-1][1]} is at step {step}, beyond --steps {cfg.steps}: pass a larger "
                                      f"--steps or another --checkpoint.dir")
        loader.load_state_dict(state["data"])
        if state["same_rank"]:
            gen.set_state(state["rng"])
        else:  # another world size: fresh per-rank streams
            gen = noise_generator(cfg, rank, device, step)
        if rank == 0:
            print(f"resumed from {found[-1][1]} at step {step} (epoch {loader.epoch}, batch {loader.next_batch})",
                  flush=True)
    apply_hyperparameters(optimizer, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps, start=step, warmup=warmup)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")  # --config reads it back: the same run
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        where = device.type + ("; fp32 state in host memory" if cfg.parallel.cpu_offload else "")
        print(f"{cfg.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params "
              f"({trainable / 1e6:.2f}M trainable), {world} ranks ({where}), micro-batch {micro}, "
              f"accum {accum}, global batch {global_batch}, "
              f"{loader.num_windows} windows, {loader.batches_per_epoch} batches/epoch/rank", flush=True)
        if cfg.data.mixture:
            print("mixture: " + ", ".join(f"{name} {p:.3f} ({len(ix)} windows)" for name, p, ix in
                                          zip(loader.names, loader.probs, loader.indexes)), flush=True)

    batches, metrics = iter(loader), None
    try:
        with preemption.shielding_forks():  # the loader forks its workers for the first batch
            first = next(batches)
        latent_shape = tuple(first["latents"].shape[2:])
        # compact text: the first batch's text rows stand for all (prompt lengths vary little within a dataset)
        flops_per_sample = dit_flops(model.cfg, latent_shape, text_rows=first["text"].shape[1])
        recomputed = recomputed_blocks(cfg.parallel.activation_checkpoint, cfg.parallel.ac_blocks, model.cfg.num_layers)
        flops = flops_per_sample.train_step(recompute=recomputed / model.cfg.num_layers)
        metrics = MetricsLogger(cfg.metrics, run_dir, rank, device, cfg.steps, step, flops,
                                device_peak_flops(device, cfg.parallel.peak_tflops), world, config=asdict(cfg),
                                sets=loader.names if cfg.data.mixture else None)
        end = cfg.steps if not cfg.stop_after else min(cfg.steps, step + cfg.stop_after)
        profiler = StepProfiler(cfg.metrics, run_dir, rank, device)
        profiler.after_step(step)  # a profile that starts at the first step
        validation = Validation(cfg, model, loader.indexes, fm, device, image_encoder)
        pending = first
        start_step, stop = step, False
        while step < end and not stop:
            terms_sum: dict[str, torch.Tensor] = {}
            micro_batches = []  # kept for the step's checks: (batch, loss)
            per_set = []  # (set, loss terms) of each micro-batch
            for i in range(accum):
                batch, pending = (pending, None) if pending is not None else (next(batches), None)
                if image_encoder is not None:  # the features the shards would have held, as bf16 like those
                    batch["clip"] = image_encoder.encode_pixels(batch.pop("clip_pixels")).to(torch.bfloat16)
                prepare_micro_batch(model, cfg.parallel, i, accum)
                inputs = DiTBatch(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
                loss, terms = flow_matching_loss(model, inputs, fm, cfg.loss, generator=gen)
                (loss / accum).backward()
                micro_batches.append((batch, terms["loss"]))
                per_set.append((int(batch["set"]), terms))
                for k, v in terms.items():
                    terms_sum[k] = terms_sum.get(k, 0) + v / accum
            grad_norm = clip_grad_norm(model, cfg.optim.grad_clip).to(device)  # host-offloaded: a host tensor
            # checked before the optimizer step, so no NaN ever reaches the weights (one host sync per step)
            nonfinite, stop = step_flags([loss for _, loss in micro_batches], grad_norm, preemption.requested)
            if nonfinite:
                skipped += 1
                report = nonfinite_report(step + 1, micro_batches, grad_norm, loader.indexes)
                if skipped > cfg.optim.skip_nonfinite:
                    last = checkpoint.complete_checkpoints(run_dir)
                    raise checkpoint.RunError(
                        f"{report}: stopped, nothing saved (last checkpoint: {last[-1][1] if last else 'none'}); "
                        f"--optim.skip-nonfinite N skips up to N such steps")
                optimizer.zero_grad(set_to_none=True)
                if rank == 0:
                    print(f"{report}: its batches dropped, the step runs again on the next ones ({skipped} of "
                          f"--optim.skip-nonfinite {cfg.optim.skip_nonfinite})", flush=True)
            else:
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                float8_after_step(model, cfg.parallel.float8)
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                metrics.step({**terms_sum, "grad_norm": grad_norm}, micro * accum, per_set)
                profiler.after_step(step)
                val = validation.after_step(step, end) if not stop else {}  # collective; {} when not due
                if val or step % cfg.metrics.interval == 0 or step == end or stop:
                    metrics.log(step, lr, loader.wait_s, loader.samples_seen(), val)
            if stop or (not nonfinite and ((cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0) or (
                    step == cfg.steps and cfg.checkpoint.save_final))):
                state = {"step": step, "skipped": skipped, "warmup": warmup, "data": loader.state_dict(),
                         "rng": gen.get_state(), "world_size": world}
                path = checkpoint.save(cfg.checkpoint, step, model, optimizer, state)
                if stop and rank == 0:
                    print(f"SIGTERM: saved {path}, exiting", flush=True)
    finally:  # closing the loader shuts its workers down: they ignore SIGTERM, so at exit nothing else would
        batches.close()
        if metrics is not None:
            metrics.close()
    summary = {"rank": rank, "steps": step - start_step, "last_step": step, "next_batch": loader.next_batch,
               "epoch": loader.epoch, "samples": (step - start_step) * micro * accum, "skipped": skipped,
               "preempted": stop}
    (run_dir / f"summary-rank{rank:05d}.json").write_text(json.dumps(summary) + "\n")
    if step == cfg.steps and cfg.checkpoint.export and not stop:  # after a SIGTERM, the next run exports
        checkpoint.require_finite(model, "export")
        path = checkpoint.export(cfg.checkpoint, model, metadata={"step": step, "preset": cfg.preset,
                                                                  "model": cfg.model.name},
                                 shards=[s.shards for s in cfg.data.sets()])
        if rank == 0:
            print(f"exported {path}", flush=True)
    return summary


def leave_now(failure: BaseException) -> NoReturn:
    """Report `failure` as Python would at exit, then end the process without Python's teardown. Why: after a
    failure this rank's GPU may still hold a collective waiting for ranks that will never join it (they failed too,
    or wait elsewhere), and freeing CUDA memory or the process group at exit then blocks for good: four ranks out of
    GPU memory printed their errors and stayed alive, so torchrun never ended the job. Checkpoints are complete or
    absent either way (train/checkpoint.py writes them atomically)."""
    if isinstance(failure, SystemExit):
        code = 0 if failure.code is None else failure.code
        if not isinstance(code, int):  # a message: printed, exit status 1
            print(code, file=sys.stderr)
            code = 1
    else:
        traceback.print_exception(failure)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    try:
        train(cfg)
    except BaseException as failure:
        if __name__ == "__main__":  # a torchrun worker; imported, the caller handles it
            leave_now(failure)
        raise
    finally:
        checkpoint.release_run_dir()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
