"""Installed like a tool: the console scripts pyproject.toml declares, a base install that builds shards and trains
with no extra present, each extra's feature naming the extra in one line where it is missing, base dependencies that
are what the code imports, and a shards command that needs its source."""

import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    BASE_REQUIREMENTS,
    EXTRA_REQUIREMENTS,
    ROOT,
    WHEEL_PACKAGES,
    console_script,
    normalized_name,
    requirement_closure,
    shards_cmd,
    unexpected,
)


def _python(code: str, *argv: str, cwd=ROOT) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, as an installed console script would run it."""
    return _run([sys.executable, "-c", code, *argv], cwd)


def _run(cmd: list[str], cwd=ROOT) -> subprocess.CompletedProcess:
    """The timeout only detects a hang."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.e2e
def test_shards_without_src_stops_in_one_line_and_writes_nothing(tmp_path):
    done = _python(
        "from wampipe.preprocess.__main__ import main; main()", "shards", "--out", str(tmp_path / "out"), cwd=tmp_path
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (
        "--src is required: the LeRobot dataset root (sample data and tiny encoders to try it on: "
        "make demo-data, or scripts/make_sample_dataset.py and scripts/make_tiny_checkpoints.py)\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
@pytest.mark.parametrize(
    "command, flag",
    [
        ("shards", "--src"),
        ("check", "--members"),
        ("stats", "--embodiment"),
        ("inspect", "--decode"),
        ("preview", "--vae"),
    ],
)
def test_preprocess_scripts_run_their_command(command, flag):
    name = f"wampipe-{command}"
    installed = Path(sys.executable).parent / name  # pip's wrapper, once the environment was installed from here
    for done in [
        _python(console_script(name), "--help"),
        *([_run([str(installed), "--help"])] if installed.exists() else []),
    ]:
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: {name} ") and flag in done.stdout


@pytest.mark.e2e
def test_trainer_flags_and_torchrun_options_do_not_overlap():
    """Every trainer flag reaches the trainer without `--`: none is also a torchrun option."""
    from torch.distributed.run import get_args_parser

    done = _python("from wampipe.train.main import main; main()", "--help")
    trainer = set(re.findall(r"^│ +(--[a-z][\w.-]*)", done.stdout, re.MULTILINE)) - {"--help"}  # its flag rows
    torchrun = {option for action in get_args_parser()._actions for option in action.option_strings}
    assert {"--preset", "--data.shards", "--steps"} <= trainer and torchrun & trainer == set()


@pytest.mark.slow
def test_train_script_launches_two_ranks(tiny_shards, tmp_path):
    run_dir = tmp_path / "run"
    done = _python(
        console_script("wampipe-train"),
        "--nproc-per-node",
        "2",
        "--preset",
        "tiny",
        "--data.shards",
        str(tiny_shards),
        "--checkpoint.dir",
        str(run_dir),
        "--steps",
        "2",
        "--metrics.interval",
        "1",
        "--metrics.no-progress",
        "--metrics.no-tensorboard",
        "--checkpoint.no-export",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [json.loads((run_dir / f"summary-rank{r:05d}.json").read_text())["steps"] for r in range(2)] == [2, 2]


def hide_extras(folder: Path) -> Path:
    """A sitecustomize.py in `folder` that makes every module of the extras, and of what they alone bring, absent
    for the interpreter (and the processes it starts, through PYTHONPATH): `import x` raises ImportError and
    importlib.util.find_spec(x) says None, as in an environment installed without them."""
    hidden = requirement_closure(set().union(*EXTRA_REQUIREMENTS.values())) - requirement_closure(BASE_REQUIREMENTS)
    modules = sorted(
        {
            m
            for m, dists in importlib.metadata.packages_distributions().items()
            if any(normalized_name(d) in hidden for d in dists) and m.isidentifier()
        }
    )
    assert {"s3fs", "ray", "torchao", "wandb", "matplotlib", "tensorboard", "moto", "wids"} <= set(modules)
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({modules!r}))\n")
    return folder


# what asking for each extra's feature without it prints: one line
NEEDS = {
    "s3": "s3://bucket/shards: s3:// URLs need s3fs: pip install 'wampipe[s3]'",
    "ray": "--executor ray needs ray: pip install 'wampipe[ray]'",
    "fp8": "--parallel.float8 tensorwise needs torchao: pip install 'wampipe[fp8]'",
    "wandb": "--metrics.wandb-project needs wandb: pip install 'wampipe[wandb]'",
    "plot": "plotting curves needs matplotlib: pip install 'wampipe[plot]'",
    "plot (preview)": "preview sheets need matplotlib: pip install 'wampipe[plot]'",
}


@pytest.mark.slow
def test_the_base_install_builds_shards_and_trains_and_each_extra_is_named_where_missing(
    droid_root, tiny_checkpoints, tmp_path
):
    """`pip install .` without extras (the wheel's files, installed with --target), every extra's packages hidden:
    the farm builds and checks shards of local data, a 1-rank run of the tiny recipe trains on them, and each extra's
    feature asked for stops in its one line."""
    source = tmp_path / "source"  # pip builds in the tree it installs: a copy keeps the checkout clean
    for package in ("wampipe", *WHEEL_PACKAGES):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    env = {**os.environ, "PYTHONPATH": f"{hide_extras(tmp_path / 'hide')}{os.pathsep}{site}", "OMP_NUM_THREADS": "1"}
    work = tmp_path / "work"
    work.mkdir()

    def run(*argv: str) -> subprocess.CompletedProcess:  # the timeout only detects a hang
        return subprocess.run([sys.executable, *argv], cwd=work, env=env, capture_output=True, text=True, timeout=600)

    where = run("-c", "import wampipe.preprocess as p, wampipe.train as t; print(p.__file__, t.__file__)")
    assert where.stdout.split() == [str(site / "wampipe" / name / "__init__.py") for name in ("preprocess", "train")]
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith((".dist-info", "bin"))) == ["wampipe"]
    shards = work / "shards"
    built = run(*shards_cmd(droid_root, shards, "droid", tiny_checkpoints)[1:])
    assert built.returncode == 0, built.stderr[-3000:]
    checked = run("-m", "wampipe.preprocess", "check", str(shards))
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    run_dir = work / "run"
    trained = run(
        "-c",
        console_script("wampipe-train"),
        "--nproc-per-node",
        "1",
        "--preset",
        "tiny",
        "--data.shards",
        str(shards),
        "--checkpoint.dir",
        str(run_dir),
        "--steps",
        "2",
        "--metrics.interval",
        "1",
        "--metrics.no-progress",
        "--checkpoint.no-export",
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert trained.stdout.count("tensorboard not installed") == 1  # the plot extra's TensorBoard: said once

    trainer = [
        str(site / "wampipe" / "train" / "main.py"),
        "--preset",
        "tiny",
        "--data.shards",
        str(shards),
        "--steps",
        "1",
    ]
    asked = {
        "s3": run("-m", "wampipe.preprocess", "check", "s3://bucket/shards"),
        "ray": run(*shards_cmd(droid_root, work / "ray", "droid", tiny_checkpoints, "--executor", "ray")[1:]),
        "fp8": run(*trainer, "--checkpoint.dir", str(work / "fp8"), "--parallel.float8", "tensorwise"),
        "wandb": run(*trainer, "--checkpoint.dir", str(work / "wandb"), "--metrics.wandb-project", "test"),
        "plot": run(str(ROOT / "scripts" / "plot_metrics.py"), str(run_dir)),
        "plot (preview)": run("-m", "wampipe.preprocess", "preview", str(shards), "--vae", str(tiny_checkpoints)),
    }
    assert {extra: (done.returncode, unexpected(done.stderr)) for extra, done in asked.items()} == {
        extra: (1, [line]) for extra, line in NEEDS.items()
    }  # progress bars aside (the units' before ray's line)
