"""The farm stage end to end against its bound: the real `preprocess shards` unit stage with full-size encoders, and
the same encoders alone on the same device, measured in one run. One JSON line per recipe.

    python scripts/bench_farm.py --device cuda                          # 5B LIBERO, 5B DROID, 14B DROID
    python scripts/bench_farm.py --device cuda --recipes libero-5b --episodes 176
    python scripts/bench_farm.py --device cpu --size tiny --episodes 4 --recipes libero-5b   # smoke run

1. A generated LeRobot dataset of the recipe's layout (scripts/make_sample_dataset.py) and random-init encoders at
   their released widths in the official on-disk formats (scripts/make_tiny_checkpoints.py --size full).
2. `preprocess shards --stage units` on them, in this process (the streaming executor: CPU workers decode, window
   and transform; one encoder process per device). Samples/s over the whole call, encoder loading included.
3. The bound: the same `Encoders` (VAE, CLIP, the 14B's y) on the same device, on random videos of the recipe's
   shape, in batches of --batch-size, with nothing else running: before the build and after it (a GPU that has
   run for minutes runs hotter and slower), the higher of the two.

Reported: samples/s per device over the whole call and in the steady state (every sample over the call from the
start of the GPUs' sustained work on: the call without its start, reported as start_s;
GPU runs only), each against the bound, device busy % (nvidia-smi's utilization of the encoders' GPUs, sampled every
0.2 s over the run), CPU cores used per device (CPU time of this process and its children / wall time), bytes per
sample in the unit spills (what the shards will hold).
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe import configs
from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from devtools.sample_data import write_sample_dataset
from devtools.tiny_checkpoints import write_tiny_checkpoints
from wampipe.preprocess.shards import DATASETS
from wampipe.shardformat.layout import WORK_DIR

if TYPE_CHECKING:
    from wampipe.preprocess.spec import BuildSpec

# the recipes whose preprocess section names a model (configs/<name>.yaml): name -> (dataset, model, sample layout)
RECIPES = {
    name: (pre["dataset"], pre["model"], DATASETS[pre["dataset"]].sample_layout)
    for name in configs.names()
    if "model" in (pre := configs.section(configs.recipe(name), "preprocess", name))
}


def encoder_gpus(device: str) -> list[str]:
    """nvidia-smi's ids of the GPUs the encoders run on: every visible one for `cuda`, the N-th visible one for
    `cuda:N` (CUDA_VISIBLE_DEVICES maps visible indices to physical ids or UUIDs, which nvidia-smi -i takes too)."""
    if not device.startswith("cuda"):
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [v.strip() for v in visible.split(",") if v.strip()]
        if visible
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    return ids if device == "cuda" else [ids[torch.device(device).index or 0]]


class BusySampler:
    """utilization.gpu of the GPUs `ids` (nvidia-smi every 0.2 s); no samples without nvidia-smi or GPUs."""

    def __init__(self, ids: list[str], period_s: float = 0.2):
        self.ids, self.period_s, self.samples, self.times = ids, period_s, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.ids and not self._stop.wait(self.period_s):
            try:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "-i",
                        ",".join(self.ids),
                        "--query-gpu=utilization.gpu",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout.split()
                self.samples.append([float(v) for v in out])
                self.times.append(time.time())
            except (OSError, subprocess.SubprocessError, ValueError):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def steady_start(
        self, busy_pct: float = 70.0, hold_s: float = 10.0, idle_pct: float = 10.0, idle_s: float = 2.0
    ) -> float | None:
        """Epoch time at which the steady state begins: the GPUs' first sustained work (`hold_s` seconds at least
        `busy_pct` busy on average) counted back to the end of the idle stretch before it (`idle_s` seconds with
        every sample under `idle_pct`). So the blips before it stay out (CUDA start-up, weight loading, the compiled
        VAE's warm-up passes on black clips, up to 6 s at ~50 % on a busy 4-GPU node), and the ramp into it stays
        in."""
        rows = [(sum(r) / len(r), t) for r, t in zip(self.samples, self.times) if len(r) == len(self.ids)]
        sustained = None
        for i, (_, start) in enumerate(rows):
            held = [pct for pct, _ in itertools.takewhile(lambda row: row[1] <= start + hold_s, rows[i:])]
            if sum(held) / len(held) >= busy_pct:
                sustained = i
                break
        if sustained is None:
            return None
        begin, quiet_since = 0, None
        for i, (pct, t) in enumerate(rows):
            if pct >= idle_pct:
                if quiet_since is not None and t - quiet_since >= idle_s:
                    begin = i
                quiet_since = None
                if i >= sustained:
                    break
            elif quiet_since is None:
                quiet_since = t
        return rows[begin][1]

    def mean_pct(self, start: float = 0.0, end: float = float("inf")) -> float | None:
        """Mean busy % of the GPUs over the samples taken between `start` and `end` (epoch s)."""
        rows = [r for r, t in zip(self.samples, self.times) if len(r) == len(self.ids) and start <= t <= end]
        return sum(map(sum, rows)) / (len(rows) * len(self.ids)) if rows else None


def cpu_seconds() -> float:
    return sum(
        getattr(resource.getrusage(who), f)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for f in ("ru_utime", "ru_stime")
    )


def encoder_bound(cli, iters: int, warmup: int = 2) -> float:
    """Samples/s of the run's encoders alone (its weights, device and dtype) on random videos of the recipe's shape,
    in batches of the run's batch size, run as the streaming encoder runs them: each batch launched before the
    previous one's codes are taken. The batch is prepared (CLIP's resize, the copy to the device) once: the stream
    prepares on a side thread and stream while the device encodes."""
    from wampipe.preprocess.pipeline import Encoders, stack_clips
    from wampipe.shardformat.embodiments import get_embodiment

    device = "cuda:0" if cli.device == "cuda" else cli.device
    emb = get_embodiment(DATASETS[cli.dataset].embodiment)
    # a stand-in for the run's BuildSpec: the fields Encoders reads, resolved as preprocess shards resolves them
    spec = SimpleNamespace(
        vae=str(cli.vae),
        image_encoder=str(cli.image_encoder),
        model=cli.model,
        embodiment=emb.tag,
        device=device,
        dtype=cli.dtype,
        image_features=cli.image_features,
        vae_compile=cli.vae_compile == "on",
        batch_size=cli.batch_size,
        compile_cache=str(cli.compile_cache or ""),
    )
    encoders = Encoders(cast("BuildSpec", spec))
    (h, w), t = emb.preset(cli.model).target_hw, emb.window.num_frames
    # the batch as a worker sends it (the workers stack and cast in the farm: not part of the encoders' time)
    batch = stack_clips(list(torch.rand(cli.batch_size, 3, t, h, w) * 2 - 1), encoders.dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.inference_mode():
        inputs = encoders.prepare(batch)
        for _ in range(warmup):
            encoders.run(inputs)
        sync()
        start = time.perf_counter()
        pending = encoders.launch(inputs)
        for _ in range(iters - 1):
            launched = encoders.launch(inputs)
            encoders.finish(pending)
            pending = launched
        encoders.finish(pending)
    return iters * cli.batch_size / (time.perf_counter() - start)


def bound_in_a_process(cli, cache: Path, iters: int) -> float:
    """The bound on the idle device before the build (right after a long build a GPU may run hotter and its clocks
    lower): in a process of its own, which gives its GPU memory back before the build starts, and with a compile
    cache of its own, so the build's encoders still compile from a cold cache."""
    from wampipe.preprocess import shards

    alone = replace(cli, compile_cache=cache)
    shards.check_arguments(alone)
    shards.prepare_defaults(alone)
    with ProcessPoolExecutor(1, mp_context=torch.multiprocessing.get_context("spawn")) as pool:
        return pool.submit(encoder_bound, alone, iters).result()


