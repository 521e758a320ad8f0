"""scripts/bench_train.py on CPU with the tiny preset: shards -> torchrun trainer -> bound -> one JSON line."""

import json
from argparse import Namespace

import pytest

from devtools import bench
from wampipe.train.config import BatchPlan, batch_plan, parse_args


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
