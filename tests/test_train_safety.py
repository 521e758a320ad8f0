"""The trainer never poisons a run and refuses what it cannot do: a NaN sample stops it naming step and sample (or is
skipped, --optim.skip-nonfinite), non-finite weights are never saved or exported, a checkpoint of another model or
one holding code is refused, and bad settings fail at start. Real torchrun runs, real checkpoints, real files."""

import io
import json
import pickle
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from devtools import synthetic
from wampipe.errors import RunError, UsageError
from wampipe.shardformat.index import Window
from wampipe.shardformat.members import checksum, npy_bytes
from wampipe.shardformat.shard import ShardRecord, json_path
from tests.helpers import reindex, tiny_model
from tests.helpers import trainer_command, trainer_env, metric_rows
from tests.helpers import ROOT
from wampipe.train import checkpoint
from wampipe.train.builder import model_config
from wampipe.train.config import CheckpointConfig, OptimConfig, ParallelConfig, parse_args
from wampipe.train.data import ShardLoader
from wampipe.train.dit.loss import FlowMatchScheduler, flow_matching_loss
from wampipe.train.metrics import MetricsLogger
from wampipe.train.dit.model import random_batch
from wampipe.train.optim import build_optimizer
from wampipe.train.parallel import parallelize
from wampipe.train.state import TrainState, noise_seed


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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


def _trained_model(**overrides):
    model = tiny_model(**overrides)
    parallelize(model, ParallelConfig(param_dtype="float32"))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3), torch.device("cpu"))
    batch = random_batch(model.cfg, 2, (9, 4, 4), generator=torch.Generator().manual_seed(1))
    loss, _ = flow_matching_loss(model, batch, FlowMatchScheduler(), generator=torch.Generator().manual_seed(2))
    loss.backward()
    optimizer.step()
    return model, optimizer


def _save(run: Path, step: int, model, optimizer) -> Path:
    return checkpoint.save(
        CheckpointConfig(dir=run, keep_last=2),
        step,
        model,
        optimizer,
        {"step": step, "rng": torch.Generator().get_state()},
    )


def test_nonfinite_weights_are_never_saved_or_exported(process_group, tmp_path):
    model, optimizer = _trained_model()
    for step in (1, 2):
        _save(tmp_path, step, model, optimizer)
    name, param = next(model.named_parameters())
    with torch.no_grad():
        cast(DTensor, param).to_local().view(-1)[0] = float("inf")  # FSDP2 sharded it
    with pytest.raises(RunError, match=rf"^refusing to save step 3: non-finite weights in {name}$"):
        _save(tmp_path, 3, model, optimizer)
    with pytest.raises(RunError, match="refusing to export: non-finite weights"):
        checkpoint.require_finite(model, "export")
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [1, 2]  # keep-last 2 rotated nothing out
    assert not checkpoint.step_dir(tmp_path, 3).exists()


def test_resume_with_another_model_shape_is_refused(process_group, tmp_path):
    path = _save(tmp_path, 1, *_trained_model())
    deeper, optimizer = _trained_model(num_layers=3)
    with pytest.raises(RunError, match=r"a checkpoint of another model \(num_layers: checkpoint 2, this run 3\)"):
        checkpoint.load(path, deeper, optimizer)
    state = checkpoint.load(path, *_trained_model())
    assert state["step"] == 1 and state["same_rank"] and state["rng"].dtype == torch.uint8


def test_the_loops_state_comes_back_from_a_checkpoint(process_group, tmp_path, small_shards):
    """TrainState (a DCP Stateful) saved beside the weights loads back as it was: step, skipped steps, warmup, the
    loader's position and samples seen, and the noise stream where it stopped; from a run of another world size
    (not this rank's state) the stream restarts from the step's seed."""
    cfg = parse_args(["--data.shards", str(small_shards), "--data.num-workers", "0"])
    cpu = torch.device("cpu")

    def fresh() -> TrainState:
        return TrainState(ShardLoader(cfg.data, model_config(cfg), 0, 1, cpu), seed=3, rank=0, device=cpu, warmup=5)

    state = fresh()
    assert isinstance(state, Stateful)
    batches = iter(state.loader)
    for _ in range(2):
        next(batches)
    batches.close()
    state.step, state.skipped = 2, 1
    torch.rand(3, generator=state.noise)
    model, optimizer = _trained_model()
    path = checkpoint.save(CheckpointConfig(dir=tmp_path), 2, model, optimizer, state.state_dict())
    saved = checkpoint.load(path, model, optimizer)
    resumed = fresh()
    resumed.load_state_dict(saved)
    assert (resumed.step, resumed.skipped, resumed.warmup, resumed.loader.next_batch) == (2, 1, 5, 2)
    assert resumed.samples_seen.tolist() == state.samples_seen.tolist() and state.samples_seen.sum() > 0
    assert torch.equal(torch.rand(4, generator=resumed.noise), torch.rand(4, generator=state.noise))
    elsewhere = fresh()
    elsewhere.load_state_dict(saved | {"same_rank": False})
    restarted = torch.Generator().manual_seed(noise_seed(3, 0, 2))
    assert torch.equal(torch.rand(4, generator=elsewhere.noise), torch.rand(4, generator=restarted))


