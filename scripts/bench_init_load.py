"""Sharded `--model.init-from` at full size: load time and peak host memory of every rank.

    python scripts/bench_init_load.py --preset droid-14b --nproc 4 --dir /scratch/bench-init   # 4 GPUs, NCCL
    python scripts/bench_init_load.py --preset tiny --nproc 2 --dir /tmp/bench-init      # CPU smoke run, gloo

1. Unless DIR/base-<preset>-<layers>L holds one already: random weights in the official layout, written by
   devtools/tiny_base.py (the DiT in bf16 under `action_head.model.`, 5 GB files + index; 33 GB for the 14B).
2. `torchrun --nproc-per-node N` of this script's worker: every rank builds the DiT as the trainer does
   (`train.builder.sharded_model`: meta device, FSDP2, materialized on its device, then `load_weights` reads only the
   rows of its own shards from the memory-mapped files), while a thread samples its RSS every 10 ms.
3. One JSON line (also DIR/result.json): per rank the build+load seconds, peak RSS (VmHWM: anonymous memory plus
   the file pages it mapped), peak anonymous RSS (sampled RssAnon: memory the rank itself holds) and device memory;
   beside it the fp32 size of the full model, which every rank held with the former load path
   (`--init-device cpu` measures that path for comparison: full model built on every rank's host, then sharded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe.configs.cli import cli
from wampipe.errors import entry_point

GIB = 1 << 30


@dataclass
class Args:
    preset: Literal["tiny", "libero-5b", "droid-5b", "droid-14b"] = "droid-14b"
    """DiT preset of train/dit/model.py."""
    nproc: int = 1
    """Ranks (one per GPU with CUDA)."""
    dir: Path = Path("build/bench-init-load")
    """Work folder: the base checkpoint (kept for later runs) and result.json."""
    num_layers: int = 0
    """Override the preset's block count (0 = the preset's)."""
    init_device: Literal["meta", "cpu"] = "meta"
    """meta: build on the meta device, shard, load each rank's rows; cpu: the full model on every host first."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process group backend; auto = nccl with CUDA, else gloo."""
    worker: bool = False
    """Internal: run as one torchrun rank."""


def base_dir(args: Args) -> Path:
    return args.dir / f"base-{args.preset}-{args.num_layers or 'all'}L"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class RssSampler(threading.Thread):
    """Largest RssAnon seen, sampled every 10 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_kib, self.stopped = 0, threading.Event()

    def run(self):
        while not self.stopped.is_set():
            self.peak_kib = max(self.peak_kib, _status_kib("RssAnon"))
            self.stopped.wait(0.01)

    def stop(self) -> float:
        self.stopped.set()
        self.join()
        return max(self.peak_kib, _status_kib("RssAnon")) / (1 << 20)


def worker(args: Args) -> None:
    import torch.distributed as dist

    from wampipe.train.config import Config, ModelConfig, ParallelConfig
    from wampipe.train.builder import sharded_model
    from wampipe.train.dit.model import preset

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available() and args.backend != "gloo"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo")
    dist.init_process_group(backend, device_id=device if cuda else None)
    model_cfg = preset(args.preset)
    if args.num_layers:
        model_cfg = replace(model_cfg, num_layers=args.num_layers)
    cfg = Config(
        model=ModelConfig(name=args.preset, init_from=base_dir(args), init_device=args.init_device),
        parallel=ParallelConfig(backend=backend),
    )
    rss_before = _status_kib("VmRSS") / (1 << 20)
    sampler = RssSampler()
    sampler.start()
    dist.barrier()
    start = time.perf_counter()
    model = sharded_model(model_cfg, cfg, device)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak_anon = sampler.stop()
    mine = {
        "rank": rank,
        "build_load_s": round(seconds, 3),
        "rss_before_gib": round(rss_before, 3),
        "peak_rss_gib": round(_status_kib("VmHWM") / (1 << 20), 3),
        "peak_anon_rss_gib": round(peak_anon, 3),
        "device_mem_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 3) if cuda else None,
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        numel = sum(p.numel() for p in model.parameters())
        result = {
            "preset": args.preset,
            "num_layers": model_cfg.num_layers,
            "world_size": len(ranks),
            "init_device": args.init_device,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "backend": backend,
            "params": numel,
            "full_model_fp32_gib": round(numel * 4 / GIB, 3),
            "checkpoint_gib": round(sum(f.stat().st_size for f in base_dir(args).glob("*.safetensors")) / GIB, 3),
            "ranks": ranks,
        }
        (args.dir / "result.json").write_text(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main(args: Args) -> None:
    args.dir.mkdir(parents=True, exist_ok=True)
    base = base_dir(args)
    write_s = None
    if not (base / "config.json").is_file():
        from devtools import tiny_base  # here, not at the top: the ranks' measured RSS holds only what they import

        start = time.perf_counter()
        tiny_base.write_base(tiny_base.Args(out=base, preset=args.preset, num_layers=args.num_layers))
        write_s = round(time.perf_counter() - start, 1)
    (args.dir / "result.json").unlink(missing_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            str(Path(__file__).resolve()),
            "--worker",
            "--preset",
            args.preset,
            "--dir",
            str(args.dir),
            "--num-layers",
            str(args.num_layers),
            "--init-device",
            args.init_device,
            "--backend",
            args.backend,
        ],
        check=True,
    )
    result = json.loads((args.dir / "result.json").read_text())
    result["base_write_s"] = write_s
    (args.dir / "result.json").write_text(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        parsed = cli(Args, description=__doc__)
        worker(parsed) if parsed.worker else main(parsed)
