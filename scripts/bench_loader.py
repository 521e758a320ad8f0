"""Shard read throughput of the trainer's own loader, on CPU, against what one GPU consumes.

    python scripts/bench_loader.py --preset libero-5b                       # 0 and 1 worker, warm and cold
    python scripts/bench_loader.py --preset droid-14b --workers 0 1 2 4 --batches 16
    python scripts/bench_loader.py --preset libero-5b --shards s3://bucket/bench   # ranged reads from object storage

1. Synthetic shards of the preset's exact sample shapes (devtools/synthetic.py, the project's writer).
2. `train.data.ShardLoader` on the CPU device, as a rank of `train/main.py` builds it (the preset's data settings,
   the shard index, pread at member offsets, zstd/npy decoding, q01/q99 normalisation, the text table, compact text,
   DataLoader worker processes and their shared-memory hand-off), consumed as fast as it delivers.
3. For each worker count: the rate over `--batches` micro-batches after one untimed batch per worker, with the shard
   files' page cache kept (warm: the files were just written) and dropped first (cold: posix_fadvise DONTNEED, so the
   reads go to the disk). With an object-store URL as --shards (written locally and uploaded, unless it holds a
   manifest) every sample is one ranged GET; the page cache does not apply, so each count is measured once
   (cache "remote").

Per-worker rate = samples/s / workers (0 workers = the rank's own process, which the trainer never uses, but which
shows the cost of one sample without the hand-off). The ratio divides it by `--gpu-samples-per-s`, by default the
preset's measured or target training rate per GPU (configs/<preset>.yaml, throughput); DESIGN.md asks >= 10 per worker.
Prints one JSON line per measurement, then one summary line.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe import configs
from wampipe.configs.cli import cli, refuse
from wampipe.errors import entry_point
from devtools.bench import emit, provenance, write_shards
from wampipe.preprocess.remote import remote_url
from wampipe.shardformat.layout import MANIFEST
from wampipe.shardformat.storage import ShardStore, sync_up
from wampipe.train.builder import model_config
from wampipe.train.config import parse_args as parse_trainer_args
from wampipe.train.data import ShardLoader

# samples/s per GPU the loader has to feed: each recipe's measured or target training rate
GPU_RATE = {name: configs.recipe(name)["throughput"]["gpu_samples_per_s"] for name in configs.names()}


@dataclass
class Args:
    preset: Literal[tuple(sorted(GPU_RATE))] = "libero-5b"  # type: ignore[valid-type]
    """Trainer preset (train/config.py) and synthetic sample shapes."""
    micro_batch: int = 8
    """Samples per batch (the 5B's fastest trainer setting)."""
    workers: tuple[int, ...] = (0, 1)
    """DataLoader worker counts to measure (0 = load in the consuming process)."""
    batches: int = 12
    """Timed batches per measurement."""
    windows: int = 256
    """Synthetic windows to write (batches past them start a new epoch over the same files)."""
    cache: Literal["warm", "cold", "both"] = "both"
    """Page cache of the shard files: kept, dropped before each measurement, or both (local shards only)."""
    gpu_samples_per_s: float | None = None
    """What one GPU consumes, for the ratio (None: the preset's figure in GPU_RATE)."""
    shards: str | None = None
    """Shard directory or URL (s3://bucket/prefix) to reuse if it holds a manifest (written there otherwise; a URL:
    written under the work directory, then uploaded)."""
    out: Path | None = None
    """Work directory (shards, result.json); None: a temporary one, deleted."""


def parse_args(argv: list[str] | None = None) -> Args:
    args = cli(Args, args=argv, description=__doc__)
    if args.batches < 1 or args.micro_batch < 1 or args.windows < args.micro_batch or min(args.workers) < 0:
        refuse("--batches and --micro-batch must be >= 1, --windows >= --micro-batch, --workers >= 0")
    return args


def drop_page_cache(shards: Path) -> None:
    """Evict the shard directory's files from the page cache (clean pages; no root needed)."""
    for path in shards.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def batch_bytes(batch: dict) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def measure(cfg, model, workers: int, batches: int, cache: str) -> dict:
    cfg.data.num_workers = workers
    if cache == "cold":
        drop_page_cache(Path(cfg.data.shards))
    loader = ShardLoader(cfg.data, model, rank=0, world_size=1, device=torch.device("cpu"))
    it = iter(loader)
    for _ in range(max(1, workers)):  # each worker's first batch: process start, index and text table opened
        next(it)
    t0 = time.perf_counter()
    nbytes = sum(batch_bytes(next(it)) for _ in range(batches))
    dt = time.perf_counter() - t0
    del it  # stops the worker processes
    samples = batches * cfg.data.micro()
    rate = samples / dt
    return {
        "workers": workers,
        "cache": cache,
        "samples": samples,
        "seconds": float(f"{dt:.6g}"),
        "samples_per_s": round(rate, 2),
        "samples_per_s_per_worker": round(rate / max(1, workers), 2),
        "ms_per_sample": round(1000 * dt / samples, 3),
        "batch_mib_per_s": round(nbytes / dt / 2**20, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_loader-")) if args.out is None else args.out
    work.mkdir(parents=True, exist_ok=True)
    shards = args.shards or str(work / "shards")
    url = remote_url(shards)
    gpu_rate = args.gpu_samples_per_s or GPU_RATE[args.preset]
    try:
        cfg = parse_trainer_args(
            ["--preset", args.preset, "--data.shards", shards, "--data.micro-batch-size", str(args.micro_batch)]
        )
        if url is None:
            write_shards(cfg, args.preset, Path(shards), args.windows)
        elif not ShardStore(url).exists(MANIFEST):
            write_shards(cfg, args.preset, work / "shards", args.windows)
            sync_up(work / "shards", url)
        model = model_config(cfg)
        runs = []
        caches = ["remote"] if url else {"warm": ["warm"], "cold": ["cold"], "both": ["warm", "cold"]}[args.cache]
        for cache in caches:
            for workers in args.workers:
                r = measure(cfg, model, workers, args.batches, cache)
                r["ratio_per_worker_to_gpu"] = round(r["samples_per_s_per_worker"] / gpu_rate, 1)
                print(json.dumps(r), flush=True)
                runs.append(r)
        manifest = ShardStore(shards).read_json(MANIFEST)
        result = {
            "bench": "loader",
            "preset": args.preset,
            "shards": "local" if url is None else url.split(":")[0],
            "micro_batch": args.micro_batch,
            "compact_text": cfg.data.compact_text,
            "gpu_samples_per_s": gpu_rate,
            "sample_kib": round(manifest["totals"]["bytes"] / manifest["totals"]["samples"] / 1024, 1),
            "min_ratio_per_worker_to_gpu": min(
                (r["ratio_per_worker_to_gpu"] for r in runs if r["workers"]), default=None
            ),
            "runs": runs,
            "cpu": f"{platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__,
            **provenance(argv),
        }
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    return emit(result, args.out)


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
