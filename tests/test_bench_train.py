"""scripts/bench_train.py on CPU with the tiny preset: shards -> torchrun trainer -> bound -> one JSON line."""

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from devtools import bench
from wampipe.train.config import BatchPlan, batch_plan, parse_args
from wampipe.train.data import data_dims

ROOT = Path(__file__).resolve().parents[1]

SMALL_BOUND = ["--bound-warmup", "1", "--bound-steps", "2"]


def _run(args: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_train.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_tiny_cpu_run_prints_every_field(tmp_path):
    out = tmp_path / "bench"
    r = _run(
        [
            "--preset",
            "tiny",
            "--nproc",
            "1",
            "--micro-batch",
            "2",
            "--global-batch",
            "4",
            "--warmup-steps",
            "2",
            "--steps",
            "2",
            "--ac",
            "full",
            "--no-compile",
            "--out",
            str(out),
            *SMALL_BOUND,
            "--",
            "--data.num-workers",
            "1",
            "--metrics.profile-start",
            "2",
            "--metrics.profile-steps",
            "1",
        ]
    )
    assert r == json.loads((out / "result.json").read_text())
    assert (r["preset"], r["model"], r["world_size"], r["micro_batch"], r["global_batch"], r["accum"]) == (
        "tiny",
        "tiny",
        1,
        2,
        4,
        2,
    )
    assert (r["ac"], r["compile"], r["device"]) == ("full", False, "cpu")
    assert (r["float8"], r["cpu_offload"], r["reduce_every_micro_batch"]) == ("none", False, False)
    assert r["trainer_extra"] == [
        "--data.num-workers",
        "1",
        "--metrics.profile-start",
        "2",
        "--metrics.profile-steps",
        "1",
    ]
    # the third step was profiled: top ops on rank 0 and a Chrome trace
    assert "aten::" in (out / "run" / "profile-rank0.txt").read_text()
    assert (out / "run" / "trace-rank0.json.gz").stat().st_size > 0
    assert r["gpu"].startswith("cpu") and r["torch"] and r["date"] and "--preset tiny" in r["command"]
    # the tiny model takes its widths from the shards: 9 latent frames of 2x2 tokens, twice, + 4 x (4 actions + 1 state)
    assert r["latent"] == [9, 4, 4] and r["seq_len"] == 2 * 9 * 4 + 4 * 5
    assert r["context_len"] == data_dims(out / "shards")["text_len"] + 5
    assert r["measured_steps"] == 2 and r["samples_per_s_per_gpu"] > 0 and r["measured_s"] > 0
    assert 0 <= r["data_wait_pct"] <= 100
    assert r["mfu_pct"] is None and r["peak_mem_gib"] is None  # CPU: no peak FLOP/s, no device allocator
    assert r["peak_reserved_gib"] is None and r["alloc_retries_per_step"] is None
    for name in ("bound", "bound_no_recompute"):
        assert r[f"{name}_samples_per_s"] > 0 and r[f"{name}_batch"] == 2
        assert r[f"ratio_to_bound{name[5:]}"] == pytest.approx(
            r["samples_per_s_per_gpu"] / r[f"{name}_samples_per_s"], rel=1e-3
        )
    # the trainer ran warm-up + measured steps, logged so the warm-up has records of its own
    steps = [json.loads(line)["step"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4]


@pytest.mark.e2e
def test_bound_only_skips_the_trainer(tmp_path):
    r = _run(
        ["--preset", "tiny", "--bound-only", "--ac", "none", "--micro-batch", "3", "--out", str(tmp_path), *SMALL_BOUND]
    )
    assert r["bound_samples_per_s"] > 0 and r["bound_batch"] == 3
    assert r["samples_per_s_per_gpu"] is None and r["ratio_to_bound"] is None
    assert r["bound_no_recompute_samples_per_s"] is None  # no recompute to leave out
    assert not (tmp_path / "run").exists()


def test_measured_window_excludes_warmup_and_weights_by_time(tmp_path):
    # 4 samples per rank-step; warm-up record (slow, compile) then 2 records of 2 steps at 8 and 2 samples/s:
    # 8 samples in 1 s + 8 samples in 4 s = 16 samples in 5 s
    records = [
        {"step": 2, "samples_per_s_per_gpu": 0.5, "data_wait_pct": 50.0, "mfu_pct": 1.0, "peak_mem_gib": 99.0},
        {
            "step": 4,
            "samples_per_s_per_gpu": 8.0,
            "data_wait_pct": 10.0,
            "mfu_pct": 40.0,
            "peak_mem_gib": 7.0,
            "peak_reserved_gib": 7.5,
            "alloc_retries": 3,
            "loss": 1.5,
        },
        {
            "step": 6,
            "samples_per_s_per_gpu": 2.0,
            "data_wait_pct": 0.0,
            "mfu_pct": 10.0,
            "peak_mem_gib": 6.0,
            "peak_reserved_gib": 7.8,
            "alloc_retries": 1,
            "loss": 1.25,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    m = bench.measured_window(tmp_path, warmup_steps=2, samples_per_rank_step=4)
    assert m["samples_per_s_per_gpu"] == pytest.approx(16 / 5)
    assert m["data_wait_pct"] == pytest.approx(100 * 0.1 / 5)
    assert m["mfu_pct"] == pytest.approx((40 * 1 + 10 * 4) / 5)  # MFU is proportional to the rate: 40 / 8 * 16 / 5
    assert (m["peak_mem_gib"], m["measured_steps"], m["measured_s"], m["loss_last"]) == (7.0, 4, 5.0, 1.25)
    assert (m["peak_reserved_gib"], m["alloc_retries_per_step"]) == (7.8, 1.0)  # 4 retries over 4 steps


def test_trainer_flags_put_warmup_in_its_own_records_and_pass_extra_flags_last(tmp_path):
    argv, extra = bench.split_passthrough(["--steps", "20", "--", "--parallel.no-compile", "--data.num-workers", "8"])
    assert (argv, extra) == (["--steps", "20"], ["--parallel.no-compile", "--data.num-workers", "8"])
    args = Namespace(
        preset="libero-5b", warmup_steps=6, steps=20, ac="selective", micro_batch=16, global_batch=None, compile=None
    )
    cfg = parse_args(bench.trainer_argv(args, tmp_path / "s", tmp_path / "r", extra))
    assert (cfg.steps, cfg.metrics.interval) == (26, 2)  # gcd(6, 20): records end exactly at the warm-up
    assert (cfg.data.micro_batch_size, cfg.parallel.global_batch_size) == (16, 256)  # global: the preset's
    assert (cfg.parallel.activation_checkpoint, cfg.parallel.compile, cfg.data.num_workers) == ("selective", False, 8)
    assert not (cfg.checkpoint.save_final or cfg.checkpoint.export or cfg.checkpoint.resume)
    assert batch_plan(cfg, 2) == BatchPlan(micro=16, global_batch=256, accum=8)