class _Plant:
    """Unpickling this creates a file: what a crafted checkpoint would do instead of something harmless."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_loading_a_checkpoint_runs_no_code_from_it(process_group, tmp_path):
    marker = tmp_path / "code-ran"
    model, optimizer = _trained_model()
    path = _save(tmp_path / "run", 1, model, optimizer)
    torch.save(_Plant(marker), path / "rank-00000.pt")  # a pickle beside the JSON state: never opened
    checkpoint.load(path, model, optimizer)

    state = path / "rank-00000.json"
    state.rename(path / "kept.json")  # the pickle alone is not read either
    with pytest.raises(RunError, match=r"no rank-00000\.json$"):
        checkpoint.load(path, model, optimizer)
    (path / "kept.json").rename(state)

    metadata = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    with pytest.raises(RunError, match=r"\.metadata: refusing to load: \w+\.open is not part of checkpoint"):
        checkpoint.load(path, model, optimizer)
    (path / ".metadata").write_bytes(metadata)

    model_sd, optim_sd = get_state_dict(model, optimizer)
    groups = cast(list[dict[str, Any]], optim_sd["param_groups"])
    groups[0]["lr"] = _Plant(marker)  # DCP pickles non-tensor values into the .distcp files
    crafted = tmp_path / "crafted"
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=crafted)
    for state in path.glob("rank-00000.*"):
        shutil.copy(state, crafted)
    with pytest.raises(RunError, match="refusing to load: Weights only load failed"):
        checkpoint.load(crafted, model, optimizer)
    assert not marker.exists()


def test_bad_settings_and_missing_shards_are_refused_at_start(tmp_path, monkeypatch):
    shards = ["--data.shards", str(tmp_path)]
    for argv, message in [
        (["--steps", "0"], r"--steps 0 \(must be >= 1\)"),
        (["--data.micro-batch-size", "-2"], r"--data.micro-batch-size -2 \(must be >= 1\)"),
        (
            ["--parallel.global-batch-size", "6", "--data.micro-batch-size", "4"],
            r"--parallel.global-batch-size 6 \(must be 0 or a positive multiple of the micro-batch 4\)",
        ),
        (
            ["--checkpoint.keep-last", "0", "--metrics.interval", "0"],
            r"--checkpoint.keep-last 0 \(must be >= 1\); --metrics.interval 0 \(must be >= 1\)",
        ),
    ]:
        with pytest.raises(UsageError, match=r"^invalid settings: " + message + "$"):
            parse_args(argv + shards)
    assert parse_args(["--preset", "droid-5b"] + shards).optim.warmup_ratio == 0.05  # both references' 5B recipes

    monkeypatch.chdir(tmp_path)  # `torchrun train/main.py` with no flags: `make shards`' output, or what to pass
    with pytest.raises(
        UsageError,
        match=r"no shards given and shards/droid/manifest.json does not exist: pass "
        r"--data.shards DIR",
    ):
        parse_args([])
    (tmp_path / "shards" / "droid").mkdir(parents=True)
    (tmp_path / "shards" / "droid" / "manifest.json").write_text("{}")
    assert parse_args([]).data.shards == Path("shards/droid")


def test_metrics_of_a_resumed_run_replace_later_rows_and_tensorboard_gets_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 11, "lo')  # killed mid-write at step 11
    cfg = parse_args(["--data.shards", str(tmp_path), "--metrics.no-progress"])
    config = {"steps": cfg.steps, "optim": {"lr": cfg.optim.lr}}
    logger = MetricsLogger(cfg.metrics, tmp_path, 0, torch.device("cpu"), 40, 6, 1.0, None, 1, config=config)
    logger.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.strip("`").removeprefix("json\n")) == config
