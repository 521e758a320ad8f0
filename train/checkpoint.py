"""Distributed checkpoints (torch.distributed.checkpoint) and the consolidated weight export.

    <dir>/step-000120/   .metadata (written last by DCP: present = complete), *.distcp (trainable parameters +
                         optimizer shards; a LoRA run's frozen base is rebuilt from --model.init-from),
                         rank-00000.json + .safetensors ... (per rank: step, model config, data position, RNG
                         state; written first)
    <dir>/export/        model.safetensors (+ index when sharded), official key names; with --checkpoint.export-base
                         an eval-ready DreamZero checkpoint folder (train/export.py)

A run resumes from the newest complete step directory; incomplete ones (killed mid-save) are ignored and the
oldest complete ones beyond `keep_last` are deleted after each save. Weights with a NaN or Inf are never saved.
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
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import load_file, save as safetensors_bytes
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from train.config import CheckpointConfig
from train.lora import lora_fields

STEP_DIR = re.compile(r"^step-(\d+)$")
# Frozen parameters (a LoRA run's base DiT) are not saved: the run rebuilds them from its seed or --model.init-from.
# Loading is then not strict about them; dcp.load itself still requires every saved (trainable) key.
TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


class RunError(SystemExit):
    """Stops every rank with exit code 1; only rank 0 prints the one-line reason (not one copy per rank)."""

    def __init__(self, message: str):
        super().__init__(message if not dist.is_initialized() or dist.get_rank() == 0 else 1)


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted((s, p) for s, p in found if (p / ".metadata").is_file())


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


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def model_fields(model: nn.Module) -> dict:
    """The model config and its LoRA settings as JSON data (what a checkpoint records and a resume must match)."""
    return json.loads(json.dumps(asdict(model.cfg) | lora_fields(model), default=str))


def save(cfg: CheckpointConfig, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> Path:
    """Collective: every rank writes its `extra` (host state: JSON data, plus top-level tensors as safetensors) and
    its model/optimizer shards; refused when any weight is non-finite."""
    require_finite(model, f"save step {step}")
    path = step_dir(cfg.dir, step)
    rank = dist.get_rank()
    if rank == 0 and path.exists():  # an incomplete save of the same step from a killed run
        shutil.rmtree(path)
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in extra.items() if isinstance(v, torch.Tensor)}
    data = {k: v for k, v in extra.items() if k not in tensors} | {"model": model_fields(model)}
    _atomic_write(path / f"rank-{rank:05d}.safetensors", safetensors_bytes(tensors))
    _atomic_write(path / f"rank-{rank:05d}.json", (json.dumps(data, indent=1) + "\n").encode())
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINABLE_ONLY)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))  # .metadata last, after a gather
    if rank == 0:
        for _, old in complete_checkpoints(cfg.dir)[: -cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load model + optimizer in place; returns this rank's host state (rank 0's if the world size changed) with
    `same_rank`. Refuses (RunError) a checkpoint of another model config and anything that is not plain data."""
    path = Path(path)
    saved_world = len(list(path.glob("rank-*.json")))
    if saved_world == 0:
        pickles = sorted(p.name for p in path.glob("rank-*.pt"))
        raise RunError(f"{path}: no rank-00000.json" + (
            f"; its per-rank state is pickled ({pickles[0]}, an older trainer's format), which is not loaded since "
            f"unpickling can run code: start a new --checkpoint.dir" if pickles else ""))
    own = path / f"rank-{dist.get_rank():05d}.json"
    source = own if own.is_file() and saved_world == dist.get_world_size() else path / "rank-00000.json"
    state = json.loads(source.read_text()) | load_file(source.with_suffix(".safetensors"))
    current = model_fields(model)
    if state["model"] != current:
        diff = ", ".join(f"{k}: checkpoint {state['model'].get(k)}, this run {current.get(k)}"
                         for k in {**state["model"], **current} if state["model"].get(k) != current.get(k))
        raise RunError(f"{path}: a checkpoint of another model ({diff}); resume with the model and --lora flags "
                       f"it was trained with, or start a new --checkpoint.dir")
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINABLE_ONLY)
    sd = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(sd, storage_reader=_DataOnlyReader(path), planner=_DataOnlyPlanner())
    except CheckpointException as e:  # a rank's failure, e.g. a non-data pickle refused by _DataOnlyPlanner
        cause = next(iter(e.failures.values()), (e,))[0]
        raise RunError(f"{path}: refusing to load: {_first_line(cause)}") from None
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                   options=TRAINABLE_ONLY)
    state["same_rank"] = source == own
    return state


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its .metadata: admit only the classes it is made of, so a crafted file cannot call anything."""

    ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
        ("torch", "Size"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in self.ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


class _DataOnlyReader(FileSystemReader):
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


class _DataOnlyPlanner(DefaultLoadPlanner):
    """DCP stores non-tensor state (the optimizer's lr, betas, ...) as pickles and loads them with weights_only=False;
    check each with weights_only=True (plain data only) first."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def export(cfg: CheckpointConfig, model: nn.Module, out: Path | None = None, metadata: dict | None = None,
           shards: Path | None = None) -> Path:
    """Collective: the final weights in `out` (default <dir>/export): with `cfg.export_base`, an eval-ready DreamZero
    checkpoint folder carrying the statistics of `shards`; else plain safetensors, official key names. A LoRA model
    exports merged weights, or with `cfg.export_lora` lora-only its trained tensors under PEFT names."""
    from train.export import export_lora_only, export_official, export_weights

    out = Path(out or Path(cfg.dir) / "export")
    dtype = getattr(torch, cfg.export_dtype)
    if cfg.export_lora == "lora-only":
        return export_lora_only(model, out, cfg.export_base, shards, dtype=dtype, metadata=metadata)
    if cfg.export_base is not None:
        return export_official(model, out, cfg.export_base, shards, dtype=dtype, metadata=metadata)
    return export_weights(model, out, prefix=cfg.export_prefix, dtype=dtype, metadata=metadata)
