"""Distributed checkpoints (torch.distributed.checkpoint) and the consolidated weight export.

    <dir>/step-000120/   .metadata (written last by DCP: present = complete), *.distcp (trainable parameters +
                         optimizer shards; a LoRA run's frozen base is rebuilt from --model.init-from),
                         rank-00000.json + .safetensors ... (per rank: step, model config, data position, RNG
                         state; written first)
    <dir>/export/        model.safetensors (+ index when sharded), official key names; with --checkpoint.export-base
                         an eval-ready DreamZero checkpoint folder (train/dit/export.py)

A step directory is complete when it holds `.metadata`, every file the metadata names (at least as long as the data it
places there), and for each of the world size its rank-00000.json records a rank JSON of that step and a sound
safetensors file. A run resumes from the newest complete step directory; rank 0 names each newer one it skips and
what it lacks (a save killed midway, a lost rank's files, a truncated file), and a damaged one with none complete
before it is refused. The oldest complete ones beyond `keep_last` are deleted after each save. Weights with a NaN or
Inf are never saved; a save that fails (a full disk) removes its step directory and stops every rank with one line.

The run directory (`--checkpoint.dir`) is the run's: rank 0 holds an exclusive flock on `.lock` for the process's
life, and the trainer writes and deletes only the names in RUN_FILES there. A directory without the `.wampipe-run`
marker is taken only when it holds none of those names (files of other names are left alone).
Loading runs no code from the checkpoint: the per-rank state is JSON and safetensors, DCP's pickled .metadata is
read by an unpickler that admits only DCP's metadata classes, and its pickled optimizer values (lr, betas, ...)
load as plain data (torch.load weights_only).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import uuid
from dataclasses import asdict
from fnmatch import fnmatch
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save as safetensors_bytes
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from wampipe.errors import RunError, WampipeError
from wampipe.shardformat.files import atomic_write_bytes, free_space, lock_directory
from wampipe.train.config import CheckpointConfig
from wampipe.train.dit.export import foreign_files
from wampipe.train.dit.lora import lora_fields

if TYPE_CHECKING:
    from wampipe.train.dit.model import DiTConfig

STEP_DIR = re.compile(r"^step-(\d+)$")
MARKER = ".wampipe-run"
LOCK = ".lock"
RUN_ID = "run-id"  # the run's identity, recorded in each checkpoint it saves
# Everything the trainer writes at the top of a run directory (glob patterns); it touches nothing else there.
RUN_FILES = (
    MARKER,
    LOCK,
    RUN_ID,
    "config.yaml",
    "metrics.jsonl",
    "tb",
    "wandb",
    "export",
    "step-*",
    "summary-rank*.json",
    "profile-rank*.txt",
    "trace-rank*.json.gz",
    ".*.tmp",
    ".export.old",
)
# Frozen parameters (a LoRA run's base DiT) are not saved: the run rebuilds them from its seed or --model.init-from.
# Loading is then not strict about them; dcp.load itself still requires every saved (trainable) key.
TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)
_held_locks: list[int] = []  # the run directory's lock, open (held) until the process exits
_run: list[str] = []  # this process's run identity, once claim_run_dir has shared it


def _stop_if_any(error: str | None, remove: Path | None = None, describe=lambda first: first) -> None:
    """Collective: when any rank reports an error, rank 0 deletes `remove` (what the failed step had begun to write)
    and every rank stops; rank 0 prints `describe(first error)`, one line for the run."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first is None:
        return
    message = describe(first) if dist.get_rank() == 0 else ""  # before the removal: the free space it names
    if remove is not None and dist.get_rank() == 0:
        shutil.rmtree(remove, ignore_errors=True)
    raise RunError(message)


def claim_run_dir(cfg: CheckpointConfig) -> None:
    """Collective, before any work: rank 0 makes `cfg.dir` this run's directory (module docstring) and locks it for
    the process's life; a directory in use by another run, or holding files the trainer did not write, stops every
    rank with one line."""
    error, identity = None, [""]
    if dist.get_rank() == 0:
        try:
            _held_locks.append(_claim(Path(cfg.dir), cfg.export))
            if not cfg.resume:
                start_over(Path(cfg.dir))
            identity = [_identity(Path(cfg.dir), fresh=not cfg.resume)]
        except WampipeError as e:  # a RunError, or the lock's own one line
            error = str(e)
        except OSError as e:
            error = f"{cfg.dir}: cannot claim the run directory ({e}): pass another --checkpoint.dir"
    _stop_if_any(error)
    dist.broadcast_object_list(identity, src=0)
    _run[:] = identity


