"""What the tests share besides fixtures (those live in tests/conftest.py): the checkout's paths, the commands the
tests run (a tiny shard build, the tiny trainer), readers of what the tools write, and waiting on real processes."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from wampipe.train.dit.model import CausalWanModel, build_model, preset

# ---------------------------------------------------------------- paths, shard builds and shard directories

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "tests" / "assets"  # the stored reference outputs the tests compare against


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


# small, quick builds: few anchors, several units and shards
# Builders import what they build with when called: spawned test workers import this module too.
FAST = ["--anchor-stride", "16", "--samples-per-shard", "4", "--episodes-per-unit", "2", "--batch-size", "2"]


def once(tmp_path_factory, name: str, make: Callable[[Path], Path]) -> Path:
    """`make(folder)` run once per test run: under pytest-xdist the first test process to take the lock makes it in a
    folder every process of the run sees, and the others wait for it and use it. A failed `make` leaves no mark, so the
    next process tries again in a fresh folder."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each process has its own base; their parent is this run's
        base = base.parent / "shared"
        base.mkdir(exist_ok=True)
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = base / f"{name}.done"
        if done.is_file():
            return Path(done.read_text())
        folder = base / f"{name}-{uuid.uuid4().hex[:8]}"
        folder.mkdir()
        made = make(folder)
        done.write_text(str(made))
        return made


def shards_cmd(src: Path, out: Path | str, dataset: str, tiny: Path, *extra: str, model: str = "5b") -> list[str]:
    """`python -m preprocess shards` of `src` with the tiny checkpoints and FAST settings."""
    from devtools.tiny_checkpoints import tiny_checkpoint_paths
    from wampipe.preprocess.pipeline import VAE_OF_MODEL

    paths = tiny_checkpoint_paths(tiny, VAE_OF_MODEL[model])
    weights = [a for name, p in paths.items() for a in (f"--{name.replace('_', '-')}", str(p))]
    return [
        sys.executable,
        "-m",
        "wampipe.preprocess",
        "shards",
        "--dataset",
        dataset,
        "--src",
        str(src),
        "--out",
        str(out),
        "--model",
        model,
        *weights,
        *FAST,
        *extra,
    ]


def console_script(name: str) -> str:
    """Python that runs console script `name` as pip's generated wrapper does: import its target, call it."""
    module, function = PROJECT["scripts"][name].split(":")
    return f"import sys; sys.argv[0] = {name!r}; from {module} import {function}; sys.exit({function}())"


