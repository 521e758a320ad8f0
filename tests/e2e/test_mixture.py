"""Weighted mixtures of shard sets (--data.mixture) on real shards that `preprocess shards` builds from the sample
DROID (3 views, latents 48x9x11x20, 24 actions per chunk, 8-dim actions) and LIBERO (2 views, 48x9x10x20, 16 per
chunk, 7-dim actions) layouts: visit frequencies follow the weights, every micro-batch holds one set's shapes and is
normalised with that set's statistics, the draws do not depend on loader workers, a changed mixture is refused at
resume, bad sets stop in one line, and a two-rank gloo run killed with SIGKILL resumes to the same losses and per-set
samples while its eval-ready export holds both embodiments."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from PIL import Image

from devtools import synthetic
from wampipe.errors import UsageError
from wampipe.shardformat.index import Window
from wampipe.shardformat.manifest import Manifest
from wampipe.shardformat.samples import write_index
from wampipe.shardformat.stats import normalize_q99, pad_with_mask
from wampipe.train.builder import model_config
from wampipe.train.config import DataConfig, ShardSet, file_config, parse_args, save_config
from wampipe.train.evaluation.curves import plot
from wampipe.train.data import SampleReader, ShardLoader, SetDraws, open_sets
from tests.helpers import ROOT, tiny_torchrun


CPU = torch.device("cpu")


def _data(droid, libero, weights=(3.0, 1.0), **kw) -> DataConfig:
    sets = (ShardSet(str(droid), weights[0]), ShardSet(str(libero), weights[1]))
    return DataConfig(mixture=sets, micro_batch_size=1, num_workers=0, **kw)


def _model(data: DataConfig):
    return model_config(parse_args(["--data.mixture", *(f"{s.shards}={s.weight}" for s in data.mixture)]))


@pytest.mark.parametrize("weighting", ["set", "size"])
def test_sets_are_visited_as_often_as_their_weights_say(droid_shards, libero_shards, weighting):
    """Over 400 micro-batches of one rank, each set's share is within 4 binomial standard deviations of its
    probability: the weight (set) or weight x visits per epoch (size: DROID 28, LIBERO 20 per epoch)."""
    data = _data(droid_shards, libero_shards, mixture_weighting=weighting)
    loader = ShardLoader(data, _model(data), 0, 2, CPU)
    want = np.array([3.0, 1.0]) * (np.array(loader.epoch_lengths) if weighting == "size" else 1)
    p = want[0] / want.sum()
    assert loader.probs.tolist() == pytest.approx([p, 1 - p])  # 0.75, or 84 / 104 weighted by size
    it = iter(loader)
    sets = [int(next(it)["set"]) for _ in range(400)]
    drawn = sets.count(0)
    assert abs(drawn - 400 * p) <= 4 * np.sqrt(400 * p * (1 - p)), (drawn, p)
    assert loader.samples_seen().tolist() == [drawn, 400 - drawn]  # what the metrics log, from the position alone


def test_every_micro_batch_holds_one_set_normalised_with_its_own_statistics(droid_shards, libero_shards):
    data = _data(droid_shards, libero_shards, (1.0, 1.0))
    data.micro_batch_size = 2
    model = _model(data)
    loader = ShardLoader(data, model, 1, 2, CPU)
    indexes = loader.indexes
    assert indexes[0].q01["action"].size == 8 and indexes[1].q01["action"].size == 7
    readers = [SampleReader(index, model) for index in indexes]
    shapes = {}
    it = iter(loader)
    for _ in range(12):
        batch = next(it)
        s = int(batch["set"])
        shapes.setdefault(s, set()).add((tuple(batch["latents"].shape[1:]), tuple(batch["actions"].shape[1:])))
        for j, w in enumerate(batch["window"].tolist()):
            ((shard, key),) = cast(Window, indexes[s].windows[w]).variants
            raw = readers[s].raw(shard, key)[1]
            for name, out in (("action", "actions"), ("state", "state")):
                x = torch.from_numpy(np.asarray(raw[name], np.float32))
                width = model.action_dim if name == "action" else model.max_state_dim
                own = pad_with_mask(normalize_q99(x, indexes[s].q01[name], indexes[s].q99[name]), width)[0]
                assert torch.equal(batch[out][j], own), (s, name)
    assert shapes == {0: {((48, 9, 11, 20), (96, 8))}, 1: {((48, 9, 10, 20), (64, 8))}}
    # the other set's statistics would give other values: the test can tell them apart
    assert not np.allclose(indexes[0].q99["state"], indexes[1].q99["state"])


def test_draws_do_not_depend_on_workers_and_a_resumed_loader_continues_them(droid_shards, libero_shards):
    data = _data(droid_shards, libero_shards)
    model = _model(data)
    indexes = open_sets(data)

    def run(workers, start_state=None, n=10):
        cfg = DataConfig(**{**data.__dict__, "num_workers": workers})
        loader = ShardLoader(cfg, model, 0, 2, CPU, indexes)
        if start_state:
            loader.load_state_dict(start_state)
        it = iter(loader)
        got = [(int(b["set"]), b["window"].tolist(), float(b["actions"].sum())) for b in (next(it) for _ in range(n))]
        return got, loader.state_dict()

    plain, _ = run(0, n=10)
    assert run(2, n=10)[0] == plain
    first, state = run(0, n=4)
    assert state["next_batch"] == 4 and json.loads(json.dumps(state)) == state  # checkpointed as JSON
    assert first + run(2, state, n=6)[0] == plain
    assert [s for s, *_ in plain] == [
        SetDraws(ShardLoader(data, model, 0, 2, CPU, indexes).probs, 0, 0)[g] for g in range(10)
    ]


def test_a_set_on_s3_gives_the_batches_of_its_local_copy(droid_shards, libero_shards, s3_bucket):
    from wampipe.shardformat.storage import sync_up

    url = f"{s3_bucket}/libero"
    sync_up(libero_shards, url)
    local = _data(droid_shards, libero_shards)
    model = _model(local)
    remote = DataConfig(**{**local.__dict__, "mixture": (local.mixture[0], ShardSet(url, 1.0))})
    want = [next(it) for it in [iter(ShardLoader(local, model, 0, 2, CPU))] for _ in range(8)]
    got = [next(it) for it in [iter(ShardLoader(remote, model, 0, 2, CPU))] for _ in range(8)]
    assert {int(b["set"]) for b in want} == {0, 1}
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_another_mixture_is_refused_at_resume_unless_changed_on_purpose(droid_shards, libero_shards):
    data = _data(droid_shards, libero_shards)
    model = _model(data)
    indexes = open_sets(data)
    state = {**ShardLoader(data, model, 0, 2, CPU, indexes).state_dict(), "next_batch": 5}
    other = _data(droid_shards, libero_shards, (1.0, 1.0))
    with pytest.raises(UsageError) as refused:
        ShardLoader(other, model, 0, 2, CPU, indexes).load_state_dict(state)
    assert str(refused.value) == (
        f"checkpoint data (mixture by set of {droid_shards}=3 (10 windows), {libero_shards}=1 (10 windows)) differs "
        f"from this run's (mixture by set of {droid_shards}=1 (10 windows), {libero_shards}=1 (10 windows)); pass "
        f"--data.mixture-changed to continue with this run's data"
    )
    single = {k: v for k, v in state.items() if k != "mixture"}  # a checkpoint of a --data.shards run
    with pytest.raises(UsageError, match=r"^checkpoint data \(one set, --data.shards\) differs"):
        ShardLoader(data, model, 0, 2, CPU, indexes).load_state_dict(single)
    other.mixture_changed = True
    changed = ShardLoader(other, model, 0, 2, CPU, indexes)
    changed.load_state_dict(state)
    assert changed.next_batch == 5


def test_the_mixture_round_trips_through_a_config_file(droid_shards, libero_shards, tmp_path):
    cfg = parse_args(
        ["--data.mixture", f"{droid_shards}=0.7", f"{libero_shards}=0.3", "--data.mixture-weighting", "size"]
    )
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert f"- shards: {droid_shards}\n      weight: 0.7\n" in text
    assert file_config(str(tmp_path / "config.yaml")).data == cfg.data
    (tmp_path / "recipe.yaml").write_text(f"train:\n  data:\n    mixture: [{{shards: {libero_shards}, weight: 2}}]\n")
    assert parse_args(["--config", str(tmp_path / "recipe.yaml")]).data.sets() == (ShardSet(str(libero_shards), 2.0),)


def test_sets_of_another_dit_recipe_or_empty_sets_are_refused_naming_the_set(droid_shards, tmp_path):
    other = tmp_path / "tiny"  # the tiny recipe's synthetic shards: 4 latent channels, not 48
    synthetic.make_synthetic_shards(other, "tiny", episodes=2, windows_per_episode=2, samples_per_shard=4, seed=1)
    with pytest.raises(UsageError) as refused:
        open_sets(DataConfig(mixture=(ShardSet(str(droid_shards)), ShardSet(str(other)))))
    assert str(refused.value) == (
        f"{other}: built for another DiT recipe than {droid_shards}: in_dim 4 vs 48; the "
        f"sets of a mixture share the encoders and the DiT's widths"
    )
    empty = tmp_path / "empty"  # as a build whose every episode was too short: a sealed manifest of no shards
    shutil.copytree(other, empty)
    manifest = Manifest.read(empty)
    manifest.shards, manifest.totals = [], {**manifest.totals, "samples": 0, "shards": 0}
    rows = np.load(empty / "samples.npy")[:0]
    manifest.sample_index = {**manifest.sample_index, **write_index(empty / "samples.npy", rows, [])}
    manifest.write(empty)
    with pytest.raises(UsageError) as refused:
        open_sets(DataConfig(mixture=(ShardSet(str(other)), ShardSet(str(empty)))))
    assert str(refused.value) == f"{empty}: no windows (an empty shard set)"


def _command(droid, libero, run_dir: Path, base: Path, tensorboard: bool = False) -> list[str]:
    return tiny_torchrun(
        "--data.mixture",
        f"{droid}=2",
        f"{libero}=1",
        "--data.micro-batch-size",
        "1",
        "--parallel.global-batch-size",
        "4",
        "--checkpoint.dir",
        str(run_dir),
        "--steps",
        "12",
        "--checkpoint.interval",
        "4",
        "--metrics.interval",
        "1",
        "--metrics.no-progress",
        f"--metrics.{'' if tensorboard else 'no-'}tensorboard",
        "--parallel.deterministic",
        "--model.init-from",
        str(base),
        "--checkpoint.export-base",
        str(base),
    )


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:  # torn by the kill
            pass
    return rows


@pytest.mark.slow
def _wait_until_free(lock: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with open(lock, "rb") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fcntl.flock(f, fcntl.LOCK_UN)
            except BlockingIOError:
                assert time.monotonic() < deadline, "the killed run's ranks still hold its directory"
                time.sleep(0.1)


def test_sigkilled_mixture_run_resumes_to_the_same_losses_and_samples(droid_shards, libero_shards, tmp_path):
    from devtools import tiny_base

    base = tiny_base.write_base(tiny_base.Args(out=tmp_path / "base", shards=droid_shards, also=("libero_sim",)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = tmp_path / "full"
    subprocess.run(
        _command(droid_shards, libero_shards, full, base, tensorboard=True),
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )

    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(droid_shards, libero_shards, run_dir, base),
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while (
        max([r["step"] for r in _rows(run_dir)], default=0) < 6 and proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _wait_until_free(run_dir / ".lock")  # the ranks (own sessions) leave after their launcher, releasing the run dir
    subprocess.run(
        _command(droid_shards, libero_shards, run_dir, base),
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )

    want, got = _rows(full), _rows(run_dir)
    per_set = [k for k in want[-1] if "/" in k]
    assert {k.split("/")[0] for k in per_set} == {"loss", "loss_dynamics", "loss_action", "samples_seen"}
    keys = ["step", "loss", "loss_action", *per_set]
    assert [[r.get(k) for k in keys] for r in got] == [[r.get(k) for k in keys] for r in want]
    seen = [want[-1][f"samples_seen/{name}"] for name in ("droid", "libero")]
    assert sum(seen) == 12 * 4 and min(seen) > 0  # every sample of the run, counted in its set

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(full / "tb"))
    events.Reload()
    assert {f"loss/{n}" for n in ("droid", "libero")} | {"samples_seen/droid"} <= set(events.Tags()["scalars"])
    assert events.Scalars("samples_seen/droid")[-1].value == seen[0]
    with_sets = Image.open(plot(want, tmp_path / "sets.png", "mixture")).size
    without = Image.open(
        plot([{k: v for k, v in r.items() if "/" not in k} for r in want], tmp_path / "one.png", "one set")
    ).size
    assert with_sets[1] > without[1]  # a third row of panels: loss and samples seen per set

    metadata = json.loads((run_dir / "export" / "experiment_cfg" / "metadata.json").read_text())
    assert sorted(metadata) == ["libero_sim", "oxe_droid"]
    for shards, tag in ((droid_shards, "oxe_droid"), (libero_shards, "libero_sim")):
        assert metadata[tag] == json.loads((shards / "metadata.json").read_text())[tag]