def bench_recipe(recipe: str, work: Path, weights: Path, args) -> dict:
    from wampipe.preprocess import shards

    dataset, model, layout = RECIPES[recipe]
    src = work / f"data-{layout}"
    if not (src / "meta" / "info.json").is_file():
        write_sample_dataset(src, layout, args.episodes, seed=0, workers=max(1, (os.cpu_count() or 2) // 2))
    out = work / f"shards-{recipe}"
    vae = "wan2.1" if model == "14b" else "wan2.2"
    cli = shards.Args(
        dataset=dataset,
        src=src,
        out=str(out),
        model=model,
        device=args.device,
        batch_size=args.batch_size,
        workers=args.workers,
        stage="units",
        executor=args.executor,
        anchor_stride=args.anchor_stride,
        decode_backend=args.decode_backend,
        episodes_per_unit=args.episodes_per_unit,
        image_features=args.image_features,
        vae_compile=args.vae_compile,
        vae=weights / vae / "vae",
        image_encoder=weights / "clip" / "image_encoder",
        text_encoder=weights / "umt5" / "text_encoder",
        tokenizer=weights / "umt5" / "tokenizer",
    )
    bound_before = (
        bound_in_a_process(cli, work / f"compile-cache-bound-{recipe}", args.bound_iters) if args.bound_before else None
    )
    gpus = encoder_gpus(args.device)
    devices = len(gpus) or 1  # one encoder process per GPU, or one on the CPU
    cpu0, start, start_epoch = cpu_seconds(), time.perf_counter(), time.time()
    with BusySampler(gpus) as busy:
        shards.run(cli)
    wall, end_epoch = time.perf_counter() - start, time.time()
    cores = (cpu_seconds() - cpu0) / wall
    units = sorted((out / WORK_DIR).glob("unit-*.json"))
    records = [json.loads(p.read_text()) for p in units]
    samples = sum(r["count"] for r in records)
    # a worker cuts each unit's samples into batches of the batch size, the last one short; the compiled VAE pads
    # that one to the full size, so the device encodes this many clip slots for these samples
    slots = sum(-(-r["count"] // cli.batch_size) * cli.batch_size for r in records) if cli.vae_compile == "on" else 0
    if len(records) < cli.workers:
        print(f"only {len(records)} units for {cli.workers} workers: give more --episodes", file=sys.stderr)
    spill_bytes = sum((p.with_suffix(".tar")).stat().st_size for p in units)
    # steady state: every sample over the call from the start of the GPUs' sustained work (BusySampler.steady_start)
    # to its end, i.e. the whole call without its start (hashing, weight checks, spawning, encoder loading and
    # compiling); the run's ramp and tail stay in. GPU runs only. (Unit completion times would not do: the workers'
    # units finish in waves, not evenly.)
    if args.busy_trace:
        trace = args.busy_trace
        if len(args.recipes) > 1:
            trace = trace.with_stem(f"{trace.stem}-{recipe}")
        trace.write_text(
            json.dumps(
                {"start": start_epoch, "end": end_epoch, "gpus": busy.ids, "times": busy.times, "busy": busy.samples}
            )
        )
    first = busy.steady_start()
    window = (first, end_epoch) if first is not None else None
    steady = samples / (window[1] - window[0]) / devices if window else None
    bound_after = encoder_bound(cli, args.bound_iters)
    bound = max(bound_after, bound_before or 0.0)
    rate = samples / wall / devices
    return {
        "bench": "farm",
        "recipe": recipe,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "devices": devices,
        "workers": min(cli.workers, len(records)),  # a run has at most one worker per unit
        "executor": args.executor,
        "batch_size": cli.batch_size,
        "batch_fill": round(samples / slots, 4) if slots else 1.0,  # eager batches are not padded
        "episodes": args.episodes,
        "anchor_stride": args.anchor_stride,
        "episodes_per_unit": args.episodes_per_unit,
        "image_features": args.image_features,
        "vae_compile": cli.vae_compile,
        "samples": samples,
        "wall_s": round(wall, 2),
        "samples_per_s_per_device": round(rate, 3),
        "bound_samples_per_s": round(bound, 3),
        "bound_before_samples_per_s": bound_before and round(bound_before, 3),
        "bound_after_samples_per_s": round(bound_after, 3),
        "ratio_to_bound": round(rate / bound, 4),
        "busy_pct": busy.mean_pct(),
        "steady_samples_per_s_per_device": steady and round(steady, 3),
        "steady_busy_pct": busy.mean_pct(*window) if window else None,
        "start_s": window and round(window[0] - start_epoch, 1),
        "steady_ratio_to_bound": steady and round(steady / bound, 4),
        "cpu_cores_per_device": round(cores / devices, 2),
        "bytes_per_sample": round(spill_bytes / max(1, samples)),
        "torch": torch.__version__,
    }


@dataclass
class Args:
    recipes: tuple[Literal[tuple(RECIPES)], ...] = tuple(  # type: ignore[valid-type]
        sorted(RECIPES, key=lambda r: (RECIPES[r][1] != "5b", r))
    )
    """Recipes to measure (all by default, the 14B last)."""
    device: str = "cuda"
    """Encoder device: cuda (every local GPU), cuda:N or cpu."""
    size: Literal["full", "tiny"] = "full"
    """Encoder widths (tiny: smoke runs)."""
    episodes: int = 176
    """Episodes of each generated dataset (176: two units of 8 per worker of a 16-core GPU machine, ~11 000 LIBERO
    samples; give at least workers x 2 x --episodes-per-unit)."""
    workers: int = 0
    """CPU workers (0: the default of preprocess shards, every core but three per GPU encoder)."""
    executor: Literal["stream", "local"] = "stream"
    """The --executor of preprocess shards."""
    batch_size: int | None = None
    """Windows per encoder batch (default: preprocess shards' for the device and model)."""
    decode_backend: Literal["torchcodec", "pyav"] = "torchcodec"
    """Frame decoder (pyav where torchcodec's FFmpeg libraries are missing)."""
    episodes_per_unit: int = 8
    """Episodes per work unit (preprocess shards' default). Each unit's last batch is padded to the full batch size,
    so smaller units spend more of the device on padding (reported as batch_fill)."""
    image_features: Literal["encoded", "pixels"] = "encoded"
    """The --image-features of preprocess shards (pixels: CLIP input pixels stored, CLIP not run)."""
    vae_compile: Literal["auto", "on", "off"] = "auto"
    """The --vae-compile of preprocess shards (auto: on with a GPU), also in the bound."""
    anchor_stride: int = 1
    """Keep every n-th window (fewer samples per episode)."""
    bound_iters: int = 10
    """Timed encoder batches of the bound."""
    bound_before: bool = True
    """Measure the bound before the build as well as after it (the ratios are against the higher one)."""
    busy_trace: Path | None = None
    """JSON file to write the sampled GPU utilization to (epoch times and per-GPU %); with several recipes one
    file each, the recipe's name after the stem."""
    work: Path | None = None
    """Working folder (None: a temporary one, removed)."""


def main(argv: list[str] | None = None) -> list[dict]:
    args = cli(Args, args=argv, description=__doc__)
    if args.work:
        tmp, work = None, args.work
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_farm-")
        work = Path(tmp.name)
    try:
        weights = work / f"encoders-{args.size}"
        if not (weights / "README.json").is_file():
            write_tiny_checkpoints(weights, size=args.size)
        results = []
        for recipe in args.recipes:
            results.append(bench_recipe(recipe, work, weights, args))
            print(json.dumps(results[-1]), flush=True)
        return results
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
