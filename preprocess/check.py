"""Integrity check of a shard directory, local or on object storage: exit 0 only when everything the manifest
promises holds.

    python -m preprocess check shards/droid
    python -m preprocess check s3://bucket/shards/droid      # endpoint and credentials: the AWS_* variables

Checked: the manifest (readable, this format version, its seal over its own content, its fields), wids.json,
manifest <-> files (no shard missing, none extra), the sample index (sealed, its rows list exactly each tar's members
at their offsets) and, with --shard-jsons or when the index is unusable, each shard's JSON (readable, sealed, agrees
with the manifest and the index, lists exactly the tar's members), byte counts and sha256, sample counts, every
member's CRC-32,
every member decodes with its recorded shape and dtype, holds finite values and is what the manifest's schema says
(the same members, dtypes and shapes in every sample; frame 0 as CLIP features or, in the encoders' dtype, CLIP's
input pixels, as image_features says), keys are unique and well formed, anchor multiplicities agree with meta.json,
every prompt id resolves in the text table (shardformat.shard.read_sample decodes, as for every reader), the
statistics file is present and matches its hash, the text table matches its hash and prompts.json its ids and token
counts. A build with a validation split (preprocess shards --val-episodes) has its split checked the same way, both
manifests record the same held-out episodes, and no sample lies in the other split than its episode's. Paths named by
the manifest must lie inside the directory, and members inside their tar
(shardformat.manifest). Every problem names the file and the sample. Each tar is read once, front to back (its hash,
headers and members in one pass), through shardformat.storage.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, BinaryIO, Iterator

import numpy as np
import tyro

from wampipe.errors import UsageError
from wampipe.preprocess.tasks import LazyTasks, auto_workers, run_tasks
from wampipe.shardformat.files import NotRegularFile, open_regular, sha256_regular
from wampipe.shardformat.keys import parse_key
from wampipe.shardformat.layout import CLIP_PIXELS, MANIFEST, SAMPLE_INDEX, SHARD_NAME, WIDS_INDEX
from wampipe.shardformat.manifest import Manifest, ShardEntry, ShardFormatError, check_json_size, check_sha256
from wampipe.shardformat.members import split_member_name
from wampipe.shardformat.shard import ShardRecord, json_path, read_sample, verify_members
from wampipe.shardformat.storage import COPY_BLOCK, STORE_ERRORS, ShardStore
from wampipe.shardformat.text import TextTable

if TYPE_CHECKING:
    from wampipe.shardformat.samples import SampleTable


@dataclass
class Args:
    root: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="DIR|URL")]]
    """Shard directory (holds manifest.json): a path or a URL (s3://bucket/prefix, file:///path; S3 endpoint and
    credentials from the AWS_* variables)."""
    members: bool = True
    """Decode every member of every sample (slower, thorough); --no-members checks files, hashes and indexes only."""
    workers: int = 0
    """Processes reading the shards, each shard a task of its own (0 = auto: one per 32 shards, at most every core
    and 8)."""
    shard_jsons: bool = False
    """Also read and verify each shard's JSON. Readers of this format use the sample index, which the check verifies
    against every tar; the JSONs are read only with this flag, or when the index itself is unusable."""


def _finite(value) -> bool:
    import torch  # here, not at the top: `--help` without loading torch

    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value.float()).all())
    return not np.issubdtype(value.dtype, np.floating) or bool(np.isfinite(value).all())


class HashingReader:
    """Reads through a file object, hashing and counting every byte: one pass gives a tar's content and sha256."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.sha256.update(data)
        self.bytes += len(data)
        return data

    def drain(self) -> None:
        """Read what the tar reader left (the end-of-archive padding), so the hash covers the whole file."""
        while self.read(COPY_BLOCK):
            pass


