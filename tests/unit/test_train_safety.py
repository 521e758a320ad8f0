"""The trainer never poisons a run and refuses what it cannot do: a NaN sample stops it naming step and sample (or is
skipped, --optim.skip-nonfinite), non-finite weights are never saved or exported, a checkpoint of another model or
one holding code is refused, and bad settings fail at start. Real torchrun runs, real checkpoints, real files."""

import json
import pickle
import shutil
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from wampipe.errors import RunError, UsageError
from tests.helpers import tiny_model
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
            r"--parallel.global-batch-size 6 \(must be auto or a positive multiple of the micro-batch 4\)",
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
