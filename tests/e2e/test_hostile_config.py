"""Hostile config files, flags and dataset metadata: each stops in one line (or, for a source dataset, fails only the
episode it concerns), in bounded time and memory, through the real CLIs."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from devtools.sample_data import write_sample_dataset
from wampipe.preprocess.check import check
from wampipe.preprocess.lerobot import LeRobotDataset
from tests.helpers import ROOT, build, manifest, tiny_model
from wampipe.train.dit.loss import FlowMatchScheduler, LossConfig, flow_matching_loss, sample_timestep_ids
from wampipe.train.dit.model import random_batch


MEMORY = 4 << 30  # address space of a CLI under test: torch's import fits, an alias bomb's expansion does not
LAUGHS = "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
BOMB = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + LAUGHS  # 9**9 strings


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _cli(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A CLI run under MEMORY; the timeout only detects a hang (a bounded run takes seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, preexec_fn=_limited
    )


def _one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0, done.stdout[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "name, text, reason",
    [
        ("bomb", BOMB + "train:\n  optim:\n    lr: *i\n", "line 6: more than 100000 values with aliases expanded"),
        ("latin1", "train:\n  steps: 3  # caf\xe9\n", "not UTF-8 text (byte 0xe9 at offset 24)"),
        ("deep", "train: " + "[" * 10_000 + "]" * 10_000 + "\n", "line 1: nested deeper than 64 levels"),
    ],
    ids=["alias-bomb", "latin1", "10000-deep"],
)
@pytest.mark.e2e
def test_hostile_yaml_stops_the_trainer_in_one_line(name, text, reason, tmp_path):
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(text.encode("latin-1" if name == "latin1" else "utf-8"))
    line = _one_line(_cli("train/main.py", "--config", str(path), "--data.shards", str(tmp_path)))
    assert line == f"{path}: {reason}"


@pytest.mark.e2e
def test_alias_bomb_stops_the_preprocessor_in_one_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB + "preprocess:\n  dataset: *i\n")
    line = _one_line(_cli("-m", "preprocess", "shards", "--config", str(path)))
    assert line == f"{path}: line 6: more than 100000 values with aliases expanded"


@pytest.mark.parametrize(
    "argv, file, message",
    [
        (["--optim.lr", "inf"], None, "invalid settings: --optim.lr inf (must be a finite number)"),
        (["--loss.shift", "nan"], None, "invalid settings: --loss.shift nan (must be a finite number)"),
        ([], "train:\n  optim:\n    lr: .inf\n", "{file}: train.optim.lr: inf is not a finite number"),
    ],
    ids=["lr-inf-flag", "shift-nan-flag", "lr-inf-file"],
)
@pytest.mark.e2e
def test_nonfinite_floats_are_refused_before_any_step(argv, file, message, small_shards, tmp_path):
    run_dir, config = tmp_path / "run", tmp_path / "config.yaml"
    if file:
        config.write_text(file)
        argv = ["--config", str(config)]
    line = _one_line(
        _cli(
            "train/main.py", *argv, "--data.shards", str(small_shards), "--checkpoint.dir", str(run_dir), "--steps", "2"
        )
    )
    assert line == message.format(file=config)
    assert not run_dir.exists()  # stopped before the run directory, so before any step


@pytest.mark.e2e
def test_bad_task_strings_fail_their_episodes_and_the_build_goes_on(tiny_checkpoints, tmp_path):
    src, out = write_sample_dataset(tmp_path / "src", "droid", episodes=5), tmp_path / "out"  # episode 1 is short
    hostile = {
        0: ("[]", "an empty list"),
        2: ("['" + "pick up the cup " * 655_360 + "']", "10485764 characters"),
        3: ("[" * 100_000 + "]" * 100_000, "200000 characters"),
    }  # episode -> its task, why it fails
    tasks_file, column = src / "meta" / "tasks.jsonl", "annotation.language.language_instruction"
    tasks = [json.loads(line) for line in tasks_file.read_text().splitlines()]
    for episode, (task, _) in hostile.items():  # a task of its own as the episode's first instruction
        tasks.append({"task_index": len(tasks), "task": task})
        data = LeRobotDataset(src).episode_info(episode).data_path
        table = pq.read_table(data)
        ids = pa.array([len(tasks) - 1] * table.num_rows, table.schema.field(column).type)
        pq.write_table(table.set_column(table.column_names.index(column), column, ids), data)
    tasks_file.write_text("".join(json.dumps(row) + "\n" for row in tasks))

    done = build(src, out, "droid", tiny_checkpoints)
    failures = {f["episode"]: f["reason"] for f in manifest(out)["failures"]}
    assert sorted(failures) == sorted(hostile)
    for episode, (_, why) in hostile.items():
        assert failures[episode].startswith(f"{tasks_file}: episode {episode}: {column} at row 0: ")
        assert why in failures[episode] and len(failures[episode]) < 300
        assert done.stdout.count(f"FAILED episode {episode}: ") == 1
    totals = manifest(out)["totals"]
    assert totals["episodes_encoded"] == 1 and totals["samples"] > 0 and check(out) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_loss_draws_timesteps_over_the_schedulers_length(small_shards, tmp_path):
    ids = sample_timestep_ids(4000, 9, 2, torch.Generator().manual_seed(0), num_timesteps=500)
    assert ids.min() == 0 and ids.max() == 499
    model = tiny_model()
    batch = random_batch(model.cfg, 4, (9, 4, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss, _ = flow_matching_loss(
            model, batch, FlowMatchScheduler(500), LossConfig(num_train_timesteps=500), torch.Generator().manual_seed(1)
        )
    assert torch.isfinite(loss)

    run_dir = tmp_path / "run"  # and through the trainer
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port())}
    done = subprocess.run(
        [
            sys.executable,
            "train/main.py",
            "--data.shards",
            str(small_shards),
            "--steps",
            "2",
            "--loss.num-train-timesteps",
            "500",
            "--checkpoint.dir",
            str(run_dir),
            "--checkpoint.no-export",
            "--checkpoint.no-save-final",
            "--metrics.interval",
            "1",
            "--metrics.no-progress",
            "--metrics.no-tensorboard",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
