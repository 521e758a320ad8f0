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
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from wampipe.shardformat.files import atomic_write_json, atomic_writer, sha256_file
from wampipe.shardformat.keys import sample_key
from wampipe.shardformat.layout import META, SAMPLE_INDEX, WORK_DIR, shard_file, unit_file
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.members import checksum, split_member_name
from wampipe.shardformat.samples import FREE, member_names, row_dtype, shard_index_rows
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
    problem = (
        "duplicate sample keys"
        if len(set(keys)) != len(keys)
        else f"samples differ in their tensors ({'; '.join(map(describe, schemas))})"
        if len(schemas) > 1
        else ""
    )
    if problem:
        tar.unlink()
        raise ValueError(f"unit {unit}: {problem}")
    by_key: dict[str, list[list]] = {}
    for name, offset, size in written["members"]:
        by_key.setdefault(split_member_name(name)[0], []).append([name, offset, size])
    index = {
        **record,
        "unit": unit,
        "count": len(keys),
        "bytes": written["bytes"],
        "sha256": written["sha256"],
        "members": len(written["members"]),
        "index": by_key,
        "schema": schemas[0] if schemas else None,
    }
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
#
# Nothing here holds a Python object per sample: a unit's JSON becomes a table of rows (work/unit-u.rows.npy, the
# sample index's row layout with the unit in place of the shard), the plan is integer arrays, each shard is written by
# a task of its own from the plan, and the sample index is assembled from the shards' rows in buckets of BUCKET rows.

BUCKET = 1 << 19
PLAN_ROW = np.dtype([("unit", "<u4"), ("row", "<u4"), ("canon", "<u4")])


def unit_rows_path(out: Path, unit: int) -> Path:
    return unit_paths(out, unit)[0].with_suffix(".rows.npy")


def summarize_unit(out: Path, unit: int) -> dict:
    """A unit's JSON record without its per-sample index (prompts, episode outcomes, schema, count), after writing
    that index as rows (`unit_rows_path`; member ids into `member_names(schema)`) unless already there."""
    record = read_unit_index(out, unit)
    index = record.pop("index")
    path = unit_rows_path(out, unit)
    if record["count"] and not path.is_file():
        # the rows of the sample index, the unit in place of the shard; no CRC-32 or multiplicity yet (finalize reads
        # them as it copies)
        samples = [
            SampleRecord(
                key, 0, tuple(MemberRef(split_member_name(name)[1], offset, size, 0) for name, offset, size in members)
            )
            for key, members in sorted(index.items())
        ]
        rows = shard_index_rows(unit, samples, member_names(record["schema"]), 1 + len(record["schema"]))
        with atomic_writer(path) as f:
            np.lib.format.write_array(f, rows, allow_pickle=False)
    return record


def plan_split(out: Path, summaries: list[dict], seed: int, held: Iterable[int], val: bool, dataset: str) -> Path:
    """The samples of the units (those of held-out episodes for the validation split, the others else) in one
    seeded permutation of their canonical (episode, start, variant) order, as work/plan-<split>.npy: per position the
    unit, the row in its table and the canonical position. ShardFormatError names a sample two units both hold."""
    held = np.array(sorted(held), np.int64)
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("episode", "start", "variant", "unit", "row")}
    for summary in summaries:
        if not summary["count"]:
            continue
        rows = np.load(unit_rows_path(out, summary["unit"]), mmap_mode="r")
        episode = np.asarray(rows["episode"])
        keep = np.flatnonzero(np.isin(episode, held) == val)
        for name in ("episode", "start", "variant"):
            columns[name].append(np.asarray(rows[name])[keep])
        columns["unit"].append(np.full(len(keep), summary["unit"], np.uint32))
        columns["row"].append(keep.astype(np.uint32))
        del rows
    cols = {k: np.concatenate(v) if v else np.zeros(0, np.uint32) for k, v in columns.items()}
    order = np.lexsort((cols["variant"], cols["start"], cols["episode"]))
    for name in ("episode", "start", "variant"):
        cols[name] = cols[name][order]
    twice = np.flatnonzero(
        (cols["episode"][1:] == cols["episode"][:-1])
        & (cols["start"][1:] == cols["start"][:-1])
        & (cols["variant"][1:] == cols["variant"][:-1])
    )
    if twice.size:
        i = twice[0]
        key = sample_key(dataset, int(cols["episode"][i]), int(cols["start"][i]), int(cols["variant"][i]))
        raise ShardFormatError(f"{out}: sample {key} is in two units (an episode listed twice?)")
    perm = np.random.default_rng(seed).permutation(len(order))
    plan = np.empty(len(order), PLAN_ROW)
    plan["unit"], plan["row"], plan["canon"] = cols["unit"][order][perm], cols["row"][order][perm], perm
    path = out / WORK_DIR / f"plan-{'val' if val else 'train'}.npy"
    with atomic_writer(path) as f:
        np.lib.format.write_array(f, plan, allow_pickle=False)
    return path


def shard_rows_path(out: Path, plan: Path, shard: int) -> Path:
    return out / WORK_DIR / plan.stem / f"{shard_file(shard)}.rows.npy"