def tar_samples(
    f: BinaryIO | HashingReader, headers: dict[str, list] | None = None
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {suffix: bytes}) per sample of a tar read front to back, members grouped by key in file order;
    `headers` collects key -> [[member name, data offset, size], ...] as read."""
    # `key` counts only once `group` holds a member, and then it is that member's key
    key, group, headers = "", {}, {} if headers is None else headers
    # a stream ("r|") only reads: typeshed's file type for tarfile asks for write, tell, seek and close too, which
    # HashingReader does without
    with tarfile.open(fileobj=f, mode="r|") as tar:  # pyright: ignore[reportCallIssue, reportArgumentType]
        for info in tar:
            k, suffix = split_member_name(info.name)
            headers.setdefault(k, []).append([info.name, info.offset_data, info.size])
            if not info.isfile():
                continue
            if k != key and group:
                yield key, group
                group = {}
            key = k
            member = tar.extractfile(info)
            assert member is not None  # None only for a member that is no file, skipped above
            group[suffix] = member.read()
    if group:
        yield key, group


def check_statistics(store: ShardStore, manifest: Manifest, files: set[str], problems: list[str]) -> None:
    stats = manifest.statistics
    if stats["file"] not in files:
        problems.append(f"{MANIFEST}: statistics file missing")
        return
    try:
        check_sha256(stats["file"], hashlib.sha256(store.read_bytes(stats["file"])).hexdigest(), stats["sha256"])
    except ShardFormatError as err:
        problems.append(str(err))
    except NotRegularFile as err:
        problems.append(f"{stats['file']}: {err.strerror}")


def check_text_table(store: ShardStore, manifest: Manifest, files: set[str], problems: list[str]) -> set[str]:
    import torch
    from safetensors import safe_open

    entry = manifest.text_table
    for name in (entry["file"], entry["prompts"]):
        if name not in files:
            problems.append(f"{name}: missing")
            return set()
    # safetensors opens files by name
    text = TextTable(store.local_root(entry["file"], entry["prompts"]), entry)
    try:
        check_sha256(entry["file"], sha256_regular(text.table), entry["sha256"])
    except ShardFormatError as err:
        problems.append(str(err))
    except NotRegularFile as err:
        problems.append(f"{entry['file']}: {err.strerror}")
        return set()
    try:
        with os.fdopen(open_regular(text.prompts), "rb") as f:
            check_json_size(entry["prompts"], os.fstat(f.fileno()).st_size)
            tokens = {pid: p["tokens"] for pid, p in json.loads(f.read()).items()}
    except ShardFormatError as err:
        problems.append(str(err))
        return set()
    except NotRegularFile as err:
        problems.append(f"{entry['prompts']}: {err.strerror}")
        return set()
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError, KeyError) as err:
        problems.append(f"{entry['prompts']}: unreadable: {err}")
        return set()
    rows = {}
    try:
        with safe_open(text.table, framework="pt") as f:
            for pid in sorted(f.keys()):
                emb = f.get_tensor(pid)
                rows[pid] = emb.shape[0]
                if emb.ndim != 2 or not torch.isfinite(emb.float()).all():
                    problems.append(f"{entry['file']}: prompt {pid}: embedding is not a finite [tokens, dim] matrix")
    except Exception as err:  # safetensors raises several types for damaged files
        problems.append(f"{entry['file']}: unreadable: {err}")
        return set()
    if tokens.keys() != rows.keys():
        problems.append(
            f"{entry['file']}: prompt ids differ from {entry['prompts']} ({len(tokens.keys() ^ rows.keys())} differ)"
        )
    elif tokens != rows:
        problems.append(
            f"{entry['file']}: token counts differ from {entry['prompts']} "
            f"({sum(tokens[p] != rows[p] for p in rows)} prompts)"
        )
    return set(rows)


def check_shard_json(store: ShardStore, entry: ShardEntry, files: set[str], problems: list[str]) -> ShardRecord | None:
    """The shard's JSON, if readable and in agreement with the manifest entry."""
    side = json_path(entry.shard).as_posix()
    if side not in files:
        problems.append(f"{side}: missing")
        return None
    try:
        record = ShardRecord.from_dict(store.read_sealed_json(side), store.where(side))
    except ShardFormatError as err:
        problems.append(str(err))
        return None
    try:
        record.check_entry(entry, side)
    except ShardFormatError as err:
        problems.append(str(err))
    return record


