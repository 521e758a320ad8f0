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
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from wampipe.train.dit.model import CausalWanModel, build_model, preset

if TYPE_CHECKING:  # annotations only: the selection is imported where it runs
    from wampipe.preprocess.selection import Filters

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


# ---------------------------------------------------------------- exports, shard paths, imports and the install


def edit_export_conf(folder: Path, edit) -> None:
    """An eval-ready export's experiment_cfg/conf.yaml put through `edit(dict)` in place."""
    import yaml

    path = folder / "experiment_cfg" / "conf.yaml"
    conf = yaml.safe_load(path.read_text())
    edit(conf)
    path.write_text(yaml.safe_dump(conf))


def copy_tree(base: Path, out: Path) -> Path:
    """A copy of the folder `base` at `out`."""
    shutil.copytree(base, out)
    return out


def outside_path_refusal(manifest: Path | str, field: str, name: str) -> str:
    """The refusal of the manifest at `manifest` whose `field` names `name`."""
    pattern = r".+\.safetensors" if field == "text_table.file" else r".+\.json"
    return (
        f"{manifest}: {field} {name!r} is not a relative path of the form {pattern} inside the shard directory "
        f"(crafted or corrupt): rebuild the shards"
    )


# product package -> the packages it must not import
FORBIDDEN_IMPORTS = {
    "train": ("preprocess", "devtools"),
    "configs": ("train", "preprocess", "devtools"),
    "preprocess": ("train", "devtools"),
    "shardformat": ("train", "preprocess", "devtools"),
    "encoders": ("train", "preprocess", "devtools"),
}


def normalized_name(name: str) -> str:
    """A distribution name as the packaging rules compare it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    """Distribution names of `requirements` whose markers hold without any extra asked for."""
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in requirements]
    return {normalized_name(r.name) for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})}


def requirement_closure(names: set[str]) -> set[str]:
    """`names` and every distribution they require, as installed here."""
    import importlib.metadata

    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += requirement_names(importlib.metadata.requires(name) or [])
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


WHEEL_PACKAGES = ("configs", "encoders", "preprocess", "shardformat", "train")  # what the wheel holds


BASE_REQUIREMENTS = requirement_names(PROJECT["dependencies"])


EXTRA_REQUIREMENTS = {
    extra: requirement_names(reqs) - {"wampipe"} for extra, reqs in PROJECT["optional-dependencies"].items()
}


# ---------------------------------------------------------------- LoRA, metrics rows and the loader


def merge_lora(state_dict: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """A full state dict with `<layer>.lora_A` / `<layer>.lora_B` folded into `<layer>.weight` (scale alpha / rank,
    the rank read from lora_A) and the adapter keys dropped: plain weights."""
    from wampipe.train.dit.lora import ADAPTERS, fold

    out = {k: v for k, v in state_dict.items() if not k.endswith(tuple("." + a for a in ADAPTERS))}
    for key, a in state_dict.items():
        if key.endswith(".lora_A"):
            layer = key[: -len(".lora_A")]
            out[layer + ".weight"] = fold(
                state_dict[layer + ".weight"], a, state_dict[layer + ".lora_B"], alpha / a.shape[0]
            ).to(state_dict[layer + ".weight"].dtype)
    return out


def metrics_row(step: int, loss: float) -> dict:
    """A metrics.jsonl row with the fields train/metrics.py writes."""
    return {
        "step": step,
        "loss": loss,
        "loss_dynamics": 0.9 * loss,
        "loss_action": 0.1 * loss,
        "grad_norm": 1.0,
        "lr": 1e-4 * min(1, step / 4),
        "samples_per_s_per_gpu": 3.0 + step % 3,
        "data_wait_pct": 0.5,
        "time": 1.0e9 + step,
    }


# ---------------------------------------------------------------- DreamZero's DROID episode selection

DROID_KEY = "{recording_folderpath}--{file_path}"  # how DreamZero's keep-ranges file names an episode
LANGUAGE_KEYS = ("language_instruction", "language_instruction_2", "language_instruction_3")


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def official_selection(root: Path, ranges_file: Path, filter_failed: bool = True) -> dict[int, list]:
    """DreamZero's first pass over DROID (dreamzero0/dreamzero scripts/data/convert_droid.py:448-497), re-stated over
    the LeRobot files read directly: every episode in read order; with --filter-failed an episode whose rewards are
    all zero is filtered; each of the three instructions at step 0 registers in one run-wide table, seeded with "not
    provided", when it is longer than one character and not yet in it, and an episode none of whose instructions
    registered is filtered (the check runs on filtered episodes too); the keep ranges are looked up by
    f"{recording_folderpath}--{file_path}" (a missing key raises) and an empty list filters the episode. Returns the
    kept episodes' ranges, in read order."""
    import pyarrow.parquet as pq

    tasks = {row["task_index"]: row["task"] for row in read_jsonl(root / "meta/tasks.jsonl")}
    all_tasks = {"not provided": 0}
    all_keep_ranges = json.loads(ranges_file.read_text())
    kept = {}
    for row in read_jsonl(root / "meta/episodes.jsonl"):
        table = pq.read_table(root / f"data/chunk-000/episode_{row['episode_index']:06d}.parquet")
        filtered = False
        if filter_failed and not np.any(table.column("next.reward").to_numpy() != 0):
            filtered = True
        has_lang = False
        for lang_key in LANGUAGE_KEYS:
            task = tasks[table.column(f"annotation.language.{lang_key}")[0].as_py()]
            if task and len(task) > 1 and task not in all_tasks:
                has_lang = True
                all_tasks[task] = len(all_tasks)
        if not has_lang:
            filtered = True
        keep_ranges = all_keep_ranges[f"{row['recording_folderpath']}--{row['file_path']}"]
        if len(keep_ranges) == 0:
            filtered = True
        if not filtered:
            kept[row["episode_index"]] = keep_ranges
    return kept