def run_identity(root: Path) -> str | None:
    """The identity recorded in run directory `root` (None: none yet, a directory of an older wampipe)."""
    try:
        return (Path(root) / RUN_ID).read_text().strip() or None
    except OSError:
        return None


def _identity(root: Path, fresh: bool) -> str:
    """This run's identity: the directory's own when resuming, a new one for a fresh start (--checkpoint.no-resume)
    or a directory that has none. A checkpoint records it; one recording another (a step directory copied in from
    another run) is not this run's: resume, rotation and train.evaluate pass it by."""
    found = run_identity(root)
    if found is None or fresh:
        found = uuid.uuid4().hex
        atomic_write_bytes(root / RUN_ID, f"{found}\n".encode())
    return found


def start_over(root: Path) -> None:
    """--checkpoint.no-resume: the step directories an earlier run left in this (claimed, locked) run directory are
    deleted before the first step, so no later rotation, resume or evaluation can take one for this run's."""
    earlier = _step_dirs(root)
    for _, path in earlier:
        shutil.rmtree(path)
    if earlier:
        print(
            f"--checkpoint.no-resume: deleted the {len(earlier)} step directories of an earlier run in {root} "
            f"({', '.join(p.name for _, p in earlier[:5])}{', ...' if len(earlier) > 5 else ''})",
            flush=True,
        )


def _claim(root: Path, export: bool) -> int:
    root.mkdir(parents=True, exist_ok=True)
    marked = (root / MARKER).is_file()
    if not marked:
        ours = sorted(p.name for p in root.iterdir() if p.name != LOCK and any(fnmatch(p.name, f) for f in RUN_FILES))
        if ours:
            raise RunError(
                f"{root} holds {', '.join(ours[:5])} but is not a wampipe run directory (no {MARKER}): "
                f"pass a new or empty --checkpoint.dir"
            )
    foreign = foreign_files(root / "export") if export else []
    if foreign:
        raise RunError(
            f"{root / 'export'} holds {', '.join(foreign[:5])}, which no export writes: the export would "
            f"replace the folder, so move them out of it (or pass --checkpoint.no-export)"
        )
    fd = lock_directory(root / LOCK, "training run", "pass another --checkpoint.dir")
    if not marked:
        atomic_write_bytes(
            root / MARKER,
            b"a wampipe training run directory: the trainer writes and deletes only "
            b"the files it names here (docs/TRAINING.md)\n",
        )
    return fd


