"""What a training run is built from: the DiT config from the recipe and the shards, the sharded (or host-offloaded)
model with its LoRA adapters, the frozen image encoder, the loader, the optimizer and its schedule, and the loop's
state from the newest checkpoint (`build_run`), then the metrics once the first batch shows its shapes.

The model init is the same on every rank (seeded by `--seed`); parameters end up as fp32 shards (train/parallel.py).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from wampipe.errors import RunError, UsageError
from wampipe.shardformat.storage import ShardStore
from wampipe.train import checkpoint
from wampipe.train.config import AUTO, BatchPlan, Config, batch_plan, save_config
from wampipe.train.data import ShardIndex, ShardLoader, mixture_dims, open_sets
from wampipe.train.dit.export import check_base, mixture_statistics
from wampipe.train.dit.flops import dit_flops
from wampipe.train.dit.lora import apply_lora, init_lora
from wampipe.train.dit.loss import FlowMatchScheduler, flow_matching_loss
from wampipe.train.metrics import MetricsLogger, StepProfiler, device_peak_flops
from wampipe.train.dit.model import MODEL_INPUTS, CausalWanModel, DiTBatch, DiTConfig, preset
from wampipe.train.optim import apply_hyperparameters, build_optimizer, build_scheduler, warmup_steps
from wampipe.train.parallel import (
    HostGradientSum,
    check_host_memory,
    computes_on_cuda,
    float8_after_step,
    host_memory_available,
    offload_host_bytes,
    parallelize,
    prepare_micro_batch,
    recomputed_blocks,
)
from wampipe.train.state import TrainState
from wampipe.train.dit.weights import WeightsError, load_weights

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from wampipe.encoders.image_encoder import ImageEncoder

NEEDS_CLIP = (
    "{shards} holds CLIP's input pixels, not its features (preprocess --image-features pixels): pass the "
    "CLIP weights it was built with ({path}) as --model.image-encoder"
)


def frozen_image_encoder(cfg: Config, device: torch.device):
    """The frozen CLIP tower when the shards hold its input pixels (preprocess --image-features pixels), else None.
    Every rank holds all of it (small; never sharded, never trained) in the encoders' dtype the shards record, so it
    gives the features preprocessing would have stored. Refuses missing weights, or others than the shards' own."""
    shards = cfg.data.sets()[0].shards  # the sets of a mixture agree on it (train/data.py mixture_dims)
    manifest = ShardStore(shards).manifest()  # a ShardFormatError names the file
    if manifest.image_features == "encoded":
        return None
    built_with, path = manifest.encoders["image_encoder"], cfg.model.image_encoder
    if path is None:
        raise UsageError(NEEDS_CLIP.format(shards=shards, path=built_with["path"]))
    from wampipe.encoders.image_encoder import load_image_encoder  # transformers' CLIP only for these shards
    from wampipe.encoders.weights import weights_sha256

    if not path.exists():
        raise UsageError(f"--model.image-encoder {path}: not found")
    if weights_sha256(path)[0] != built_with["sha256"]:
        raise UsageError(
            f"--model.image-encoder {path}: not the CLIP weights {shards} was built with "
            f"({built_with['path']}, sha256 {built_with['sha256'][:12]}): its features would differ"
        )
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
        raise UsageError(NEEDS_CLIP.format(shards=shards, path="the file they were built with"))
    model_cfg = preset(cfg.model.name)
    if cfg.model.num_layers != AUTO:
        model_cfg = replace(model_cfg, num_layers=cfg.model.num_layers)
    if cfg.model.name == "tiny":
        return replace(model_cfg, **dims)
    text_len = dims.pop("text_len")
    wrong = {k: (getattr(model_cfg, k), v) for k, v in dims.items() if getattr(model_cfg, k) != v}
    if wrong or text_len > model_cfg.text_len:
        details = ", ".join(f"{k}: model {m}, shards {d}" for k, (m, d) in wrong.items())
        if text_len > model_cfg.text_len:
            details += f"{', ' if details else ''}longest prompt {text_len} tokens > text_len {model_cfg.text_len}"
        raise UsageError(f"{shards} does not fit --model.name {cfg.model.name}: {details}")
    return model_cfg


def sharded_model(
    model_cfg: DiTConfig, cfg: Config, device: torch.device, checkpoint_holds_all: bool = False
) -> CausalWanModel:
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
            raise WeightsError(f"--model.init-from {e}") from None
    elif meta:
        with torch.no_grad():
            model.init_weights()
    init_lora(model, cfg.seed)  # after the base weights: the adapters are not in any weights file
    return model