def write_planned_shard(
    out: Path, into: Path, plan_path: Path, shard: int, samples_per_shard: int, names: list[str], dataset: str
) -> dict:
    """Shard `shard` of the plan (positions shard x samples_per_shard ...) in `into`, copied out of the unit spills
    of `out`, then its JSON and its rows for the sample index; a shard already written with its planned keys is
    kept. Returns its manifest entry (shard, count, bytes, sha256)."""
    plan = np.load(plan_path, mmap_mode="r")
    planned = np.array(plan[shard * samples_per_shard : (shard + 1) * samples_per_shard])
    del plan
    tables: dict[int, np.ndarray] = {}

    def unit_row(unit: int, row: int):
        if unit not in tables:
            tables[unit] = np.load(unit_rows_path(out, unit), mmap_mode="r")
        return tables[unit][row]

    located = [(int(p["unit"]), unit_row(int(p["unit"]), int(p["row"]))) for p in planned]
    keys = [sample_key(dataset, int(r["episode"]), int(r["start"]), int(r["variant"])) for _, r in located]
    done = shard_done(into, shard)
    if done is None or done["keys"] != keys:
        done = _copy_shard(out, into / shard_file(shard), keys, located, names)
    # written anew even for a kept shard: a file of an earlier run's plan may lie at that name
    record = ShardRecord.from_dict(done, json_path(shard_file(shard)))
    rows = shard_index_rows(shard, record.samples, names, len(located[0][1]["member"]) if located else 1)
    rows_path = shard_rows_path(out, plan_path, shard)
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(rows_path) as f:
        np.lib.format.write_array(f, rows, allow_pickle=False)
    return {k: done[k] for k in ("shard", "count", "bytes", "sha256")}


def _copy_shard(out: Path, path: Path, keys: list[str], located: list, names: list[str]) -> dict:
    """Copy the members of the samples `located` ((unit, unit row)) out of the unit tars of `out` into the tar at
    `path`, then its JSON (offsets, CRC-32s, anchor multiplicities); returns the JSON record."""
    handles: dict[int, int] = {}
    crcs: list[int] = []
    multiplicity: dict[str, int] = {}
    suffixes: list[list[str]] = []

    def members() -> Iterator[tuple[str, bytes]]:
        for key, (unit, row) in zip(keys, located):
            fd = handles.get(unit)
            if fd is None:
                fd = handles[unit] = os.open(unit_paths(out, unit)[0], os.O_RDONLY)
            used = [i for i in range(len(row["member"])) if row["member"][i] != FREE]
            suffixes.append([names[int(row["member"][i])] for i in used])
            for i, suffix in zip(used, suffixes[-1]):
                data = os.pread(fd, int(row["size"][i]), int(row["offset"][i]))
                crcs.append(checksum(data))
                if suffix == META:
                    multiplicity[key] = int(json.loads(data)["anchor_multiplicity"])
                yield f"{key}.{suffix}", data

    try:
        written = write_tar(path, members())
    finally:
        for fd in handles.values():
            os.close(fd)
    placed = iter(zip(written["members"], crcs))
    samples = [
        SampleRecord(
            key,
            multiplicity[key],
            tuple(
                MemberRef(split_member_name(name)[1], offset, size, crc)
                for (name, offset, size), crc in (next(placed) for _ in sfx)
            ),
        )
        for key, sfx in zip(keys, suffixes)
    ]
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


def assemble_index(
    out: Path, into: Path, plan_path: Path, entries: list[dict], samples_per_shard: int, names: list[str]
) -> tuple[dict, dict]:
    """The sample index of the planned shards (their rows, `write_planned_shard`) in canonical order, written to
    `into`/samples.npy through bucket files of BUCKET rows under `out`'s work directory (removed after), and the
    bytes and count of each member type. Returns (the manifest's sample_index block, member_bytes)."""
    plan = np.load(plan_path, mmap_mode="r")
    n = len(plan)
    work = out / WORK_DIR / plan_path.stem
    work.mkdir(parents=True, exist_ok=True)
    buckets = [work / f"bucket-{b:06d}" for b in range(-(-n // BUCKET))]
    dtype = None
    for path in buckets:
        path.with_suffix(".rows").write_bytes(b"")
        path.with_suffix(".ids").write_bytes(b"")
    for shard, entry in enumerate(entries):
        rows = np.load(shard_rows_path(out, plan_path, shard))
        dtype = rows.dtype
        canon = np.asarray(plan["canon"][shard * samples_per_shard : shard * samples_per_shard + len(rows)])
        which = canon // BUCKET
        for b in np.unique(which):
            pick = which == b
            with open(buckets[b].with_suffix(".rows"), "ab") as f:
                f.write(rows[pick].tobytes())
            with open(buckets[b].with_suffix(".ids"), "ab") as f:
                f.write(canon[pick].astype(np.uint32).tobytes())
    del plan
    dtype = dtype if dtype is not None else row_dtype(max(1, len(names)))
    totals = {name: {"count": 0, "bytes": 0} for name in names}
    target = into / SAMPLE_INDEX
    with atomic_writer(target) as f:
        header = np.lib.format.header_data_from_array_1_0(np.empty(0, dtype))
        np.lib.format.write_array_header_1_0(f, {**header, "shape": (n,)})
        for b, path in enumerate(buckets):
            rows = np.fromfile(path.with_suffix(".rows"), dtype)
            ids = np.fromfile(path.with_suffix(".ids"), np.uint32).astype(np.int64) - b * BUCKET
            block = np.empty(len(rows), dtype)
            block[ids] = rows
            f.write(block.tobytes())
            used = block["member"] != FREE
            for i, name in enumerate(names):
                hit = (block["member"] == i) & used
                totals[name]["count"] += int(hit.sum())
                totals[name]["bytes"] += int(block["size"][hit].sum(dtype=np.uint64))
            path.with_suffix(".rows").unlink()
            path.with_suffix(".ids").unlink()
    block = {"file": SAMPLE_INDEX, "sha256": sha256_file(target), "count": n, "members": names}
    return block, {name: t for name, t in totals.items() if t["count"]}