def check_shard(
    store: ShardStore,
    entry: ShardEntry,
    record: ShardRecord | None,
    indexed: list | None,
    prompt_ids: set[str],
    decode: bool,
    schema: dict,
    held: set[int],
    held_in: bool,
) -> list[str]:
    """One pass over the tar: every sample, its size and sha256, its headers and CRC-32s against the sample index's
    rows of the shard (`indexed`, SampleRecords in tar order; None when the index is unusable) and, when read, the
    shard JSON (`record`), each sample's episode held out (`held_in`: a validation split) or not, as its split
    says."""
    name, problems, count = entry.shard, [], 0
    reference = indexed if indexed is not None else record.samples if record is not None else []
    samples = {s.key: s for s in reference}
    headers: dict[str, list] = {}
    keys: dict[str, str] = {}
    with store.open(name) as f:
        reader = HashingReader(f)
        try:
            for key, members in tar_samples(reader, headers):
                count += 1
                problems += check_sample(name, key, members, samples.get(key), prompt_ids, keys, decode, schema)
                episode = _episode(key)
                if episode is not None and (episode in held) != held_in:
                    problems.append(
                        f"{name}: sample {key} is of episode {episode}, "
                        f"{'not held out' if held_in else 'held out for validation'}"
                    )
            complete = True
        except (tarfile.TarError, OSError, EOFError) as err:
            problems.append(f"{name}: truncated or unreadable tar after {count} samples: {err}")
            complete = False
        reader.drain()
    if reader.bytes != entry.bytes:
        problems.append(f"{name}: {reader.bytes} bytes, the manifest says {entry.bytes}")
    if reader.sha256.hexdigest() != entry.sha256:
        problems.append(f"{name}: sha256 differs from the manifest")
    if count != entry.count:
        problems.append(f"{name}: {count} samples, the manifest says {entry.count}")
    for what, listing in ((SAMPLE_INDEX, indexed), (json_path(name).as_posix(), record and record.samples)):
        if listing is None or not complete:
            continue
        listed = {s.key: [[f"{s.key}.{m.name}", m.offset, m.size] for m in s.members] for s in listing}
        for key in sorted(listed.keys() | headers.keys()):
            if listed.get(key) != headers.get(key):
                problems.append(
                    f"{what}: sample {key}: members and offsets differ from the tar's headers"
                    f"{f' of {name}' if what == SAMPLE_INDEX else ''}"
                )
    if indexed is not None and record is not None and indexed != record.samples:
        problems.append(f"{SAMPLE_INDEX}: the samples of {name} differ from {json_path(name).as_posix()}")
    return problems


def check_one_shard(
    store: ShardStore,
    entry: ShardEntry,
    has_json: bool,
    indexed: list | None,
    prompt_ids: set[str],
    decode: bool,
    schema: dict,
    held: set[int],
    held_in: bool,
    shard_json: bool = False,
) -> list[str]:
    """The problems of one shard (its JSON when `shard_json` or the index is unusable, then its tar): a task of its
    own (preprocess.tasks.run_tasks)."""
    problems: list[str] = []
    record = None
    if shard_json or indexed is None:
        record = check_shard_json(store, entry, {json_path(entry.shard).as_posix()} if has_json else set(), problems)
    return problems + check_shard(store, entry, record, indexed, prompt_ids, decode, schema, held, held_in)