def offloaded_model(
    model_cfg: DiTConfig, cfg: Config, device: torch.device, checkpoint_holds_all: bool = False
) -> CausalWanModel:
    """`sharded_model` with --parallel.cpu-offload: its shards initialized or loaded on `device` without the offload,
    then copied into the offloaded model's host memory. Why: FSDP2 moves an offloaded shard to host memory the moment
    it exists, and on the host DTensor has no per-shard random streams (every rank would draw the same values)."""
    with torch.device("meta"):
        model = CausalWanModel(model_cfg)
    apply_lora(model, cfg.lora)
    held = offload_host_bytes(
        model,
        dist.get_world_size(),
        pinned=computes_on_cuda(cfg.parallel),
        accumulating=host_sums_gradients(cfg, dist.get_world_size()),
    )
    # the least any rank found (-1: one could not tell), read before any rank allocates its state, so that every rank
    # decides alike (a host tensor: the offload's process group has a CPU backend)
    found = host_memory_available()
    least = torch.tensor([-1 if found is None else found], dtype=torch.int64)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    check_host_memory(held, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), None if least < 0 else int(least))
    # the fp32 shards on the device first (4 bytes per parameter over the ranks; the 14B on 4 GPUs: 16.5 GB each)
    on_device = sharded_model(
        model_cfg, replace(cfg, parallel=replace(cfg.parallel, cpu_offload=False)), device, checkpoint_holds_all
    )
    parallelize(model, cfg.parallel)
    model.to_empty(device="cpu")  # FSDP2 pins the shards where a GPU computes
    model._masks = {}
    sources = dict(on_device.named_parameters())
    with torch.no_grad():
        for name, host in model.named_parameters():
            # both models are sharded by parallelize: every parameter a DTensor
            cast("DTensor", host).to_local().copy_(cast("DTensor", sources[name]).to_local())
    del on_device, sources
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the device copy's memory back to the GPU's other users
    return model


def build(
    cfg: Config,
    device: torch.device,
    image_encoder=None,
    indexes: list[ShardIndex] | None = None,
    checkpoint_holds_all: bool = False,
) -> CausalWanModel:
    """Same init on every rank, then parallelize; parameters end up as fp32 shards on `device`."""
    model = sharded_model(model_config(cfg, image_encoder, indexes), cfg, device, checkpoint_holds_all)
    if cfg.checkpoint.export and cfg.checkpoint.export_base is not None:  # refuse an unusable base now, not at the end
        try:
            check_base(cfg.checkpoint.export_base, model, list(mixture_statistics([s.shards for s in cfg.data.sets()])))
        except WeightsError as e:
            raise WeightsError(f"--checkpoint.export-base {e}") from None
    model.attention_backend = cfg.model.attention
    model.flex_mask_options = cfg.model.flex_mask_options()
    return model


