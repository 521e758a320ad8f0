"""Auto settings: the recompute mode, micro-batch, resharding, gradient reduction and its dtype, gathering, AdamW
moments and float8 linears a run leaves to `auto` take the fastest setting measured for its recipe
(configs/<name>.yaml, section throughput) that fits the GPUs, else one the memory model (train/planning/memory.py)
estimates to fit. The flags stay in train/config.py, which parses them without torch."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Literal

import torch

from wampipe import configs
from wampipe.train.planning import memory
from wampipe.train.config import AUTO, Auto, Config


@dataclass(frozen=True)
class Throughput:
    """The parts of a configuration that `auto` resolves."""

    # typed as the flags they fill (train/config.py), though a resolved one is never auto
    ac: Literal["auto", "none", "full", "selective"]
    micro: int
    reshard: bool
    ac_blocks: int | Auto = AUTO  # with them: --parallel.ac-blocks / --parallel.ac-others
    ac_others: Literal["none", "selective"] = "none"
    reduce_every: bool = False  # --parallel.reduce-every-micro-batch
    gather_once: bool = False  # --parallel.gather-once-per-step (only without resharding after forward)
    moments: Literal["auto", "fp32", "bf16"] = "fp32"  # --optim.moments
    reduce_dtype: Literal["auto", "float32", "bfloat16"] = "float32"  # --parallel.reduce-dtype

    def describe(self) -> str:
        recompute = "no recompute" if self.ac == "none" else f"{self.ac} recompute"
        if self.ac != "none" and self.ac_blocks != AUTO:
            others = "none" if self.ac_others == "none" else f"{self.ac_others} recompute"
            recompute += f" on {self.ac_blocks} blocks ({others} on the others)"
        reduce = ", gradients reduced every micro-batch" if self.reduce_every else ""
        once = ", parameters gathered once per step" if self.gather_once else ""
        moments = ", bf16 AdamW moments" if self.moments == "bf16" else ""
        bf16_reduce = ", gradients reduce-scattered in bf16" if self.reduce_dtype == "bfloat16" else ""
        return (
            f"{recompute}, micro-batch {self.micro}, {'' if self.reshard else 'no '}reshard after forward"
            f"{reduce}{once}{moments}{bf16_reduce}"
        )


@dataclass(frozen=True)
class Measured:
    """A setting measured to fit (scripts/bench_train.py, docs/PERFORMANCE.md) on `min_gpus` GPUs of `min_gib`
    each with --parallel.float8 `float8` and --parallel.cpu-offload `cpu_offload`; it also fits more GPUs (less
    sharded state per GPU) and larger ones, and is taken on at most `max_gpus` (None: any number), for a setting
    whose speed depends on what crosses no link (one GPU's gathers and reductions are local copies)."""

    preset: str
    min_gpus: int
    min_gib: float
    setting: Throughput
    evidence: str
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    cpu_offload: bool = False
    max_gpus: int | None = None


def _measured(name: str, entry: dict) -> Measured:
    setting = Throughput(
        entry["ac"],
        entry["micro"],
        entry["reshard"],
        entry.get("ac_blocks", AUTO),
        entry.get("ac_others", "none"),
        entry.get("reduce_every", False),
        entry.get("gather_once", False),
        entry.get("moments", "fp32"),
        entry.get("reduce_dtype", "float32"),
    )
    return Measured(
        name,
        entry["min_gpus"],
        entry["min_gib"],
        setting,
        entry["evidence"],
        entry.get("float8", "none"),
        entry.get("cpu_offload", False),
        entry.get("max_gpus"),
    )


@functools.cache
def throughput_table() -> tuple[list[Measured], dict[str, Throughput]]:
    """Per recipe (configs/<name>.yaml, section throughput, read on first use): the measured settings, fastest first,
    and the fallback where nothing measured fits, and on CPU: the preset's batch recipe with full recompute, the
    safest (tiny: none)."""
    tables = {name: configs.section(configs.recipe(name), "throughput", name) for name in configs.names()}
    measured = [_measured(name, entry) for name, table in tables.items() for entry in table.get("measured", [])]
    return measured, {name: Throughput(**table["recipe"]) for name, table in tables.items()}


def _fitting_micro(micro: int, global_batch: int | Auto, world_size: int) -> int:
    """The largest micro-batch <= `micro` that keeps the recipe's global batch (a whole number of micro-batches per
    rank and step); `micro` itself when none does (the trainer then says why)."""
    if global_batch == AUTO:
        return micro
    return next((m for m in range(micro, 0, -1) if global_batch % (m * world_size) == 0), micro)


def _auto_float8(
    cfg: Config, gpu_mem_gib: float | None, world_size: int, float8_missing: str | None
) -> tuple[Literal["none", "tensorwise", "rowwise"], str]:
    """--parallel.float8 auto: the float8 of the recipe's fastest measured setting for these GPUs (a float8 one is
    listed only where it measured faster than every bf16 one that fits the same GPUs), where float8 can run here
    (`float8_missing` None) and the run neither trains adapters nor offloads its state; else none. Returns it and
    what the auto line says about it."""
    if gpu_mem_gib is None or cfg.lora.rank or cfg.parallel.cpu_offload:
        return "none", ""
    measured, _ = throughput_table()
    fastest = next(
        (
            m
            for m in measured
            if m.preset == cfg.preset
            and m.min_gpus <= world_size <= (m.max_gpus or world_size)
            and gpu_mem_gib >= m.min_gib
            and not m.cpu_offload
        ),
        None,
    )
    if fastest is None or fastest.float8 == "none":
        return "none", ""
    if float8_missing:
        return "none", f", bf16 linears (the faster float8 setting measured here {float8_missing})"
    return fastest.float8, f", float8 {fastest.float8} linears"


def resolve_auto(
    cfg: Config,
    gpu_mem_gib: float | None,
    world_size: int,
    float8_missing: str | None = "needs a CUDA GPU of compute capability >= 8.9",
) -> tuple[Config, str | None]:
    """A copy of `cfg` whose auto parts (--parallel.activation-checkpoint auto, --data.micro-batch-size auto, auto
    --parallel.[no-]reshard-after-forward, --parallel.[no-]reduce-every-micro-batch and
    --parallel.[no-]gather-once-per-step) take the fastest measured
    setting for the preset that fits `world_size` GPUs of `gpu_mem_gib` each, else the preset's recipe entry (None =
    CPU: the recipe). Settings measured with the run's --parallel.float8 come first, then the bf16 ones (float8 did
    not take more memory where both were measured). The recompute mode brings its entry's --parallel.ac-blocks and
    --parallel.ac-others unless those are given. Given parts are kept. Returns the copy and one line saying what was
    chosen and why (None when nothing was auto). With --parallel.cpu-offload the gradients are reduced every
    micro-batch unless that is given. An auto --parallel.[no-]float8-all-gather is on with several GPUs, off on one.
    --parallel.float8 auto is resolved first (`_auto_float8`; `float8_missing`: why float8 cannot run here, None
    where it can)."""
    float8 = ""
    if cfg.parallel.float8 == "auto":
        cfg = copy.deepcopy(cfg)
        cfg.parallel.float8, float8 = _auto_float8(cfg, gpu_mem_gib, world_size, float8_missing)
    gather8 = ""
    if cfg.parallel.float8_all_gather is None:  # on one GPU no bytes cross a link: the eager casts would only cost
        cfg = copy.deepcopy(cfg)
        cfg.parallel.float8_all_gather = world_size > 1
        if cfg.parallel.float8 == "tensorwise":
            gather8 = (
                f", the float8 linears' weights gathered in {'float8' if cfg.parallel.float8_all_gather else 'bf16'}"
            )
    p, d = cfg.parallel, cfg.data
    auto = {
        "ac": p.activation_checkpoint == "auto",
        "micro": d.micro_batch_size == AUTO,
        "reshard": p.reshard_after_forward is None,
        "reduce": p.reduce_every_micro_batch is None,
        "once": p.gather_once_per_step is None,
    }
    moments = cfg.optim.moments
    if not any(auto.values()):  # --optim.moments auto stays fp32
        return cfg, f"auto settings for {cfg.preset}: {float8.removeprefix(', ')}" if float8 else None
    measured, recipes = throughput_table()
    # a setting measured with fp32 moments fits bf16 ones too; one measured with bf16 moments needs them
    on_gpus = [
        m
        for m in measured
        if m.preset == cfg.preset
        and gpu_mem_gib is not None
        and m.min_gpus <= world_size <= (m.max_gpus or world_size)
        and gpu_mem_gib >= m.min_gib
        and m.float8 in (p.float8, "none")
        and moments in ("auto", m.setting.moments, "bf16" if m.setting.moments == "fp32" else "")
    ]
    # an offloaded setting fits only offloaded runs; an offloaded run fits any, its own kind first
    size = functools.cache(lambda: memory.run_size(cfg))  # a meta-device build of the DiT: once, and only if needed
    # on_gpus is empty without a GPU size, so the first test drops nothing: it tells the type checker
    fits = [
        m
        for m in on_gpus
        if gpu_mem_gib is not None
        and m.cpu_offload == p.cpu_offload
        and (
            m.setting.moments == "fp32"
            or moments == "bf16"
            or not memory.fits_fp32_moments(size(), cfg, m.setting, gpu_mem_gib, world_size)
        )
    ]
    # an offloaded run takes only settings measured offloaded: the others' small micro-batches each copy every
    # gradient to host memory (32 a step for libero-5b's one-H200 entry: no step within 8 minutes); without one,
    # the memory model sizes it (largest micro-batch first)
    fits.sort(key=lambda m: m.float8 != p.float8)  # stable: fastest first of each
    chosen = fits[0].setting if fits else recipes[cfg.preset]
    gpus = f"{world_size} GPU{'s' if world_size > 1 else ''}"
    where = "CPU" if gpu_mem_gib is None else f"{gpus} of {gpu_mem_gib:.0f} GiB"
    why = (
        f"measured {fits[0].evidence}"
        if fits
        else "the preset's recipe"
        if gpu_mem_gib is None
        else "nothing measured fits these GPUs: the preset's recipe"
    )
    if not fits and gpu_mem_gib is not None and (run_size := size()) is not None:
        # sized by the memory model instead: a setting estimated to fit, or a refusal now
        chosen, estimated = memory.fitting_setting(cfg, run_size, chosen, auto, gpu_mem_gib, world_size)
        why = f"nothing measured fits these GPUs: {estimated}"
    offloaded = [m for m in on_gpus if m.cpu_offload]
    if not fits and not p.cpu_offload and offloaded and p.float8 == "none":  # never with float8
        why += f"; with --parallel.cpu-offload: measured {offloaded[0].evidence}"
    if auto["reduce"] and p.cpu_offload and not chosen.reduce_every:
        why += "; gradients reduced every micro-batch for --parallel.cpu-offload"
    out = copy.deepcopy(cfg)
    if auto["ac"]:
        out.parallel.activation_checkpoint = chosen.ac
        if (p.ac_blocks, p.ac_others) == (AUTO, "none"):  # not given
            out.parallel.ac_blocks, out.parallel.ac_others = chosen.ac_blocks, chosen.ac_others
    if auto["reduce"]:
        # host-offloaded state: an unsharded fp32 accumulation between micro-batches would sit on the GPU instead
        out.parallel.reduce_every_micro_batch = chosen.reduce_every or p.cpu_offload
    if auto["reshard"]:
        out.parallel.reshard_after_forward = chosen.reshard
    if auto["once"]:  # kept gathered through the step only where nothing reshards them after forward
        out.parallel.gather_once_per_step = chosen.gather_once and out.parallel.reshard_after_forward is False
    if auto["micro"]:
        out.data.micro_batch_size = _fitting_micro(chosen.micro, p.global_batch_size, world_size)
    if moments == "auto":
        out.optim.moments = chosen.moments
    if p.reduce_dtype == "auto":
        out.parallel.reduce_dtype = chosen.reduce_dtype
    # only described; the three switches are bools by now (resolved above or given), as bool() tells the checker
    result = Throughput(
        out.parallel.activation_checkpoint,
        out.data.micro(),
        bool(out.parallel.reshard_after_forward),
        out.parallel.ac_blocks,
        out.parallel.ac_others,
        bool(out.parallel.reduce_every_micro_batch),
        bool(out.parallel.gather_once_per_step),
        out.optim.moments,
        out.parallel.reduce_dtype,
    )
    given = [
        {
            "ac": "recompute",
            "micro": "micro-batch",
            "reshard": "resharding",
            "reduce": "gradient reduction",
            "once": "gathering",
        }[k]
        for k, a in auto.items()
        if not a
    ]
    batch = "" if p.global_batch_size == AUTO else f", global batch {p.global_batch_size}"
    return out, (
        f"auto settings for {cfg.preset} on {where}: {result.describe()}{float8}{gather8}{batch} ({why})"
        + (f"; given: {', '.join(given)}" if given else "")
    )


def device_memory_gib(device: torch.device) -> float | None:
    """Total memory of a CUDA device in GiB (what resolve_auto sizes by); None for any other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 2**30