def release_run_dir() -> None:
    """Unlock the run directory (a process that ends releases it anyway)."""
    while _held_locks:
        os.close(_held_locks.pop())


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint, oldest first."""
    return [(s, p) for s, p in _step_dirs(root) if not step_problems(p, s)]


def resumable(root: Path) -> list[tuple[int, Path]]:
    """Collective: `complete_checkpoints` as rank 0 finds them, on every rank. Rank 0 names each step directory newer
    than the newest complete one and what it lacks; a damaged one (it has .metadata) with no complete one before it
    stops the run."""
    shared: list[list[tuple[int, Path]] | None] = [None]
    error = None
    if dist.get_rank() == 0:
        damaged = None
        for step, path in reversed(_step_dirs(root)):
            problems = step_problems(path, step)
            if not problems:
                break
            print(f"{path} skipped, not a complete checkpoint: {'; '.join(problems)}", flush=True)
            if damaged is None and (path / ".metadata").is_file():
                damaged = path
        shared = [complete_checkpoints(root)]
        if damaged and not shared[0]:
            error = (
                f"{damaged}: not a complete checkpoint and none before it: restore its files, or pass "
                f"--checkpoint.no-resume to start over (deleting its step directories)"
            )
    _stop_if_any(error)
    dist.broadcast_object_list(shared, src=0)
    return cast("list[tuple[int, Path]]", shared[0])  # rank 0's list, on every rank now


def step_problems(path: Path, step: int) -> list[str]:
    """What keeps step directory `path` from being a complete checkpoint of `step` (module docstring); [] = none."""
    if not (path / ".metadata").is_file():
        return ["no .metadata (a save that did not finish)"]
    problems, missing = [], []
    try:
        with open(path / ".metadata", "rb") as f:
            storage = _MetadataUnpickler(f).load().storage_data
        needed: dict[str, int] = {}
        for info in storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # damage to a pickle shows as any of many errors (none runs code: the unpickler admits none)
        return [f".metadata unreadable ({_first_line(e)})"]
    for name, size in sorted(needed.items()):
        if not (path / name).is_file():
            missing.append(name)
        elif (path / name).stat().st_size < size:
            problems.append(f"{name} truncated ({(path / name).stat().st_size} of {size} bytes)")
    world, ours = _recorded_world(path), run_identity(path.parent)
    if world is None:
        problems.append("no readable rank-NNNNN.json recording the world size")
    for rank in range(world or 0):
        state, tensors = path / f"rank-{rank:05d}.json", path / f"rank-{rank:05d}.safetensors"
        for file, read in ((state, _read_state), (tensors, lambda p: safe_open(str(p), "pt").keys())):
            if not file.is_file():
                missing.append(file.name)
                continue
            try:
                got = read(file)
            except (OSError, ValueError, SafetensorError) as e:
                problems.append(f"{file.name} unreadable ({_first_line(e)})")
                continue
            if file is state and (got.get("step"), got.get("world_size")) != (step, world):
                problems.append(f"{file.name} records step {got.get('step')} of {got.get('world_size')} ranks")
            theirs = got.get("run") if file is state else None
            if ours and theirs and theirs != ours:  # none recorded: saved before checkpoints carried the run's
                problems.append(f"{file.name} belongs to another run ({theirs[:12]}, this directory's is {ours[:12]})")
    return ([f"missing {', '.join(missing)} of its {world} ranks"] if missing else []) + problems


def _read_state(path: Path) -> dict:
    state = json.loads(path.read_text())
    if not isinstance(state, dict):
        raise ValueError("not a JSON object")
    return state


def _recorded_world(path: Path) -> int | None:
    """The world size the step's rank JSONs record (rank 0's, else any readable one's)."""
    for state in sorted(path.glob("rank-*.json")):
        try:
            world = _read_state(state).get("world_size")
        except (OSError, ValueError):
            continue
        if isinstance(world, int) and world > 0:
            return world
    return None


def require_finite(model: nn.Module, action: str) -> None:
    """Collective: refuse to `action` (save, export) weights of which any rank's shard holds a NaN or Inf."""
    params = list(model.named_parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for _, p in params]
    bad = torch.stack([~torch.isfinite(t.detach()).all() for t in local]).float()  # one flag per parameter
    dist.all_reduce(bad)
    names = [name for (name, _), b in zip(params, bad.tolist()) if b]
    if names:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise RunError(f"refusing to {action}: non-finite weights in {', '.join(names[:3])}{more}")


def model_fields(model: nn.Module) -> dict:
    """The model config and its LoRA settings as JSON data (what a checkpoint records and a resume must match)."""
    cfg = cast("DiTConfig", model.cfg)  # the trainer's models (train/dit/model.py CausalWanModel) carry their config
    return json.loads(json.dumps(asdict(cfg) | lora_fields(model), default=str))


