"""`python -m train.evaluate` on a real 2-rank torchrun run (its DCP checkpoint and its eval-ready export) and the
trainer's periodic action error (--metrics.action-interval) of the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from wampipe.train.evaluation.curves import read_metrics
from tests.helpers import ROOT, tiny_torchrun


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "29647"}


def fp32_copy(base: Path, out: Path) -> Path:
    """`base` with every tensor in fp32: an export keeps its base's dtypes, so it then holds the checkpoint's exact
    weights."""
    out.mkdir(parents=True)
    for f in base.rglob("*"):
        target = out / f.relative_to(base)
        if f.is_dir():
            target.mkdir(exist_ok=True)
        elif f.suffix == ".safetensors":
            save_file({k: v.float() for k, v in load_file(f).items()}, str(target), metadata={"format": "pt"})
        else:
            target.write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="module")
def run(small_shards, official_base, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("evaluate")
    base = fp32_copy(official_base, tmp / "base")
    run_dir = tmp / "run"
    subprocess.run(
        tiny_torchrun(
            "--data.shards",
            str(small_shards),
            "--steps",
            "2",
            "--checkpoint.interval",
            "0",
            "--metrics.no-progress",
            "--metrics.no-tensorboard",
            "--model.init-from",
            str(base),
            "--model.init-device",
            "meta",
            "--data.num-workers",
            "0",
            "--checkpoint.dir",
            str(run_dir),
            "--checkpoint.export-base",
            str(base),
            "--checkpoint.export-dtype",
            "float32",
            "--metrics.action-interval",
            "1",
            "--metrics.action-samples",
            "3",
        ),
        check=True,
        capture_output=True,
        env=ENV,
        cwd=ROOT,
        timeout=600,
    )
    return run_dir


def evaluate(source: Path, shards: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "train.evaluate",
            str(source),
            "--shards",
            str(shards),
            "--samples",
            "3",
            "--batch-size",
            "2",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=300,
    )


@pytest.mark.slow
def test_checkpoint_and_export_give_the_same_report(run, small_shards, tmp_path):
    reports = []
    for source, out in ((run, tmp_path / "ckpt"), (run / "export", tmp_path / "export")):
        done = evaluate(source, small_shards, out)
        assert done.returncode == 0, done.stderr
        assert (out / "open_loop.png").stat().st_size > 0
        reports.append(json.loads((out / "open_loop.json").read_text()))
    ckpt, export = reports
    assert ckpt.pop("source") == str(run / "step-000002") and export.pop("source") == str(run / "export")
    assert ckpt == export
    assert ckpt["samples"] == 3 and ckpt["guided"] is False
    assert ckpt["action_dims"] == 7 and len(ckpt["chunk_raw"]["per_dim"]) == 7
    assert ckpt["sampler"] == {
        "steps": 16,
        "shift": 5.0,
        "num_train_timesteps": 1000,
        "dit_steps": 8,
        "cfg_scale": 5.0,
        "seed": 1140,
        "state_sees_block": True,
    }


@pytest.mark.slow
def test_trainer_logs_the_action_error_evaluate_reports(run, small_shards, tmp_path):
    """The 2 ranks split the 3 windows (one pads with a repeat it leaves out); the result is evaluate's on the
    step's checkpoint, to fp32 rounding (other batch compositions, FSDP's forward), which the sampler's 16 steps carry
    to about 2e-4 of the mean on some CPUs; one optimizer step moves it by about 4e-2."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in rows if "action_mse/shards" in r}
    assert sorted(logged) == [1, 2]
    done = evaluate(run, small_shards, tmp_path / "ckpt", "--plot-samples", "0")
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "ckpt" / "open_loop.json").read_text())
    assert logged[2]["action_mse/shards"] == pytest.approx(report["chunk"]["mean"], rel=1e-3)
    assert logged[2]["action_mse_raw/shards"] == pytest.approx(report["chunk_raw"]["mean"], rel=1e-3)
    assert logged[1]["action_mse/shards"] != logged[2]["action_mse/shards"]  # the step changed the model
    curves = {r["step"]: r for r in read_metrics(run / "metrics.jsonl")}  # the training row and the probe's, merged
    assert {"loss", "action_mse/shards", "action_mse_raw/shards"} <= set(curves[2])


@pytest.fixture(scope="module")
def other_dit_shards(tmp_path_factory) -> Path:
    """Synthetic shards of the 5B LIBERO recipe: another DiT's widths, latent grid and prompt lengths."""
    from devtools.synthetic import make_synthetic_shards

    out = tmp_path_factory.mktemp("libero5b") / "shards"
    make_synthetic_shards(out, "libero-5b", episodes=1, windows_per_episode=1, samples_per_shard=4, seed=1)
    return out


@pytest.mark.parametrize("case", ["empty", "file", "step", "other DiT", "other DiT, export"])
def test_a_bad_input_stops_with_one_line(run, small_shards, other_dit_shards, tmp_path, case):
    from wampipe.train.evaluate import main

    source, shards, extra, start = {
        "empty": (tmp_path, small_shards, (), f"{tmp_path}: nothing to load"),
        "file": (run / "config.yaml", small_shards, (), f"{run / 'config.yaml'}: not a directory"),
        "step": (run, small_shards, ("--step", "7"), f"{run}: no checkpoint of step 7"),
        "other DiT": (run, other_dit_shards, (), f"{other_dit_shards} does not fit the DiT of {run / 'step-000002'}"),
        "other DiT, export": (
            run / "export",
            other_dit_shards,
            (),
            f"{other_dit_shards} does not fit the DiT of {run / 'export'}",
        ),
    }[case]
    with pytest.raises(SystemExit) as stop:
        main([str(source), "--shards", str(shards), "--out", str(tmp_path / "out"), *extra])
    message = str(stop.value.code)
    assert len(message.splitlines()) == 1 and message.startswith(start), message
    assert not (tmp_path / "out").exists()
