"""scripts/bench_train.py on CPU with the tiny preset: shards -> torchrun trainer -> bound -> one JSON line."""

import json
import subprocess
import sys

import pytest

from wampipe.train.data import data_dims

from tests.helpers import ROOT

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
