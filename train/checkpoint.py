"""Distributed checkpoints (torch.distributed.checkpoint) and the consolidated weight export.

    <dir>/step-000120/   .metadata (written last by DCP: present = complete), *.distcp (model + optimizer shards),
                         rank-00000.pt ... (per rank: step, scheduler, data position, RNG states; written first)
    <dir>/export/        model.safetensors (+ index when sharded), official key names (train/weights.py)

A run resumes from the newest complete step directory; incomplete ones (killed mid-save) are ignored and the
oldest complete ones beyond `keep_last` are deleted after each save.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from train.config import CheckpointConfig

STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted((s, p) for s, p in found if (p / ".metadata").is_file())


def _atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(cfg: CheckpointConfig, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict) -> Path:
    """Collective: every rank writes its `extra` (host state) and its model/optimizer shards."""
    path = step_dir(cfg.dir, step)
    rank = dist.get_rank()
    if rank == 0 and path.exists():  # an incomplete save of the same step from a killed run
        shutil.rmtree(path)
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save(extra, path / f"rank-{rank:05d}.pt")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))  # .metadata last, after a gather
    if rank == 0:
        for _, old in complete_checkpoints(cfg.dir)[: -cfg.keep_last or None]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load model + optimizer in place; returns this rank's host state (rank 0's if the world size changed)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    own = Path(path) / f"rank-{dist.get_rank():05d}.pt"
    saved_world = len(list(Path(path).glob("rank-*.pt")))
    source = own if own.is_file() and saved_world == dist.get_world_size() else Path(path) / "rank-00000.pt"
    extra = torch.load(source, map_location="cpu", weights_only=False)
    extra["same_rank"] = source == own
    return extra


def export(cfg: CheckpointConfig, model: nn.Module, out: Path | None = None, metadata: dict | None = None) -> Path | None:
    """Gather the full weights on rank 0 and write them as safetensors with the official key names."""
    from train.weights import save_weights

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = Path(out or Path(cfg.dir) / "export")
    written = None
    if dist.get_rank() == 0:
        sd = {cfg.export_prefix + k: v for k, v in sd.items()}
        written = save_weights(sd, out, dtype=getattr(torch, cfg.export_dtype), metadata=metadata)
    dist.barrier()
    return written