def check(root: str | os.PathLike, decode: bool = True, workers: int = 0, shard_jsons: bool = False) -> list[str]:
    """All problems found in the shard directory at `root` (a path or URL) and in its validation split, as messages
    naming the file and sample; empty when the directory is sound. `workers` processes read the shards (0: auto,
    preprocess.tasks.auto_workers); `shard_jsons`: verify each shard's JSON too."""
    try:
        held = ShardStore(root).manifest().validation
    except ShardFormatError:  # named by check_split
        held = {}
    episodes = set(held.get("episodes") or [])
    problems, manifest = check_split(root, decode, episodes, held.get("split") == "val", workers, shard_jsons)
    if manifest is None or not held.get("val_dir"):
        return problems
    val_dir = f"{str(root).rstrip('/')}/{held['val_dir']}"
    val_problems, val_manifest = check_split(val_dir, decode, episodes, True, workers, shard_jsons)
    for p in val_problems:  # a sample in the wrong split is named by its path, like the training split's
        problems.append(f"{val_dir}/{p}" if p.endswith(", not held out") else f"validation split {val_dir}: {p}")
    if val_manifest is None:
        return problems
    record = val_manifest.validation
    if [record.get(k) for k in ("split", "choice", "episodes")] != ["val", held.get("choice"), held.get("episodes")]:
        problems.append(f"{val_dir}/{MANIFEST}: its validation record {record} disagrees with {MANIFEST}'s {held}")
    return problems


def _episode(key: str) -> int | None:
    try:
        return parse_key(key).episode
    except ValueError:  # reported by check_sample
        return None


def check_split(
    root: str | os.PathLike, decode: bool, held: set[int], held_in: bool, workers: int = 0, shard_jsons: bool = False
) -> tuple[list[str], Manifest | None]:
    """(problems, manifest or None) of one shard directory; `held`: the held-out episodes, which its samples must
    (`held_in`, a validation split) or must not be of. The shards are read by `workers` processes."""
    store = ShardStore(root)
    try:
        manifest = store.manifest()
    except ShardFormatError as err:
        return [str(err)], None
    files = set(store.list())
    problems: list[str] = check_image(manifest)
    check_statistics(store, manifest, files, problems)
    prompt_ids = check_text_table(store, manifest, files, problems)
    try:
        if store.read_json(WIDS_INDEX) != manifest.wids_index():
            problems.append(f"{WIDS_INDEX}: disagrees with {MANIFEST}")
    except (OSError, ValueError) as err:  # ValueError: bad JSON, or over the size limit (ShardFormatError)
        problems.append(f"{WIDS_INDEX}: unreadable: {err}")

    listed = {s.shard for s in manifest.shards}
    for extra in sorted({f for f in files if SHARD_NAME.fullmatch(f)} - listed):
        problems.append(f"{extra}: not listed in {MANIFEST}")
    index = check_sample_index(store, manifest, problems)
    present = [i for i, entry in enumerate(manifest.shards) if entry.shard in files]

    def task(i: int) -> tuple:
        entry = manifest.shards[i]
        indexed = None
        if index is not None:
            table, order, bounds = index
            indexed = [table.record(int(r)) for r in order[bounds[i] : bounds[i + 1]]]
        return (
            store,
            entry,
            json_path(entry.shard).as_posix() in files,
            indexed,
            prompt_ids,
            decode,
            manifest.schema,
            held,
            held_in,
            shard_jsons,
        )

    found: dict[int, list[str]] = {}
    for n, shard_problems in run_tasks(
        check_one_shard,
        LazyTasks(task, present),
        auto_workers(workers, len(present)),
        "check",
        progress=sys.stderr.isatty(),
    ):
        found[present[n]] = shard_problems
    for i, entry in enumerate(manifest.shards):
        problems += [f"{entry.shard}: missing"] if i not in found else found[i]
    return problems, manifest