def build(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(shards_cmd(*args, **kwargs), cwd=ROOT, capture_output=True, text=True, check=True)


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def reindex(root: Path) -> None:
    """Write the sample index again from the shard JSONs and seal the manifest over it, as anyone who edits a shard
    directory can."""
    from wampipe.shardformat.manifest import Manifest
    from wampipe.shardformat.samples import write_sample_index
    from wampipe.shardformat.shard import ShardRecord, json_path

    m = Manifest.read(root)
    m.sample_index = write_sample_index(root, [ShardRecord.read(root / json_path(e.shard)).to_dict() for e in m.shards])
    m.write(root)


def edit_index(root: Path, edit) -> None:
    """Apply `edit` to the rows of the sample index (a numpy structured array), write it and seal the manifest over
    it again."""
    import numpy as np

    from wampipe.shardformat.manifest import Manifest
    from wampipe.shardformat.samples import write_index

    m = Manifest.read(root)
    rows = np.load(root / m.sample_index["file"])
    edit(rows)
    m.sample_index = {**m.sample_index, **write_index(root / m.sample_index["file"], rows, m.sample_index["members"])}
    m.write(root)


def tiny_model(**overrides) -> CausalWanModel:
    """The tiny DiT, seeded, with a random output head (the reference zero-inits it; gradients need a path)."""
    torch.manual_seed(0)
    model = build_model("tiny", **overrides)
    with torch.no_grad():
        model.head.head.weight.normal_(0, 0.02)
    return model


def shard_samples(tar: Path) -> list[tuple[str, dict[str, bytes]]]:
    """(key, {suffix: bytes}) of every sample of a tar, as the integrity check reads them."""
    from wampipe.preprocess.check import tar_samples

    with open(tar, "rb") as f:
        return list(tar_samples(f))


def fill_disk(disk: Path, leave: int) -> Path:
    """Allocate all of `disk` but `leave` bytes to one file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        free = os.statvfs(disk)
        os.posix_fallocate(fd, 0, free.f_bavail * free.f_frsize - leave)
    finally:
        os.close(fd)
    return filler


# ---------------------------------------------------------------- what the tools print

# what a build may print on stderr: tqdm's progress bars (carriage-return redrawn lines; their names may hold a
# dataset folder's, any character but a colon)
PROGRESS = re.compile(r"^[^:]*:\s+\d+%\|")


HELP_SUFFIX = re.compile(r"\s*\((default: .*|required|fixed to: .*)\)$")  # what tyro adds to a field's own help


# below 130 columns tyro lays the help boxes out in one column, whose rows `flag_help` reads
HELP_ENV = {**os.environ, "COLUMNS": "100"}


def unexpected(stderr: str) -> list[str]:
    lines = [part.strip() for line in stderr.splitlines() for part in line.split("\r")]
    return [line for line in lines if line and not PROGRESS.match(line)]


def flag_help(stdout: str) -> dict[str, list[tuple[str, int]]]:
    """Each flag row of tyro's help boxes -> its help lines, each with the room its box had for it."""
    flags, current = {}, None
    for line in stdout.splitlines():
        if not (line.startswith("│") and line.endswith("│")):
            current = None
            continue
        inner = line[2:-2]  # inside the border and its one-space padding
        text = inner.rstrip()
        indent = len(text) - len(text.lstrip())
        if indent == 0:  # a flag row (its help beside it or on the lines below), a positional or a group's text
            row = re.match(r"(-\S.*?)(?:\s{2,}(\S.*))?$", text)
            current = flags.setdefault(row.group(1), []) if row else None
            if row and row.group(2):
                assert current is not None  # the row's entry, set just above
                current.append((row.group(2), len(inner) - row.start(2)))
        elif current is not None:
            current.append((text.lstrip(), len(inner) - indent))
    return flags


def help_problems(stdout: str) -> list[str]:
    """Flags without help of their own, and help lines broken where the next word would have fit (a source line's
    end kept in the help: a sentence cut in two)."""
    found = []
    for flag, lines in flag_help(stdout).items():
        if not HELP_SUFFIX.sub("", " ".join(text for text, _ in lines)).strip():
            found.append(f"{flag}: no help")
        for (text, room), (following, _) in zip(lines, lines[1:]):
            if following and len(text) + 1 + len(following.split()[0]) < room:
                found.append(f"{flag}: a line break after {text[-30:]!r}")
    return found


def check_help(done: subprocess.CompletedProcess) -> None:
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-2000:]
    assert "--help" in done.stdout and help_problems(done.stdout) == []


# ---------------------------------------------------------------- the tiny trainer

TRAINER_STEPS = 24


