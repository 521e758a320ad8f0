"""Atomic, reproducible tar writing: units spill their samples, finalize mixes them into the visible shards.

Two stages keep both promises of the format: decoding happens once per episode (a unit is a group of whole
episodes), yet every output shard mixes samples from all over the dataset with a fixed count per shard.

    unit stage:     episodes of unit u -> work/unit-00000u.tar (+ .json index, written after the tar)
    finalize stage: all unit indexes -> one seeded permutation -> shard-000000.tar (+ .json) ... -> manifest.json

A file becomes visible only when complete: it is written under a hidden temporary name, fsynced and renamed; a
shard's JSON follows its tar, the manifest comes last. Tar headers carry no time, user or host, so the same inputs
give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

SHARD_PATTERN = "shard-{:06d}.tar"
UNIT_PATTERN = "unit-{:06d}.tar"
WORK_DIR = "work"
MANIFEST = "manifest.json"


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def write_tar(path: Path, members: Iterable[tuple[str, bytes]]) -> dict:
    """Write members to `path` atomically; returns {"bytes", "sha256", "members"}."""
    tmp = path.with_name(f".{path.name}.tmp")
    count = 0
    with open(tmp, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, _Reader(data))
                count += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path), "members": count}


class _Reader:
    """Minimal file object over bytes for tarfile.addfile, without copying into a BytesIO."""

    def __init__(self, data: bytes):
        self.view, self.pos = memoryview(data), 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.view) if size < 0 else min(len(self.view), self.pos + size)
        out = self.view[self.pos : end].tobytes()
        self.pos = end
        return out


def iter_tar_samples(path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {suffix: bytes}) per sample, members grouped by key in file order."""
    from preprocess.members import split_member_name

    key, group = None, {}
    with tarfile.open(path, mode="r:") as tar:
        for info in tar:
            if not info.isfile():
                continue
            k, suffix = split_member_name(info.name)
            if k != key and group:
                yield key, group
                group = {}
            key = k
            group[suffix] = tar.extractfile(info).read()
    if group:
        yield key, group


def member_index(path: Path) -> dict[str, list[list]]:
    """key -> [[member name, data offset, size], ...] for random access into a finished tar."""
    from preprocess.members import split_member_name

    index: dict[str, list[list]] = {}
    with tarfile.open(path, mode="r:") as tar:
        for info in tar:
            index.setdefault(split_member_name(info.name)[0], []).append([info.name, info.offset_data, info.size])
    return index


# ---------------------------------------------------------------- unit stage


def unit_paths(out: Path, unit: int) -> tuple[Path, Path]:
    tar = out / WORK_DIR / UNIT_PATTERN.format(unit)
    return tar, tar.with_suffix(".json")


def unit_done(out: Path, unit: int) -> bool:
    tar, index = unit_paths(out, unit)
    return tar.is_file() and index.is_file()


def write_unit(out: Path, unit: int, samples: Iterable[tuple[str, list[tuple[str, bytes]]]], record: dict) -> dict:
    """Spill one unit's samples; `record` (episodes, failures, prompts, ...) is stored in the unit's JSON."""
    tar, index_path = unit_paths(out, unit)
    tar.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []

    def members() -> Iterator[tuple[str, bytes]]:
        for key, sample_members in samples:
            keys.append(key)
            yield from sample_members

    written = write_tar(tar, members())
    if len(set(keys)) != len(keys):
        tar.unlink()
        raise ValueError(f"unit {unit}: duplicate sample keys")
    index = {**record, "unit": unit, "count": len(keys), **written, "index": member_index(tar)}
    atomic_write_json(index_path, index)
    return index


# ---------------------------------------------------------------- finalize stage


@dataclass(frozen=True)
class SampleRef:
    key: str
    unit: int
    members: tuple  # ((name, offset, size), ...)


def plan_shards(unit_indexes: list[dict], samples_per_shard: int, seed: int) -> list[list[SampleRef]]:
    """All samples of all units in one seeded permutation, cut into shards of `samples_per_shard` (last may be short)."""
    refs = [
        SampleRef(key, idx["unit"], tuple(tuple(m) for m in members))
        for idx in sorted(unit_indexes, key=lambda i: i["unit"])
        for key, members in sorted(idx["index"].items())
    ]
    refs.sort(key=lambda r: r.key)  # canonical order, independent of how units were cut
    order = np.random.default_rng(seed).permutation(len(refs))
    mixed = [refs[i] for i in order]
    return [mixed[i : i + samples_per_shard] for i in range(0, len(mixed), samples_per_shard)]


def write_shard(out: Path, shard: int, refs: list[SampleRef]) -> dict:
    """Copy the shard's samples out of the unit spills; then its JSON. Returns the JSON record."""
    path = out / SHARD_PATTERN.format(shard)
    handles: dict[int, int] = {}

    def members() -> Iterator[tuple[str, bytes]]:
        for ref in refs:
            fd = handles.get(ref.unit)
            if fd is None:
                fd = handles[ref.unit] = os.open(unit_paths(out, ref.unit)[0], os.O_RDONLY)
            for name, offset, size in ref.members:
                yield name, os.pread(fd, size, offset)

    try:
        written = write_tar(path, members())
    finally:
        for fd in handles.values():
            os.close(fd)
    record = {"shard": path.name, "count": len(refs), "bytes": written["bytes"], "sha256": written["sha256"],
              "keys": [r.key for r in refs]}
    atomic_write_json(path.with_suffix(".json"), record)
    return record


def shard_done(out: Path, shard: int) -> dict | None:
    path = out / SHARD_PATTERN.format(shard)
    meta = path.with_suffix(".json")
    if path.is_file() and meta.is_file():
        return json.loads(meta.read_text())
    return None


# ---------------------------------------------------------------- text table


def write_text_table(out: Path, prompts: dict[str, str], embeddings: dict) -> dict:
    """text/embeddings.safetensors (prompt id -> bf16 [tokens, dim]) and text/prompts.json; returns the manifest
    entry. `embeddings` maps each id of `prompts` to its umT5 output, already trimmed to the prompt's length."""
    import torch
    from safetensors.torch import save_file

    text_dir = out / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    table = text_dir / "embeddings.safetensors"
    tensors = {i: embeddings[i].to(torch.bfloat16).cpu().contiguous() for i in sorted(prompts)}
    tmp = table.with_name(f".{table.name}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, table)
    atomic_write_json(text_dir / "prompts.json", {i: {"text": prompts[i], "tokens": int(t.shape[0])} for i, t in tensors.items()})
    return {"file": "text/embeddings.safetensors", "prompts": "text/prompts.json", "count": len(tensors),
            "sha256": sha256_file(table)}