@dataclass
class Run:
    """A run's parts, built (`build_run`) and, when resuming, at the checkpoint's step."""

    model: CausalWanModel
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LRScheduler
    loader: ShardLoader
    flow: FlowMatchScheduler
    image_encoder: ImageEncoder | None  # for shards of CLIP's input pixels
    state: TrainState
    host_sums: HostGradientSum | None = None  # offloaded gradients summed over micro-batches (`host_sums_gradients`)

    def forward_backward(self, cfg: Config, batch: dict, index: int, plan: BatchPlan) -> dict[str, torch.Tensor]:
        """Micro-batch `index` of the step: its loss, whose gradient adds to the step's (reduce-scattered on the last
        micro-batch, train/parallel.py `prepare_micro_batch`); returns its detached loss terms."""
        if self.image_encoder is not None:  # the features the shards would have held, as bf16 like those
            batch["clip"] = self.image_encoder.encode_pixels(batch.pop("clip_pixels")).to(torch.bfloat16)
        prepare_micro_batch(self.model, cfg.parallel, index, plan.accum)
        inputs = DiTBatch(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
        loss, terms = flow_matching_loss(self.model, inputs, self.flow, cfg.loss, generator=self.state.noise)
        (loss / plan.accum).backward()
        if self.host_sums is not None:
            self.host_sums.after_backward(self.model, last=index == plan.accum - 1)
        return terms

    def optimizer_step(self, cfg: Config) -> float:
        """The optimizer step at the schedule's lr (returned), float8 scales refreshed, the gradients freed."""
        lr = cast(float, self.lr_schedule.get_last_lr()[0])  # a float: build_optimizer's lr is one
        self.optimizer.step()
        float8_after_step(self.model, cfg.parallel.float8)
        self.lr_schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr


def build_run(cfg: Config, rank: int, world: int, device: torch.device) -> Run:
    """Every part of the run on this rank, at the newest complete checkpoint's step with --checkpoint.resume."""
    from wampipe.train.runtime import alike

    with alike():  # every rank reads the same files: a bad one is one line, from rank 0
        try:
            image_encoder = frozen_image_encoder(cfg, device)
        except WeightsError as err:
            raise WeightsError(f"--model.image-encoder: {err}") from None
        indexes = open_sets(cfg.data)  # once: the model's widths and the loader both read them
    found = checkpoint.resumable(Path(cfg.checkpoint.dir)) if cfg.checkpoint.resume else []
    holds_all = bool(found) and cfg.lora.rank == 0  # a LoRA checkpoint holds the adapters only: the base is re-read
    if holds_all and cfg.model.init_from is not None and rank == 0:
        print(f"resuming from {found[-1][1]}, which holds every weight: --model.init-from is not read", flush=True)
    model = build(cfg, device, image_encoder, indexes, checkpoint_holds_all=holds_all)
    optimizer = build_optimizer(model, cfg.optim, device, offloaded=cfg.parallel.cpu_offload, seed=cfg.seed)
    loader = ShardLoader(cfg.data, model.cfg, rank, world, device, indexes)
    state = TrainState(loader, cfg.seed, rank, device, warmup=warmup_steps(cfg.optim, cfg.steps))
    if found:
        resume(cfg, found[-1][1], model, optimizer, state)
    apply_hyperparameters(optimizer, cfg.optim)
    lr_schedule = build_scheduler(optimizer, cfg.optim, cfg.steps, start=state.step, warmup=state.warmup)
    flow = FlowMatchScheduler(cfg.loss.num_train_timesteps, cfg.loss.shift).to(device)
    host_sums = HostGradientSum() if host_sums_gradients(cfg, world) else None
    return Run(model, optimizer, lr_schedule, loader, flow, image_encoder, state, host_sums)


def host_sums_gradients(cfg: Config, world: int) -> bool:
    """Whether the step's micro-batches sum their offloaded gradients in a `HostGradientSum`: with the state in host
    memory, gradients reduced every micro-batch and more than one micro-batch a step."""
    p = cfg.parallel
    return p.cpu_offload and bool(p.reduce_every_micro_batch) and batch_plan(cfg, world).accum > 1


def resume(cfg: Config, path: Path, model: CausalWanModel, optimizer: torch.optim.Optimizer, state: TrainState) -> None:
    """Model, optimizer and the loop's state from the checkpoint at `path`."""
    state.load_state_dict(checkpoint.load(path, model, optimizer))
    if state.step > cfg.steps:
        raise RunError(
            f"{path} is at step {state.step}, beyond --steps {cfg.steps}: pass a larger "
            f"--steps or another --checkpoint.dir"
        )
    if dist.get_rank() == 0:
        print(
            f"resumed from {path} at step {state.step} (epoch {state.loader.epoch}, batch {state.loader.next_batch})",
            flush=True,
        )


def announce(cfg: Config, run: Run, plan: BatchPlan, device: torch.device) -> None:
    """Rank 0: the run's config.yaml written (--config reads it back: the same run) and one line about the run."""
    if dist.get_rank() != 0:
        return
    run_dir, model, loader = Path(cfg.checkpoint.dir), run.model, run.loader
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    where = device.type + ("; fp32 state in host memory" if cfg.parallel.cpu_offload else "")
    print(
        f"{cfg.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params "
        f"({trainable / 1e6:.2f}M trainable), {dist.get_world_size()} ranks ({where}), micro-batch {plan.micro}, "
        f"accum {plan.accum}, global batch {plan.global_batch}, "
        f"{loader.num_windows} windows, {loader.batches_per_epoch} batches/epoch/rank",
        flush=True,
    )
    if cfg.data.mixture:
        print(
            "mixture: "
            + ", ".join(
                f"{name} {p:.3f} ({len(ix)} windows)" for name, p, ix in zip(loader.names, loader.probs, loader.indexes)
            ),
            flush=True,
        )


def open_metrics(cfg: Config, run: Run, first: dict, device: torch.device) -> tuple[MetricsLogger, StepProfiler]:
    """The metrics logger and the profiler of the run, sized by its first batch."""
    model, rank, world = run.model, dist.get_rank(), dist.get_world_size()
    # compact text: the first batch's text rows stand for all (prompt lengths vary little within a dataset)
    flops_per_sample = dit_flops(model.cfg, tuple(first["latents"].shape[2:]), text_rows=first["text"].shape[1])
    recomputed = recomputed_blocks(cfg.parallel.activation_checkpoint, cfg.parallel.ac_blocks, model.cfg.num_layers)
    flops = flops_per_sample.train_step(recompute=recomputed / model.cfg.num_layers)
    run_dir = Path(cfg.checkpoint.dir)
    metrics = MetricsLogger(
        cfg.metrics,
        run_dir,
        rank,
        device,
        cfg.steps,
        run.state.step,
        flops,
        device_peak_flops(device, cfg.parallel.peak_tflops),
        world,
        config=asdict(cfg),
        sets=run.loader.names if cfg.data.mixture else None,
    )
    profiler = StepProfiler(cfg.metrics, run_dir, rank, device)
    profiler.after_step(run.state.step)  # a profile that starts at the first step
    return metrics, profiler
