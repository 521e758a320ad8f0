"""The trainer never poisons a run and refuses what it cannot do: a NaN sample stops it naming step and sample (or is
skipped, --optim.skip-nonfinite), non-finite weights are never saved or exported, a checkpoint of another model or
one holding code is refused, and bad settings fail at start. Real torchrun runs, real checkpoints, real files."""

import io
import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from devtools import synthetic
from wampipe.shardformat.index import Window
from wampipe.shardformat.members import checksum, npy_bytes
from wampipe.shardformat.shard import ShardRecord, json_path
from tests.helpers import ROOT, metric_rows, reindex, trainer_command, trainer_env
from wampipe.train import checkpoint
from wampipe.train.builder import model_config
from wampipe.train.config import parse_args
from wampipe.train.data import ShardLoader


def _first_visits(shards: Path, steps: int) -> tuple[dict[int, int], ShardLoader]:
    """window index -> the first step at which the trainer's loader hands it to either of 2 ranks."""
    cfg = parse_args(["--data.shards", str(shards), "--data.num-workers", "0"])
    first: dict[int, int] = {}
    for rank in range(2):
        loader = ShardLoader(cfg.data, model_config(cfg), rank, 2, torch.device("cpu"))
        for step, batch in zip(range(1, steps + 1), loader):
            for w in batch["window"].tolist():
                first[w] = min(first.get(w, step), step)
    return first, loader


def _put_nan(shard_tar: str | Path, key: str) -> None:
    """One NaN in a sample's latents, as a diverged encoder would write it: the member rewritten in place and its
    CRC in the shard JSON updated, so the reader takes the bytes as they are."""
    record = ShardRecord.read(json_path(shard_tar))
    i, sample = next((i, s) for i, s in enumerate(record.samples) if s.key == key)
    member = next(m for m in sample.members if m.name == "latents.npy")
    with open(shard_tar, "r+b") as f:
        f.seek(member.offset)
        array = np.load(io.BytesIO(f.read(member.size)))
        array.flat[0] = 0x7FC0  # bf16 NaN, stored as its uint16 bits
        data = npy_bytes(array)
        assert len(data) == member.size
        f.seek(member.offset)
        f.write(data)
    members = tuple(replace(m, crc32=checksum(data)) if m is member else m for m in sample.members)
    record.samples[i] = replace(sample, members=members)
    record.write(json_path(shard_tar))


@pytest.mark.e2e
def test_nan_sample_stops_the_run_naming_it_then_skipping_finishes(tmp_path):
    shards = tmp_path / "shards"
    synthetic.make_synthetic_shards(
        shards, "tiny", episodes=5, windows_per_episode=5, samples_per_shard=7, seed=1, compress="none"
    )
    first, loader = _first_visits(shards, 8)
    bad_step, bad = min((s, w) for w, s in first.items() if s >= 5)
    window = cast(Window, loader.index.windows[bad])
    shard_index, key = window.variants[0]
    _put_nan(loader.index.shards[shard_index], key)
    reindex(shards)  # the sample index records the new CRC-32 too
    run_dir = tmp_path / "run"
    cmd = trainer_command(shards, run_dir) + [
        "--steps",
        "8",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep-last",
        "2",
    ]

    stopped = subprocess.run(cmd, env=trainer_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert stopped.returncode != 0
    good = list(range(2, bad_step, 2))[-2:]  # keep-last 2 of the checkpoints every 2 steps before the NaN
    line = (
        f"step {bad_step}: non-finite loss on {window.name} in {loader.index.shards[shard_index]} "
        f"(non-finite latents): stopped, nothing saved (last checkpoint: {checkpoint.step_dir(run_dir, good[-1])})"
    )
    assert stopped.stderr.count(line) == 1, stopped.stderr[-3000:]  # one line, from rank 0 only
    assert [s for s, _ in checkpoint.complete_checkpoints(run_dir)] == good
    assert max(r["step"] for r in metric_rows(run_dir)) < bad_step

    skipping = cmd + ["--optim.skip-nonfinite", "3"]  # the same run again, resumed from its last good checkpoint
    done = subprocess.run(skipping, env=trainer_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step {bad_step}: non-finite loss on {window.name}" in done.stdout
    assert "its batches dropped, the step runs again on the next ones (1 of --optim.skip-nonfinite 3)" in done.stdout
    assert [r["step"] for r in metric_rows(run_dir)] == list(range(1, 9))  # every step once, none of them NaN
    assert all(np.isfinite(r["loss"]) for r in metric_rows(run_dir))
    summary = json.loads((run_dir / "summary-rank00000.json").read_text())
    assert summary["last_step"] == 8 and summary["skipped"] >= 1
    exported = load_file(run_dir / "export" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in exported.values())


@pytest.mark.parametrize(
    "failure, code, message",
    [
        ("RuntimeError('CUDA out of memory')", 1, "RuntimeError: CUDA out of memory"),  # with its traceback
        ("RunError('step 5: non-finite loss')", 1, "step 5: non-finite loss"),  # the trainer's one-line errors
        ("UsageError('--data.shards x: no windows')", 1, "--data.shards x: no windows"),
        ("SystemExit('step 5: non-finite loss')", 1, "step 5: non-finite loss"),
        ("SystemExit(3)", 3, None),
    ],
)
@pytest.mark.e2e
def test_a_failed_rank_leaves_at_once_with_its_error(failure, code, message):
    """A rank that failed must exit even where Python's own exit would block (on GPUs: freeing memory under a
    collective that never completes; here a thread that never ends, which Python's exit waits for), with its error
    printed, what it printed before flushed, and its exit status."""
    script = textwrap.dedent(f"""
        import threading
        from wampipe.errors import UsageError
        from wampipe.errors import RunError
        from wampipe.train.runtime import leave_now
        threading.Thread(target=threading.Event().wait).start()
        print("step 4 | loss 2.61", flush=False)  # stdout is a pipe here: block-buffered
        try:
            raise {failure}
        except BaseException as failure:
            leave_now(failure)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], env=trainer_env(), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == code, done.stderr[-2000:]
    assert done.stdout == "step 4 | loss 2.61\n"
    if message is None:
        assert done.stderr == ""
    else:
        assert done.stderr.rstrip().endswith(message)
        assert ("Traceback (most recent call last)" in done.stderr) == failure.startswith("RuntimeError")
