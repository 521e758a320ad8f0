"""Training metrics: averaged over ranks every `interval` steps, written to TensorBoard, a jsonl file, one console
line and, with --metrics.wandb-project, Weights & Biases (rank 0), with a tqdm bar in between.

    step 120 | loss 0.4213 (dyn 0.3901 act 0.0312) | gnorm 0.81 | lr 1.0e-05 | 13.2 samples/s/GPU | MFU 41.3% |
    data 0.4% | mem 61.2 GiB

A mixture's run also logs, per set, the loss terms averaged over its micro-batches on all ranks (`loss/<set>`,
`loss_dynamics/<set>`, `loss_action/<set>`) and the samples taken from it since the run began (`samples_seen/<set>`).
"""

from __future__ import annotations

import gzip
import heapq
import json
from collections import defaultdict
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from wampipe.errors import UsageError
from wampipe.train.config import AUTO, Auto, MetricsConfig

if TYPE_CHECKING:
    from torch.profiler import profile

SET_TERMS = ("loss", "loss_dynamics", "loss_action")  # logged per set of a mixture
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H20": 148.0, "A100": 312.0, "B200": 2250.0}  # dense bf16


def device_peak_flops(device: torch.device, given_tflops: float | Auto = AUTO) -> float | None:
    """Peak dense bf16 FLOP/s of one device (`given_tflops`, else detected), or None where unknown (CPU)."""
    if given_tflops != AUTO:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key] * 1e12
    return None


def check_wandb(cfg: MetricsConfig) -> None:
    """Refuse --metrics.wandb-project in one line where wandb is not installed."""
    if cfg.wandb_project is None:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UsageError("--metrics.wandb-project needs wandb: pip install 'wampipe[wandb]'") from None


def start_wandb(cfg: MetricsConfig, run_dir: Path, config: dict | None):
    """A W&B run named after the run directory, holding the run's config; files under $WANDB_DIR, else the run
    directory."""
    import wandb

    return wandb.init(
        project=cfg.wandb_project,
        name=run_dir.resolve().name,
        mode=cfg.wandb_mode,
        dir=os.environ.get("WANDB_DIR", run_dir),
        config=json.loads(json.dumps(config, default=str)),
    )


