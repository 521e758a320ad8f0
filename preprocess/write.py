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

import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from wampipe.shardformat.files import atomic_write_json, atomic_writer, sha256_file
from wampipe.shardformat.layout import META, shard_file, unit_file
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.members import checksum, split_member_name
from wampipe.shardformat.schema import describe, schema_of
from wampipe.shardformat.shard import MemberRef, SampleRecord, ShardRecord, json_path


def write_tar(path: Path, members: Iterable[tuple[str, bytes]]) -> dict:
    """Write members to `path` atomically; returns {"bytes", "sha256", "members": [[name, data offset, size], ...]}."""
    index = []
    with atomic_writer(path) as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, _Reader(data))
                padded = -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                index.append([name, tar.offset - padded, len(data)])  # the data follows the header block(s)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path), "members": index}


class _Reader:
    """Minimal file object over bytes for tarfile.addfile, without copying into a BytesIO."""

    def __init__(self, data: bytes):
        self.view, self.pos = memoryview(data), 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.view) if size < 0 else min(len(self.view), self.pos + size)
        out = self.view[self.pos : end].tobytes()
        self.pos = end
        return out


# ---------------------------------------------------------------- unit stage


def unit_paths(out: Path, unit: int) -> tuple[Path, Path]:
    tar = out / unit_file(unit)
    return tar, tar.with_suffix(".json")


def unit_done(out: Path, unit: int) -> bool:
    tar, index = unit_paths(out, unit)
    return tar.is_file() and index.is_file()


def write_unit(out: Path, unit: int, samples: Iterable[tuple[str, list[tuple[str, bytes]]]], record: dict) -> dict:
    """Spill one unit's samples; `record` (episodes, failures, prompts, ...) is stored in the unit's JSON with the
    index of their members and their schema (shardformat.schema: all samples of a unit have one)."""
    tar, index_path = unit_paths(out, unit)
    tar.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    schemas: list[dict] = []

    def members() -> Iterator[tuple[str, bytes]]:
        for key, sample_members in samples:
            keys.append(key)
            for name, data in sample_members:
                if name == f"{key}.{META}" and (schema := schema_of(json.loads(data)["tensors"])) not in schemas:
                    schemas.append(schema)
                yield name, data

    written = write_tar(tar, members())
    problem = ("duplicate sample keys" if len(set(keys)) != len(keys) else
               f"samples differ in their tensors ({'; '.join(map(describe, schemas))})" if len(schemas) > 1 else "")
    if problem:
        tar.unlink()
        raise ValueError(f"unit {unit}: {problem}")
    by_key: dict[str, list[list]] = {}
    for name, offset, size in written["members"]:
        by_key.setdefault(split_member_name(name)[0], []).append([name, offset, size])
    index = {**record, "unit": unit, "count": len(keys), "bytes": written["bytes"], "sha256": written["sha256"],
             "members": len(written["members"]), "index": by_key, "schema": schemas[0] if schemas else None}
    atomic_write_json(index_path, index)
    return index


def read_unit_index(out: Path, unit: int) -> dict:
    """A unit's JSON; one written before units recorded their schema gets its first sample's (read from the unit's
    tar), so such a build resumes."""
    tar, path = unit_paths(out, unit)
    index = json.loads(path.read_text())
    first = next(iter(index["index"].values()), [])
    if "schema" not in index and first:
        offset, size = next((offset, size) for name, offset, size in first if split_member_name(name)[1] == META)
        with open(tar, "rb") as f:
            index["schema"] = schema_of(json.loads(os.pread(f.fileno(), size, offset))["tensors"])
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


def write_shard(out: Path, shard: int, refs: list[SampleRef], into: Path | None = None) -> dict:
    """Copy the shard's samples out of the unit spills of `out` into shard `shard` of `into` (default `out`; the
    validation split's own directory); then its JSON (offsets, CRC-32s, anchor multiplicities). Returns the JSON
    record."""
    path = (into or out) / shard_file(shard)
    handles: dict[int, int] = {}
    crcs: list[int] = []
    multiplicity: dict[str, int] = {}

    def members() -> Iterator[tuple[str, bytes]]:
        for ref in refs:
            fd = handles.get(ref.unit)
            if fd is None:
                fd = handles[ref.unit] = os.open(unit_paths(out, ref.unit)[0], os.O_RDONLY)
            for name, offset, size in ref.members:
                data = os.pread(fd, size, offset)
                crcs.append(checksum(data))
                if name == f"{ref.key}.{META}":
                    multiplicity[ref.key] = int(json.loads(data)["anchor_multiplicity"])
                yield name, data

    try:
        written = write_tar(path, members())
    finally:
        for fd in handles.values():
            os.close(fd)
    located = iter(zip(written["members"], crcs))
    samples = [SampleRecord(ref.key, multiplicity[ref.key],
                            tuple(MemberRef(split_member_name(name)[1], offset, size, crc)
                                  for (name, offset, size), crc in (next(located) for _ in ref.members)))
               for ref in refs]
    record = ShardRecord(path.name, written["bytes"], written["sha256"], samples)
    record.write(json_path(path))
    return record.to_dict()


def shard_done(out: Path, shard: int) -> dict | None:
    """The JSON record of a finished shard of this format version, else None (to be written again)."""
    path = out / shard_file(shard)
    if not path.is_file() or not json_path(path).is_file():
        return None
    try:
        return ShardRecord.read(json_path(path)).to_dict()
    except ShardFormatError:  # an older format version or a damaged JSON: rewrite the shard
        return None
