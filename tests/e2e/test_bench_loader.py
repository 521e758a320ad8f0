"""scripts/bench_loader.py on CPU with the tiny preset: synthetic shards -> the trainer's ShardLoader -> JSON."""

import json
import subprocess
import sys

import pytest
from tests.helpers import ROOT

pytestmark = pytest.mark.e2e  # every test runs the tools in processes of their own


@pytest.mark.slow
def test_tiny_run_measures_every_worker_count_warm_and_cold(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_loader.py"),
            "--preset",
            "tiny",
            "--workers",
            "0",
            "2",
            "--batches",
            "3",
            "--micro-batch",
            "2",
            "--windows",
            "16",
            "--gpu-samples-per-s",
            "5",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r == json.loads((out / "result.json").read_text())
    assert (r["preset"], r["micro_batch"], r["gpu_samples_per_s"], r["compact_text"]) == ("tiny", 2, 5.0, True)
    assert [(m["workers"], m["cache"]) for m in r["runs"]] == [(0, "warm"), (2, "warm"), (0, "cold"), (2, "cold")]
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    assert manifest["totals"]["samples"] == 16 and r["sample_kib"] > 0
    for m in r["runs"]:
        assert m["samples"] == 3 * 2 and m["seconds"] > 0 and m["batch_mib_per_s"] > 0
        assert m["samples_per_s"] == pytest.approx(m["samples"] / m["seconds"], rel=0.01)
        assert m["samples_per_s_per_worker"] == pytest.approx(m["samples_per_s"] / max(1, m["workers"]), rel=0.01)
        assert m["ratio_per_worker_to_gpu"] == pytest.approx(m["samples_per_s_per_worker"] / 5, abs=0.06)
    assert r["min_ratio_per_worker_to_gpu"] == min(m["ratio_per_worker_to_gpu"] for m in r["runs"] if m["workers"])


def test_bad_arguments_are_refused():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_loader.py"), "--windows", "2", "--micro-batch", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--windows >= --micro-batch" in done.stderr