def check_sample_index(
    store: ShardStore, manifest: Manifest, problems: list[str]
) -> tuple[SampleTable, np.ndarray, np.ndarray] | None:
    """(the verified sample index, the order of its rows by (shard, offset of the first member), where each shard's
    rows begin in that order), or None with the problem noted."""
    from wampipe.shardformat.index import open_sample_table  # here: it loads torch, which `--help` does without

    try:
        table = open_sample_table(store, manifest, where=manifest.sample_index["file"])
    except ShardFormatError as err:
        problems.append(str(err))
        return None
    shard, first = np.asarray(table.rows["shard"]), np.asarray(table.rows["offset"][:, 0])
    order = np.lexsort((first, shard)).astype(np.uint32)
    return table, order, np.searchsorted(shard[order], np.arange(len(manifest.shards) + 1))


def check_sample(
    shard: str,
    key: str,
    members: dict[str, bytes],
    record,
    prompt_ids: set[str],
    keys: dict[str, str],
    decode: bool,
    schema: dict,
) -> list[str]:
    """Problems of one sample; `keys` (key -> shard seen in) is updated."""
    problems = []
    where = f"{shard}: sample {key}"
    if key in keys:
        problems.append(f"{where}: key also in {keys[key]}")
    keys[key] = shard
    try:
        parse_key(key)
    except ValueError as err:
        problems.append(f"{where}: {err}")
    try:
        if not decode:
            if record is not None:
                verify_members(shard, record, members)
            return problems
        meta, tensors = read_sample(shard, key, members, schema, record)
    except ShardFormatError as err:
        return problems + [str(err)]
    for tname, value in tensors.items():
        if not _finite(value):
            problems.append(f"{where}: {tname} holds NaN or inf")
    if record is not None and meta.get("anchor_multiplicity") != record.anchor_multiplicity:
        problems.append(
            f"{where}: anchor_multiplicity {meta.get('anchor_multiplicity')} in meta.json, "
            f"{record.anchor_multiplicity} in the shard JSON"
        )
    for column, pid in meta["prompt_ids"].items():
        if pid not in prompt_ids:
            problems.append(f"{where}: prompt id {pid} ({column}) not in the text table")
    return problems


def check_image(manifest: Manifest) -> list[str]:
    """CLIP's input pixels, where the samples hold them (the schema, which every sample matches), are [3, S, S] in the
    encoders' dtype: what the trainer's CLIP consumes."""
    entry, dtype = manifest.schema.get(CLIP_PIXELS), manifest.encoders.get("dtype")
    if entry is None:
        return []
    shape = entry["shape"]
    if len(shape) != 3 or shape[0] != 3 or shape[1] != shape[2] or entry["dtype"] != dtype:
        return [f"{MANIFEST}: schema: {CLIP_PIXELS} is {entry['dtype']} {shape}, CLIP's input is {dtype} [3, S, S]"]
    return []


def run(args: Args) -> int:
    """Prints the problems, or OK per split; returns the exit status (1: a problem)."""
    try:
        problems = check(args.root, decode=args.members, workers=args.workers, shard_jsons=args.shard_jsons)
    except STORE_ERRORS as err:  # the storage failed midway (network, permissions): one line, no traceback
        raise UsageError(f"{args.root}: {err}") from None
    if problems:
        print(f"FAILED: {len(problems)} problem(s) in {args.root}")
        for p in problems:
            print(f"  {p}")
        return 1
    manifest = ShardStore(args.root).manifest()
    print(f"OK: {args.root}: {manifest.totals['samples']} samples in {len(manifest.shards)} shards")
    if manifest.validation.get("val_dir"):  # a training split names its validation split; a split itself does not
        val_dir = f"{str(args.root).rstrip('/')}/{manifest.validation['val_dir']}"
        val = ShardStore(val_dir).manifest()
        print(
            f"OK: {val_dir}: {val.totals['samples']} samples in {len(val.shards)} shards of the held-out episodes "
            f"{manifest.validation['episodes']}"
        )
    return 0
