"""The verified view of one shard directory that every reader shares (the trainer, `preprocess preview`): the
manifest's shards and windows, the statistics and the text table, each checked against the sealed manifest before
use, and random access to single samples (`ShardReader`)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from wampipe.shardformat.keys import window_name
from wampipe.shardformat.manifest import Manifest, ShardFormatError, check_sha256
from wampipe.shardformat.layout import ACTION, STATE
from wampipe.shardformat.samples import SampleTable
from wampipe.shardformat.shard import read_members, read_sample
from wampipe.shardformat.stats import stat_vector
from wampipe.shardformat.storage import STORE_ERRORS, ShardStore
from wampipe.shardformat.text import TextTable


@dataclass(frozen=True)
class Window:
    """One training window, how often the reference's sampler draws it, and its augmentation variants: the rows of
    the sample index (`rows`) and, for messages and tests, ((shard index, key), ...) (`variants`, made when asked:
    the loader reads by row)."""

    name: str
    anchor_multiplicity: int
    rows: tuple[int, ...]
    table: SampleTable = field(repr=False, compare=False)

    @property
    def variants(self) -> tuple[tuple[int, str], ...]:
        return tuple((self.table.shard(r), self.table.key(r)) for r in self.rows)


class Windows(Sequence):
    """The windows of a sample index, built on access (nothing per window is held): window w is the w-th run of
    rows of one (episode, start), in the order of their names."""

    def __init__(self, table: SampleTable):
        self.table = table

    def __len__(self) -> int:
        return self.table.num_windows

    def __getitem__(self, w):
        if isinstance(w, slice):
            return [self[i] for i in range(*w.indices(len(self)))]
        w = range(len(self))[w]
        rows = tuple(self.table.window_rows(w))
        return Window(
            window_name(self.table.key(rows[0])), int(self.table.rows[rows[0]]["multiplicity"]), rows, self.table
        )


def open_sample_table(store: ShardStore, manifest: Manifest, where: str | None = None) -> SampleTable:
    """The verified sample index of `manifest`'s directory: the file itself when local, else one copy (in the cache,
    shared by a node's ranks). `where` names it in messages (default: its URL); ShardFormatError otherwise."""
    block = manifest.sample_index
    where = where or store.where(block["file"])
    try:
        local = store.local_root(block["file"]) / block["file"]
    except STORE_ERRORS as err:
        raise ShardFormatError(f"{where}: unreadable: {err}") from None
    return SampleTable(local, where, block, manifest.shards, manifest.dataset)


class ShardIndex:
    """The manifest's shards and windows, the statistics and the text table of one shard directory (a path or URL;
    `cache_dir`: whole-file copies of remote shards, shardformat.storage).

    Nothing is used before it is checked against the sealed manifest: each tar's size, the sample index (by sha256,
    then every row: shardformat.samples), the statistics and text table files by sha256 (hashed once per process
    here; the tars' members are checked by CRC-32 on every read). No shard JSON is read. Raises ShardFormatError
    (naming the file) for a directory this code cannot read or trust."""

    def __init__(self, root: str | os.PathLike, cache_dir: str | os.PathLike | None = None):
        self.store = ShardStore(root, cache_dir)
        self.root = self.store.url
        self.manifest = self.store.manifest()
        self.shards = [self.store.where(entry.shard) for entry in self.manifest.shards]  # for messages
        self._check_sizes()
        self.table = open_sample_table(self.store, self.manifest)
        self.windows = Windows(self.table)
        self.q01, self.q99 = self._read_statistics()
        text = self.manifest.text_table  # a local copy, opened by name (safetensors)
        try:
            self.text = TextTable(self.store.local_root(text["file"]), text).verify()
        except STORE_ERRORS as err:
            raise ShardFormatError(f"{self.store.where(text['file'])}: unreadable: {err}") from None

    def _check_sizes(self) -> None:
        """Every shard of the manifest present at the size it records (one listing)."""
        try:
            sizes = self.store.sizes()
        except STORE_ERRORS as err:
            raise ShardFormatError(f"{self.root}: cannot list: {err}") from None
        for entry in self.manifest.shards:
            if entry.shard not in sizes:
                raise ShardFormatError(f"{self.store.where(entry.shard)}: listed in the manifest but missing")
            if sizes[entry.shard] != entry.bytes:  # members are bounded by entry.bytes: it must be the tar's size
                raise ShardFormatError(
                    f"{self.store.where(entry.shard)}: {sizes[entry.shard]} bytes, the manifest says {entry.bytes}"
                )

    def _read_statistics(self) -> tuple[dict, dict]:
        """q01 and q99 of the state and action columns, from the statistics file of the manifest's embodiment."""
        tag, statistics = self.manifest.embodiment, self.manifest.statistics["file"]
        where = self.store.where(statistics)
        try:
            data = self.store.read_bytes(statistics)
        except STORE_ERRORS as err:
            raise ShardFormatError(f"{where}: unreadable: {err}") from None
        check_sha256(where, hashlib.sha256(data).hexdigest(), self.manifest.statistics["sha256"])
        try:
            metadata = json.loads(data)
        except ValueError as err:
            raise ShardFormatError(f"{where}: unreadable: {err}") from None
        if tag not in metadata:
            raise ShardFormatError(f"{where}: no statistics for {tag!r} (has {sorted(metadata)})")
        keys = self.manifest.modality_keys
        try:
            stats = metadata[tag]["statistics"]
            return (
                {m: stat_vector(stats, m, keys[m], "q01") for m in (STATE, ACTION)},
                {m: stat_vector(stats, m, keys[m], "q99") for m in (STATE, ACTION)},
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ShardFormatError(f"{where}: statistics of {tag!r} unusable: {err}") from None

    def weights(self, sampling: str) -> np.ndarray:
        """Visits of each window per epoch: its anchor multiplicity, or 1 each for uniform sampling."""
        if sampling == "uniform":
            return np.ones(len(self.windows), np.int64)
        return self.table.multiplicities()

    @property
    def longest_prompt(self) -> int:
        """umT5 rows of the longest prompt in the text table."""
        return self.text.longest_prompt

    def __len__(self) -> int:
        return len(self.windows)


class ShardReader:
    """Verified random access to the samples of a ShardIndex: one read per sample at the member offsets of the
    sample index, each member's size and CRC-32 checked; one per process or loader worker."""

    def __init__(self, index: ShardIndex):
        self.index = index

    def close(self) -> None:
        self.index.store.close()

    def raw(self, shard: int, key: str) -> tuple[dict, dict]:
        """(meta, tensors) of sample `key` of shard `shard`; ShardFormatError when the index holds no such sample."""
        row = self.index.table.find(key)
        if row is None or self.index.table.shard(row) != shard:
            raise ShardFormatError(f"{self.index.shards[shard]}: no sample {key}")
        return self.raw_row(row)

    def raw_row(self, row: int) -> tuple[dict, dict]:
        """(meta, tensors) of the sample at `row` of the index; ShardFormatError names the shard, sample and member
        of any corruption."""
        shard = self.index.table.shard(row)
        name, where = self.index.manifest.shards[shard].shard, self.index.shards[shard]
        record = self.index.table.record(row)
        try:
            members = read_members(lambda offset, size: self.index.store.read_range(name, offset, size), record)
        except (*STORE_ERRORS, EOFError) as err:  # a truncated file, or the object store failed
            raise ShardFormatError(f"{where}: sample {record.key}: unreadable: {err}") from None
        return read_sample(where, record.key, members, self.index.manifest.schema, record)