def tiny_torchrun(*args: str, ranks: int = 2) -> list[str]:
    """`torchrun --standalone --nproc-per-node=ranks train/main.py --preset tiny args...` from the checkout."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return [*run, str(ROOT / "train" / "main.py"), "--preset", "tiny", *args]


def trainer_command(shards: Path | None, run_dir: Path) -> list[str]:
    return tiny_torchrun(
        *(["--data.shards", str(shards)] if shards else []),
        "--checkpoint.dir",
        str(run_dir),
        "--steps",
        str(TRAINER_STEPS),
        "--checkpoint.interval",
        "8",
        "--metrics.interval",
        "1",
        "--metrics.no-progress",
        "--metrics.no-tensorboard",
        "--parallel.deterministic",
        "--checkpoint.export-dtype",
        "float32",
    )


def trainer_env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (ranks, loader workers), from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, todo = set(), [pid]
    while todo:
        pid = todo.pop()
        kids = {p for p, parent in parents.items() if parent == pid}
        found |= kids
        todo += kids
    return found


# ---------------------------------------------------------------- weight files


def rewrite_weights(base: Path, out: Path, edit) -> Path:
    """A copy of `base` whose tensors went through `edit(dict) -> dict`, as one file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir()
    sd = {}
    for f in sorted(base.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            sd.update({k: h.get_tensor(k) for k in h.keys()})
    save_file(edit(sd), str(out / "model.safetensors"))
    return out


# ---------------------------------------------------------------- the tiny DiT

TINY = preset("tiny")


# ---------------------------------------------------------------- edited shard directories


def reseal(path: Path, edit) -> None:
    """Apply `edit` to a sealed JSON file's content and seal it again."""
    from wampipe.shardformat.manifest import write_sealed_json

    obj = json.loads(path.read_text())
    obj.pop("content_sha256")
    edit(obj)
    write_sealed_json(path, obj)


def refused(root, cache_dir=None) -> str:
    """The one line the trainer's data entry stops with."""
    from wampipe.shardformat.manifest import ShardFormatError
    from wampipe.train.data import ShardIndex

    with pytest.raises(ShardFormatError) as stop:
        ShardIndex(root, cache_dir)
    message = str(stop.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- refusals and processes


def tree(out: Path) -> dict[str, tuple[int, int]]:
    """Every file but the lock, with size and mtime: what a refused run must leave as it was."""
    from wampipe.preprocess.outdir import LOCK

    return {
        p.relative_to(out).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in out.rglob("*")
        if p.is_file() and p.name != LOCK
    }


def refusal(argv: list[str]) -> str:
    """The message of a run that must refuse to start (the real CLI entry, in this process)."""
    from wampipe.preprocess.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(argv[3:])  # drop `python -m preprocess`
    return str(exc.value)


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError):
            continue  # the process ended while we looked
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(condition, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---------------------------------------------------------------- statistics of the sample DROID dataset


def parquet_columns(root: Path, column: str) -> list[np.ndarray]:
    """Per episode [L, d] arrays straight from the parquet files (v2 layout: one file per episode)."""
    import pyarrow.parquet as pq

    files = sorted((root / "data").glob("chunk-*/episode_*.parquet"))
    return [np.stack(pq.read_table(f, columns=[column]).column(column).to_pylist()) for f in files]


def direct(values: np.ndarray) -> dict:
    return {
        "max": values.max(0),
        "min": values.min(0),
        "mean": values.mean(0),
        "std": values.std(0),
        "q01": np.quantile(values, 0.01, axis=0),
        "q99": np.quantile(values, 0.99, axis=0),
    }


def assert_stats(got: dict, expected: dict) -> None:
    assert list(got) == ["max", "min", "mean", "std", "q01", "q99"]
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def corrupt_droid(src: Path, dst: Path) -> Path:
    """A copy of the sample DROID dataset with two bad episodes: a NaN in episode 0's state, and episode 3's parquet
    ten rows shorter than meta/ says."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(src, dst)
    nan = dst / "data/chunk-000/episode_000000.parquet"
    table = pq.read_table(nan)
    column = table.schema.get_field_index("observation.state")
    state = table.column(column).to_pylist()
    state[5][3] = float("nan")
    field = table.schema.field(column)
    pq.write_table(table.set_column(column, field, pa.array(state, field.type)), nan)
    short = dst / "data/chunk-000/episode_000003.parquet"
    pq.write_table(pq.read_table(short).slice(0, 123), short)  # meta says 133
    return dst


def assert_good_episode_statistics(metadata: dict, root: Path, good: list[int]) -> None:
    """State and relative-action statistics equal a direct computation over the `good` episodes only."""
    state_eps = [parquet_columns(root, "observation.state")[i] for i in good]
    action_eps = [parquet_columns(root, "action")[i] for i in good]
    stats = metadata["oxe_droid"]["statistics"]
    assert_stats(stats["state"]["joint_position"], direct(np.concatenate(state_eps).astype(np.float32)[:, 7:14]))
    relative = [
        a[i + k, 14:21] - s[i, 7:14]
        for s, a in zip(state_eps, action_eps)
        for i in range(len(s) - 23)
        for k in range(24)
    ]
    assert_stats(stats["action"]["joint_position"], direct(np.array(relative)))