def official_rows(ranges) -> np.ndarray:
    """The rows a kept episode keeps (convert_droid.py:253-257, 294-313): each [start, end) slice, concatenated."""
    return np.concatenate([np.arange(start, end) for start, end in ranges])


def official_filters(ranges_file: Path, **overrides) -> Filters:
    """The selection's filters as DreamZero's DROID conversion applies them, with `overrides`."""
    from wampipe.preprocess.selection import Filters

    return Filters(
        **{
            "keep_ranges": str(ranges_file),
            "keep_ranges_key": DROID_KEY,
            "drop_failed": True,
            "require_language": "official",
            **overrides,
        }
    )


def select_episodes(root: Path, filters: Filters, episodes: list[int] | None = None):
    """The selection of `episodes` (all by default) of the dataset at `root` under `filters`, in this process."""
    from wampipe.preprocess.lerobot import LeRobotDataset
    from wampipe.preprocess.selection import select

    ds = LeRobotDataset(root)
    return select(ds, filters, ds.episode_indices if episodes is None else episodes, workers=1)


def write_ranges(tmp_path: Path, content) -> Path:
    """A keep-ranges file holding `content` (text, or what JSON encodes)."""
    path = tmp_path / "ranges.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# ---------------------------------------------------------------- foreign files, and the loader

# files at the names a build writes that no build of ours wrote, and how a tool refuses them
FOREIGN = {
    "manifest.json": b"{}\n",
    "metadata.json": b'{"mine": 1}\n',
    "wids.json": b"{}\n",
    "shard-000000.tar": b"not a wampipe shard",
}


FOREIGN_REFUSAL = (
    "{where} holds files that no wampipe build recorded, at names a build writes: {names}. Nothing was "
    "deleted; move them away or use another --out (--overwrite deletes only a build's own files)"
)


def tiny_loader(shards, rank=0, world=2, workers=0, **kw):
    """The trainer's loader over `shards` for the tiny DiT: micro-batches of 2, rank `rank` of `world`."""
    from wampipe.train.config import DataConfig
    from wampipe.train.data import ShardLoader

    return ShardLoader(
        DataConfig(shards=shards, micro_batch_size=2, num_workers=workers, **kw),
        TINY,
        rank,
        world,
        torch.device("cpu"),
    )


def take(it, n):
    """The next `n` items of the iterator `it`."""
    return [next(it) for _ in range(n)]
