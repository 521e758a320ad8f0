"""Training metrics: averaged over ranks every `interval` steps, written to TensorBoard, a jsonl file and one
console line (rank 0), with a tqdm bar in between.

    step 120 | loss 0.4213 (dyn 0.3901 act 0.0312) | gnorm 0.81 | lr 1.0e-05 | 13.2 samples/s/GPU | MFU 41.3% |
    data 0.4% | mem 61.2 GiB
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from train.config import MetricsConfig

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H20": 148.0, "A100": 312.0, "B200": 2250.0}  # dense bf16


def device_peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """Peak dense bf16 FLOP/s of one device, or None where unknown (CPU)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key] * 1e12
    return None


class MetricsLogger:
    """Accumulates per-step values between logs; `log()` is collective (an all-reduce of the sums)."""

    def __init__(self, cfg: MetricsConfig, run_dir: Path, rank: int, device: torch.device, total_steps: int,
                 start_step: int, flops_per_sample: float, peak_flops: float | None, world_size: int):
        self.cfg, self.rank, self.device, self.world_size = cfg, rank, device, world_size
        self.flops_per_sample, self.peak_flops = flops_per_sample, peak_flops
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.samples = 0
        self.t0 = time.perf_counter()
        self.wait0 = 0.0
        self.jsonl = self.tb = self.bar = None
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(run_dir / "metrics.jsonl", "a")
            if cfg.tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                    self.tb = SummaryWriter(str(run_dir / "tb"))
                except ImportError:  # tensorboard is a dependency, but a bare environment may lack it
                    print("tensorboard not installed: metrics go to metrics.jsonl and the console only")
            if cfg.progress:
                from tqdm import tqdm
                self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def step(self, terms: dict[str, torch.Tensor], samples: int) -> None:
        """Per optimizer step: detached scalar terms (device tensors, no sync) and this rank's sample count."""
        for k, v in terms.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v.clone()
        self.count += 1
        self.samples += samples
        if self.bar is not None:
            self.bar.update(1)

    def log(self, step: int, lr: float, data_wait_s: float) -> dict:
        names = sorted(self.sums)
        vec = torch.stack([self.sums[k] for k in names]).to(self.device) / max(1, self.count)
        dist.all_reduce(vec)
        vec = (vec / self.world_size).tolist()
        elapsed = time.perf_counter() - self.t0
        wait = data_wait_s - self.wait0
        per_gpu = self.samples / elapsed
        record = {"step": step, **dict(zip(names, vec)), "lr": lr, "samples_per_s_per_gpu": per_gpu,
                  "data_wait_pct": 100 * wait / elapsed, "time": time.time()}
        if self.peak_flops:
            record["mfu_pct"] = 100 * per_gpu * self.flops_per_sample / self.peak_flops
        if self.device.type == "cuda":
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.rank == 0:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
            if self.tb is not None:
                for k, v in record.items():
                    if k not in ("step", "time"):
                        self.tb.add_scalar(k, v, step)
            line = format_line(record)
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)
        self.sums, self.count, self.samples = {}, 0, 0
        self.t0, self.wait0 = time.perf_counter(), data_wait_s
        return record

    def close(self) -> None:
        for h in (self.bar, self.tb, self.jsonl):
            if h is not None:
                h.close()


def format_line(r: dict) -> str:
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f} (dyn {r['loss_dynamics']:.4f} act {r['loss_action']:.4f})",
             f"gnorm {r['grad_norm']:.3g}", f"lr {r['lr']:.2e}", f"{r['samples_per_s_per_gpu']:.2f} samples/s/GPU"]
    if "mfu_pct" in r:
        parts.append(f"MFU {r['mfu_pct']:.1f}%")
    parts.append(f"data {r['data_wait_pct']:.1f}%")
    if "peak_mem_gib" in r:
        parts.append(f"mem {r['peak_mem_gib']:.1f} GiB")
    return " | ".join(parts)


class StepProfiler:
    """torch.profiler over steps (profile_start, profile_start + profile_steps]; rank 0 writes the top ops by
    device time to profile-rank0.txt (and prints them) and a gzipped Chrome trace beside it."""

    def __init__(self, cfg: MetricsConfig, run_dir: Path, rank: int, device: torch.device):
        self.cfg, self.run_dir, self.rank, self.device = cfg, run_dir, rank, device
        self.prof = None

    def after_step(self, step: int) -> None:
        cfg = self.cfg
        if cfg.profile_steps <= 0:
            return
        if step == cfg.profile_start and self.prof is None:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=activities)
            self.prof.__enter__()
        elif step == cfg.profile_start + cfg.profile_steps and self.prof is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.prof.__exit__(None, None, None)
            if self.rank == 0:
                self._write()
            self.prof = None

    def _write(self) -> None:
        sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
        (self.run_dir / "profile-rank0.txt").write_text(table + "\n")
        print(f"profile of {self.cfg.profile_steps} steps after step {self.cfg.profile_start}:\n{table}", flush=True)
        self.prof.export_chrome_trace(str(self.run_dir / "trace-rank0.json.gz"))  # gzipped by the ".gz" suffix