class MetricsLogger:
    """Accumulates per-step values between logs; `log()` is collective (an all-reduce of the sums).

    A run that starts at `start_step` (resumed, or fresh) first drops the rows of later steps that an earlier run in
    the same directory logged (metrics.jsonl rewritten; TensorBoard's purge_step), so every step has one row. The
    run's `config` goes to TensorBoard as text and to W&B as the run's config. `sets`: the names of a mixture's sets,
    whose terms are logged each."""

    def __init__(
        self,
        cfg: MetricsConfig,
        run_dir: Path,
        rank: int,
        device: torch.device,
        total_steps: int,
        start_step: int,
        flops_per_sample: float,
        peak_flops: float | None,
        world_size: int,
        config: dict | None = None,
        sets: Sequence[str] | None = None,
    ):
        self.cfg, self.rank, self.device, self.world_size = cfg, rank, device, world_size
        self.flops_per_sample, self.peak_flops = flops_per_sample, peak_flops
        self.sets = list(sets or [])
        self.set_sums = torch.zeros(len(self.sets), len(SET_TERMS) + 1, device=device)  # terms + micro-batches
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.samples = 0
        self.t0 = time.perf_counter()
        self.wait0 = 0.0
        self.retries0 = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0
        self.jsonl = self.tb = self.bar = self.wandb = None
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            drop_rows_after(run_dir / "metrics.jsonl", start_step)
            self.jsonl = open(run_dir / "metrics.jsonl", "a")
            if cfg.tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1)
                except ImportError:  # an optional dependency (the plot extra)
                    print(
                        "tensorboard not installed: metrics go to metrics.jsonl and the console only "
                        "(pip install 'wampipe[plot]')"
                    )
                if self.tb is not None and config is not None:
                    self.tb.add_text(
                        "config", "```json\n" + json.dumps(config, indent=1, default=str) + "\n```", start_step
                    )
            if cfg.wandb_project is not None:
                self.wandb = start_wandb(cfg, run_dir, config)
            if cfg.progress:
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def step(
        self, terms: dict[str, torch.Tensor], samples: int, per_set: Sequence[tuple[int, dict[str, torch.Tensor]]] = ()
    ) -> None:
        """Per optimizer step: detached scalar terms (device tensors, no sync), this rank's sample count and, in a
        mixture, (set, loss terms) of each micro-batch."""
        for s, micro in per_set if self.sets else ():
            self.set_sums[s] += torch.stack(
                [*(micro[k].detach().float() for k in SET_TERMS), torch.ones((), device=self.device)]
            ).to(self.device)
        for k, v in terms.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v.clone()
        self.count += 1
        self.samples += samples
        if self.bar is not None:
            self.bar.update(1)

    def log(
        self,
        step: int,
        lr: float,
        data_wait_s: float,
        samples_seen: np.ndarray | None = None,
        extra: dict | None = None,
    ) -> dict:
        """Collective. `samples_seen`: this rank's samples of each set of a mixture since the run began; `extra`:
        more fields of this step (the validation loss, train/validate.py)."""
        names = sorted(self.sums)
        vec = torch.stack([self.sums[k] for k in names]).to(self.device) / max(1, self.count)
        dist.all_reduce(vec)
        vec = (vec / self.world_size).tolist()
        per_set = self._per_set(samples_seen) if self.sets else {}
        elapsed = time.perf_counter() - self.t0
        wait = data_wait_s - self.wait0
        per_gpu = self.samples / elapsed
        record = {
            "step": step,
            **dict(zip(names, vec)),
            "lr": lr,
            "samples_per_s_per_gpu": per_gpu,
            "data_wait_pct": 100 * wait / elapsed,
            **per_set,
            **(extra or {}),
            "time": time.time(),
        }
        if self.peak_flops:
            record["mfu_pct"] = 100 * per_gpu * self.flops_per_sample / self.peak_flops
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            record["peak_mem_gib"] = stats["allocated_bytes.all.peak"] / 2**30
            record["peak_reserved_gib"] = stats["reserved_bytes.all.peak"] / 2**30
            # the allocator found no free block, emptied its cache and tried again: the run is at its memory ceiling
            record["alloc_retries"] = stats["num_alloc_retries"] - self.retries0
            self.retries0 = stats["num_alloc_retries"]
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.rank == 0:
            assert self.jsonl is not None  # rank 0 opens it
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
            if self.tb is not None:
                for k, v in record.items():
                    if k not in ("step", "time"):
                        self.tb.add_scalar(k, v, step)
            if self.wandb is not None:
                self.wandb.log(record, step=step)
            line = format_line(record)
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)
        self.sums, self.count, self.samples = {}, 0, 0
        self.set_sums.zero_()
        self.t0, self.wait0 = time.perf_counter(), data_wait_s
        return record

    def record(self, row: dict) -> None:
        """A row of values computed elsewhere (already reduced over ranks): rank 0 writes it like `log`'s."""
        if self.rank == 0:
            assert self.jsonl is not None  # rank 0 opens it
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
            for k, v in row.items():
                if self.tb is not None and k != "step" and v is not None:
                    self.tb.add_scalar(k, v, row["step"])
            print(
                " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True
            )

    def _per_set(self, samples_seen: np.ndarray | None) -> dict:
        """Collective: each set's loss terms averaged over its micro-batches on all ranks since the last log (absent
        for a set none drew), and its samples on all ranks since the run began."""
        seen = torch.as_tensor(
            np.zeros(len(self.sets)) if samples_seen is None else samples_seen, dtype=torch.float64
        ).to(self.device)
        sums = self.set_sums.clone()
        dist.all_reduce(sums)
        dist.all_reduce(seen)
        out = {}
        for name, row, total in zip(self.sets, sums.tolist(), seen.tolist()):
            if row[-1]:
                out |= {f"{k}/{name}": v / row[-1] for k, v in zip(SET_TERMS, row)}
            out[f"samples_seen/{name}"] = int(total)
        return out

    def close(self) -> None:
        for h in (self.bar, self.tb, self.jsonl):
            if h is not None:
                h.close()
        if self.wandb is not None:
            self.wandb.finish()