def save(cfg: CheckpointConfig, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> Path:
    """Collective: every rank writes its `extra` (host state: JSON data, plus top-level tensors as safetensors) and
    its model/optimizer shards; refused when any weight is non-finite. A write that fails on any rank (a full disk)
    removes the step directory and stops every rank with one line; the earlier checkpoints stay as they were."""
    require_finite(model, f"save step {step}")
    path = step_dir(cfg.dir, step)
    rank = dist.get_rank()
    failed = partial(_save_failed, path)
    error = None
    if rank == 0 and path.exists():  # an incomplete save of the same step from a killed run
        error = _first_error(shutil.rmtree, path)
    _stop_if_any(error, describe=failed)  # also the barrier: no rank writes before the old files are gone
    tensors = {k: v.detach().cpu().contiguous() for k, v in extra.items() if isinstance(v, torch.Tensor)}
    data = {k: v for k, v in extra.items() if k not in tensors} | {
        "step": step,
        "world_size": dist.get_world_size(),
        "model": model_fields(model),
        "run": _run[0] if _run else None,
    }
    error = (
        _first_error(path.mkdir, parents=True, exist_ok=True)
        or _first_error(atomic_write_bytes, path / f"rank-{rank:05d}.safetensors", safetensors_bytes(tensors))
        or _first_error(
            atomic_write_bytes, path / f"rank-{rank:05d}.json", (json.dumps(data, indent=1) + "\n").encode()
        )
    )
    _stop_if_any(error, remove=path, describe=failed)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINABLE_ONLY)
    try:
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))  # .metadata last, after a gather
    except CheckpointException as e:  # raised on every rank, whichever failed
        causes = [cause for cause, _ in e.failures.values()] or [e]
        # a full disk can surface as torch's own write error ("unexpected pos") on one rank, an OSError on another
        error = _first_line(next((c for c in causes if isinstance(c, OSError)), causes[0]))
    _stop_if_any(error, remove=path, describe=failed)
    if rank == 0:
        for _, old in complete_checkpoints(cfg.dir)[: -cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def _first_error(write, *args, **kwargs) -> str | None:
    """None once `write(*args, **kwargs)` is done, or the OS error it raised as one line (a full disk)."""
    try:
        write(*args, **kwargs)
    except OSError as e:
        return _first_line(e)
    return None


def _save_failed(path: Path, cause: str) -> str:
    kept = complete_checkpoints(path.parent)
    return (
        f"{path}: saving the checkpoint failed ({cause}; {free_space(path.parent)}); "
        + (f"the last checkpoint {kept[-1][1]} is as it was" if kept else "no earlier checkpoint exists")
        + ": free space (or fix the cause) and run again to resume"
    )


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load model + optimizer in place; returns this rank's host state (rank 0's if the world size changed) with
    `same_rank`. Refuses (RunError) a checkpoint of another model config and anything that is not plain data."""
    path = Path(path)
    saved_world = len(list(path.glob("rank-*.json")))
    if saved_world == 0:
        raise RunError(f"{path}: no rank-00000.json")
    own = path / f"rank-{dist.get_rank():05d}.json"
    source = own if own.is_file() and saved_world == dist.get_world_size() else path / "rank-00000.json"
    state = json.loads(source.read_text()) | load_file(source.with_suffix(".safetensors"))
    current = model_fields(model)
    if state["model"] != current:
        diff = ", ".join(
            f"{k}: checkpoint {state['model'].get(k)}, this run {current.get(k)}"
            for k in {**state["model"], **current}
            if state["model"].get(k) != current.get(k)
        )
        raise RunError(
            f"{path}: a checkpoint of another model ({diff}); resume with the model and --lora flags "
            f"it was trained with, or start a new --checkpoint.dir"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINABLE_ONLY)
    sd = {"model": model_sd, "optim": optim_sd}
    try:
        dcp_load(sd, storage_reader=DataOnlyReader(path), planner=DataOnlyPlanner())
    except CheckpointException as e:  # a rank's failure, e.g. a non-data pickle refused by DataOnlyPlanner
        cause = next(iter(e.failures.values()), (e,))[0]
        raise RunError(f"{path}: refusing to load: {_first_line(cause)}") from None
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=TRAINABLE_ONLY)
    state["same_rank"] = source == own
    return state


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its .metadata: admit only the classes it is made of, so a crafted file cannot call anything."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in self.ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


class DataOnlyReader(FileSystemReader):
    """FileSystemReader whose metadata comes through `_MetadataUnpickler` (the stock reader uses pickle.load)."""

    def __init__(self, path: Path):
        super().__init__(path)
        file = Path(path) / ".metadata"
        try:
            with open(file, "rb") as f:
                self.metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise RunError(f"{file}: refusing to load: {_first_line(e)}") from None

    def read_metadata(self, *args, **kwargs):
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class DataOnlyPlanner(DefaultLoadPlanner):
    """DCP stores non-tensor state (the optimizer's lr, betas, ...) as pickles and loads them with weights_only=False;
    check each with weights_only=True (plain data only) first."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)
