"""Installed like a tool: the console scripts pyproject.toml declares, a lean base whose optional imports each stop
in one line naming their extra, and a shards command that needs its source."""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROJECT, ROOT, console_script
from train.launch import split_arguments

def _python(code: str, *argv: str, cwd=ROOT) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, as an installed console script would run it."""
    return _run([sys.executable, "-c", code, *argv], cwd)


def _run(cmd: list[str], cwd=ROOT) -> subprocess.CompletedProcess:
    """The timeout only detects a hang."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_shards_without_src_stops_in_one_line_and_writes_nothing(tmp_path):
    done = _python("from preprocess.__main__ import main; main()", "shards", "--out", str(tmp_path / "out"),
                   cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == ("--src is required: the LeRobot dataset root (sample data and tiny encoders to try it on: "
                           "make demo-data, or scripts/make_sample_dataset.py and scripts/make_tiny_checkpoints.py)\n")
    assert list(tmp_path.iterdir()) == []


def test_every_console_script_target_exists():
    assert sorted(PROJECT["scripts"]) == ["wampipe-check", "wampipe-inspect", "wampipe-preview", "wampipe-shards",
                                          "wampipe-stats", "wampipe-train"]
    for target in PROJECT["scripts"].values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target


@pytest.mark.parametrize("command, flag", [("shards", "--src"), ("check", "--members"), ("stats", "--embodiment"),
                                           ("inspect", "--decode"), ("preview", "--vae")])
def test_preprocess_scripts_run_their_command(command, flag):
    name = f"wampipe-{command}"
    installed = Path(sys.executable).parent / name  # pip's wrapper, once the environment was installed from here
    for done in [_python(console_script(name), "--help"),
                 *([_run([str(installed), "--help"])] if installed.exists() else [])]:
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: {name} ") and flag in done.stdout


def test_train_script_splits_torchrun_options_from_trainer_flags():
    assert split_arguments(["--nproc-per-node", "2", "--preset", "tiny", "--data.shards", "d"]) == (
        ["--standalone", "--nproc-per-node", "2"], ["--preset", "tiny", "--data.shards", "d"])
    assert split_arguments(["--nnodes=2", "--rdzv-endpoint", "h:1", "--", "--max-restarts", "x"]) == (
        ["--nnodes=2", "--rdzv-endpoint", "h:1"], ["--max-restarts", "x"])


def test_trainer_flags_and_torchrun_options_do_not_overlap():
    """Every trainer flag reaches the trainer without `--`: none is also a torchrun option."""
    from torch.distributed.run import get_args_parser

    done = _python("from train.main import main; main()", "--help")
    trainer = set(re.findall(r"^│ +(--[a-z][\w.-]*)", done.stdout, re.MULTILINE)) - {"--help"}  # its flag rows
    torchrun = {option for action in get_args_parser()._actions for option in action.option_strings}
    assert {"--preset", "--data.shards", "--steps"} <= trainer and torchrun & trainer == set()


@pytest.mark.slow
def test_train_script_launches_two_ranks(tiny_shards, tmp_path):
    run_dir = tmp_path / "run"
    done = _python(console_script("wampipe-train"), "--nproc-per-node", "2", "--preset", "tiny", "--data.shards",
                   str(tiny_shards), "--checkpoint.dir", str(run_dir), "--steps", "2", "--metrics.interval", "1",
                   "--metrics.no-progress", "--metrics.no-tensorboard", "--checkpoint.no-export")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [json.loads((run_dir / f"summary-rank{r:05d}.json").read_text())["steps"] for r in range(2)] == [2, 2]


# (missing module, code that needs it, the one line it stops with); tensorboard only degrades to metrics.jsonl
OPTIONAL = {
    "s3fs": ("from shardformat.storage import ShardStore; ShardStore('s3://bucket/shards').exists('manifest.json')",
             "s3://bucket/shards: s3:// URLs need s3fs: pip install 'wampipe[s3]'"),
    "ray": ("from preprocess.stream import run_ray; next(run_ray(None, {}, None))",
            "--executor ray needs ray: pip install 'wampipe[ray]'"),
    "torchao": ("from train.parallel import check_float8; check_float8('tensorwise', (9, 0))",
                "--parallel.float8 tensorwise needs torchao: pip install 'wampipe[fp8]'"),
    "matplotlib": ("from pathlib import Path; from train.curves import plot; plot([], Path('x.png'), 'run')",
                   "plotting curves needs matplotlib: pip install 'wampipe[plot]'"),
    "wandb": ("from train.config import MetricsConfig; from train.metrics import check_wandb\n"
              "check_wandb(MetricsConfig(wandb_project='test'))",
              "--metrics.wandb-project needs wandb: pip install 'wampipe[wandb]'"),
}


@pytest.mark.parametrize("module", OPTIONAL)
def test_a_missing_extra_stops_in_one_line_naming_it(module, tmp_path):
    code, line = OPTIONAL[module]
    done = _python(f"import sys; sys.modules[{module!r}] = None\n{code}", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (1, line + "\n")


def test_the_trainer_without_tensorboard_logs_jsonl_and_says_so_once(tmp_path):
    done = _python("import sys, torch; sys.modules['tensorboard'] = None\n"
                   "from pathlib import Path; from train.config import MetricsConfig; from train.metrics import "
                   "MetricsLogger\nMetricsLogger(MetricsConfig(progress=False), Path('run'), 0, torch.device('cpu'), "
                   "1, 0, 1.0, None, 1)", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ("tensorboard not installed: metrics go to metrics.jsonl and the console only "
                           "(pip install 'wampipe[plot]')\n")
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