def drop_rows_after(path: Path, step: int) -> None:
    """Keep the rows of steps <= `step` (and drop a line torn by a kill); atomic."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def format_line(r: dict) -> str:
    parts = [
        f"step {r['step']}",
        f"loss {r['loss']:.4f} (dyn {r['loss_dynamics']:.4f} act {r['loss_action']:.4f})",
        f"gnorm {r['grad_norm']:.3g}",
        f"lr {r['lr']:.2e}",
        f"{r['samples_per_s_per_gpu']:.2f} samples/s/GPU",
    ]
    if "mfu_pct" in r:
        parts.append(f"MFU {r['mfu_pct']:.1f}%")
    parts.append(f"data {r['data_wait_pct']:.1f}%")
    sets = [k.split("/", 1)[1] for k in r if k.startswith("loss/")]
    if sets:
        parts.append("per set loss " + " ".join(f"{name} {r[f'loss/{name}']:.4f}" for name in sets))
    if "val_loss" in r:
        parts.append(f"val loss {r['val_loss']:.4f}")
    if "cpu_optimizer_s" in r:
        parts.append(f"CPU optimizer {r['cpu_optimizer_s']:.2f} s/step")
    if "peak_mem_gib" in r:
        parts.append(f"mem {r['peak_mem_gib']:.1f} GiB")
    if r.get("alloc_retries"):
        parts.append(f"{r['alloc_retries']} allocator retries")
    return " | ".join(parts)


class StepProfiler:
    """torch.profiler over steps (profile_start, profile_start + profile_steps]; rank 0 writes the top ops by
    device time to profile-rank0.txt (and prints them) and a gzipped Chrome trace beside it; on CUDA the table is
    followed by where the GPU sat idle (`device_idle`)."""

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
                self._write(self.prof)
            self.prof = None

    def _write(self, prof: profile) -> None:
        sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        report = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
        trace = self.run_dir / "trace-rank0.json.gz"
        prof.export_chrome_trace(str(trace))  # gzipped by the ".gz" suffix
        if self.device.type == "cuda":
            with gzip.open(trace, "rt") as f:
                report += "\n\n" + format_device_idle(device_idle(json.load(f)["traceEvents"]))
        (self.run_dir / "profile-rank0.txt").write_text(report + "\n")
        print(f"profile of {self.cfg.profile_steps} steps after step {self.cfg.profile_start}:\n{report}", flush=True)


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")


def device_idle(events: list[dict], top: int = 8) -> dict:
    """Where the GPU waits, from a torch.profiler Chrome trace's events: busy and idle time over the span of device
    work, idle time by gap length, and the longest gaps with the host work that explains each (the innermost host
    op covering most of the gap, and the CUDA runtime calls of over 1 ms overlapping it: a cudaFree, a sync)."""
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    if not dev:
        return {}
    start, end, gaps, next_kernels = dev[0]["ts"], dev[0]["ts"], [], []
    for e in dev:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e["name"]))
            next_kernels.append(e)
        end = max(end, e["ts"] + e["dur"])
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    buckets = {"under 10 us": 0.0, "10 us - 1 ms": 0.0, "1 ms and over": 0.0}
    for us, _, _ in gaps:
        buckets["under 10 us" if us < 10 else "10 us - 1 ms" if us < 1000 else "1 ms and over"] += us / 1e3
    longest = []
    for us, at, before in sorted(gaps, reverse=True)[:top]:
        lo, hi = at, at + us
        overlap = [
            (min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"]), e)
            for e in host
            if e["ts"] < hi and e["ts"] + e["dur"] > lo
        ]
        covering = [e for o, e in overlap if o >= us / 2 and e.get("cat") in ("cpu_op", "user_annotation")]
        op = min(covering, key=lambda e: e["dur"])["name"] if covering else None
        runtime = [
            f"{e['name']} {e['dur'] / 1e3:.1f} ms"
            for _, e in overlap
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["dur"] > 1000
        ]
        longest.append(
            {"ms": us / 1e3, "at_ms": (at - start) / 1e3, "before": before, "host_op": op, "runtime": runtime}
        )
    idle = sum(g[0] for g in gaps)
    return {
        "span_ms": (end - start) / 1e3,
        "busy_ms": (end - start - idle) / 1e3,
        "idle_ms": idle / 1e3,
        "gaps": len(gaps),
        "idle_ms_by_gap": buckets,
        "longest": longest,
        "idle_ms_by_host_op": idle_by_host_op(gaps, next_kernels, host, top),
    }


def idle_by_host_op(gaps: list[tuple], next_kernels: list[dict], host: list[dict], top: int) -> list[tuple]:
    """The idle time of the gaps of 10 us and more, summed by the innermost host op that the thread launching the
    gap's next kernel was in at the gap's middle: what kept the GPU waiting where a few long gaps do not say it
    (thousands of short ones). [(op, ms, gaps)], the most idle first."""
    thread_of = {  # a kernel's launch: the runtime call with its correlation id, on the launching thread
        e["args"]["correlation"]: e["tid"]
        for e in host
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    wanted = defaultdict(list)  # thread -> [(gap middle, gap us)]
    for (us, at, _), kernel in zip(gaps, next_kernels):
        tid = thread_of.get(kernel.get("args", {}).get("correlation"))
        if us >= 10 and tid is not None:
            wanted[tid].append((at + us / 2, us))
    ops = defaultdict(list)
    for e in host:
        if e.get("cat") in ("cpu_op", "user_annotation") and e["tid"] in wanted:
            ops[e["tid"]].append(e)
    total = defaultdict(lambda: [0.0, 0])
    for tid, points in wanted.items():
        events, covering, i = sorted(ops[tid], key=lambda e: e["ts"]), [], 0
        for middle, us in sorted(points):
            while i < len(events) and events[i]["ts"] <= middle:
                e = events[i]
                heapq.heappush(covering, (e["ts"] + e["dur"], i, e))
                i += 1
            while covering and covering[0][0] < middle:  # ended before it: what is left covers the middle
                heapq.heappop(covering)
            name = min(covering, key=lambda c: c[2]["dur"])[2]["name"] if covering else "(no host op)"
            total[name][0] += us / 1e3
            total[name][1] += 1
    return sorted(((name, ms, n) for name, (ms, n) in total.items()), key=lambda t: -t[1])[:top]


def format_device_idle(r: dict) -> str:
    if not r:
        return "device idle: no device events in the trace"
    lines = [
        f"device idle: busy {r['busy_ms']:.1f} of {r['span_ms']:.1f} ms, idle {r['idle_ms']:.1f} ms in "
        f"{r['gaps']} gaps (" + ", ".join(f"{k}: {v:.1f} ms" for k, v in r["idle_ms_by_gap"].items()) + ")"
    ]
    for g in r["longest"]:
        lines.append(
            f"  {g['ms']:8.2f} ms at {g['at_ms']:.1f} ms, before {g['before'][:50]!r}; host: {g['host_op']}"
            + (f" ({'; '.join(g['runtime'])})" if g["runtime"] else "")
        )
    if r.get("idle_ms_by_host_op"):
        lines.append("idle in gaps of 10 us and more, by the host op the launching thread was in:")
        lines += [f"  {ms:8.2f} ms in {n:6d} gaps: {name[:90]}" for name, ms, n in r["idle_ms_by_host_op"]]
    return "\n".join(lines)
