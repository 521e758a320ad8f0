"""The verified view of one shard directory that every reader shares (the trainer, `preprocess preview`): the
manifest's shards and windows, the statistics and the text table, each checked against the sealed manifest before
use, and random access to single samples (`ShardReader`)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from wampipe.shardformat.keys import parse_key, window_name
from wampipe.shardformat.manifest import ShardFormatError, check_sha256
from wampipe.shardformat.layout import ACTION, STATE
from wampipe.shardformat.shard import json_path, read_members, read_sample
from wampipe.shardformat.stats import stat_vector
from wampipe.shardformat.storage import STORE_ERRORS, ShardStore
from wampipe.shardformat.text import TextTable


@dataclass(frozen=True)
class Window:
    """One training window, how often the reference's sampler draws it, and where each of its augmentation variants
    lives: ((shard index, key), ...)."""

    name: str
    anchor_multiplicity: int
    variants: tuple[tuple[int, str], ...]


class ShardIndex:
    """The manifest's shards and windows, the statistics and the text table of one shard directory (a path or URL;
    `cache_dir`: whole-file copies of remote shards, shardformat.storage).

    Nothing is used before it is checked against the sealed manifest: each tar's size, each shard JSON (sealed, in
    agreement, every member inside its tar), the statistics and text table files by sha256 (hashed once per process
    here; the tars' members are checked by CRC-32 on every read). Raises ShardFormatError (naming the file) for a
    directory this code cannot read or trust."""

    def __init__(self, root: str | os.PathLike, cache_dir: str | os.PathLike | None = None):
        self.store = ShardStore(root, cache_dir)
        self.root = self.store.url
        self.manifest = self.store.manifest()
        self.shards = [self.store.where(entry.shard) for entry in self.manifest.shards]  # for messages
        self.windows = self._read_windows()
        self.q01, self.q99 = self._read_statistics()
        text = self.manifest.text_table  # a local copy, opened by name (safetensors)
        try:
            self.text = TextTable(self.store.local_root(text["file"]), text).verify()
        except STORE_ERRORS as err:
            raise ShardFormatError(f"{self.store.where(text['file'])}: unreadable: {err}") from None

    def _read_windows(self) -> list[Window]:
        """Every sample key of the shard JSONs, grouped by window, sorted by name."""
        names = [entry.shard for entry in self.manifest.shards]
        try:
            sizes = self.store.sizes()
        except STORE_ERRORS as err:
            raise ShardFormatError(f"{self.root}: cannot list: {err}") from None
        for entry in self.manifest.shards:
            if entry.shard not in sizes or json_path(entry.shard).as_posix() not in sizes:
                raise ShardFormatError(f"{self.store.where(entry.shard)}: listed in the manifest but missing (or its "
                                       f".json is)")
            if sizes[entry.shard] != entry.bytes:  # members are bounded by entry.bytes: it must be the tar's size
                raise ShardFormatError(f"{self.store.where(entry.shard)}: {sizes[entry.shard]} bytes, the manifest "
                                       f"says {entry.bytes}")
        grouped: dict[str, list[tuple[int, int, str, int]]] = {}
        for i, (entry, record) in enumerate(zip(self.manifest.shards, self.store.shard_records(names))):
            side = self.store.where(json_path(entry.shard).as_posix())
            record.check_entry(entry, side)
            for sample in record.samples:
                try:
                    variant = parse_key(sample.key).variant
                except ValueError as err:
                    raise ShardFormatError(f"{side}: {err}") from None
                grouped.setdefault(window_name(sample.key), []).append((variant, i, sample.key,
                                                                        sample.anchor_multiplicity))
        return [self._window(name, sorted(v)) for name, v in sorted(grouped.items())]

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
            return ({m: stat_vector(stats, m, keys[m], "q01") for m in (STATE, ACTION)},
                    {m: stat_vector(stats, m, keys[m], "q99") for m in (STATE, ACTION)})
        except (KeyError, TypeError, ValueError) as err:
            raise ShardFormatError(f"{where}: statistics of {tag!r} unusable: {err}") from None

    def _window(self, name: str, variants: list[tuple[int, int, str, int]]) -> Window:
        multiplicities = {m for *_, m in variants}
        if len(multiplicities) != 1:
            raise ShardFormatError(f"{self.root}: window {name}: its variants disagree on anchor_multiplicity "
                                   f"({sorted(multiplicities)})")
        return Window(name, multiplicities.pop(), tuple((s, k) for _, s, k, _ in variants))

    def weights(self, sampling: str) -> np.ndarray:
        """Visits of each window per epoch: its anchor multiplicity, or 1 each for uniform sampling."""
        if sampling == "uniform":
            return np.ones(len(self.windows), np.int64)
        return np.array([w.anchor_multiplicity for w in self.windows], np.int64)

    @property
    def longest_prompt(self) -> int:
        """umT5 rows of the longest prompt in the text table."""
        return self.text.longest_prompt

    def __len__(self) -> int:
        return len(self.windows)



class ShardReader:
    """Verified random access to the samples of a ShardIndex: one read per sample at the recorded member offsets,
    each member's size and CRC-32 checked; one per process or loader worker."""

    def __init__(self, index: ShardIndex):
        self.index = index
        self._records = lru_cache(maxsize=64)(self._read_record)

    def _read_record(self, shard: int) -> dict:
        """{key: SampleRecord} of one shard (its JSON is read again after dropping out of the LRU cache)."""
        (record,) = self.index.store.shard_records([self.index.manifest.shards[shard].shard])
        return {s.key: s for s in record.samples}

    def close(self) -> None:
        self.index.store.close()

    def raw(self, shard: int, key: str) -> tuple[dict, dict]:
        """(meta, tensors) of one sample; ShardFormatError names the shard, sample and member of any corruption."""
        name, where = self.index.manifest.shards[shard].shard, self.index.shards[shard]
        record = self._records(shard).get(key)
        if record is None:
            raise ShardFormatError(f"{self.index.store.where(json_path(name).as_posix())}: no sample {key}")
        try:
            members = read_members(lambda offset, size: self.index.store.read_range(name, offset, size), record)
        except (*STORE_ERRORS, EOFError) as err:  # a truncated file, or the object store failed
            raise ShardFormatError(f"{where}: sample {key}: unreadable: {err}") from None
        return read_sample(where, key, members, self.index.manifest.schema, record)
