"""The sample index: one fixed-size row per sample of a shard directory, in one numpy file (`samples.npy`) that the
manifest seals by sha256.

A row holds what a reader needs to fetch and verify a sample without any shard JSON: its episode, window start and
variant (its key is `<dataset>-e<episode>-s<start>-v<variant>`), anchor multiplicity, shard, and per member slot the
member's name (an id into the manifest's `sample_index.members`), data offset in the tar, size and CRC-32. Rows are
sorted by (episode, start, variant), so the variants of one window are neighbours and window w is the w-th run of
equal (episode, start); for window starts below 10^5 and episodes below 10^6 (every real dataset) this is the
order of the window names as strings, which the trainer's epoch order has always used.

The file is opened by memory map: every rank of a node and each of their loader workers share its pages, and no
process holds a Python object per sample. Checks run over the whole file in blocks of BLOCK rows (bounded
temporaries): rows sorted and unique, shards and member ids in range, every member inside its tar's recorded size,
counts per shard as the manifest says, one anchor multiplicity per window.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from wampipe.shardformat.files import atomic_writer, sha256_file, sha256_regular
from wampipe.shardformat.keys import parse_key, sample_key
from wampipe.shardformat.manifest import ShardEntry, ShardFormatError, check_sha256
from wampipe.shardformat.layout import META, SAMPLE_INDEX, tensor_suffix
from wampipe.shardformat.shard import MemberRef, SampleRecord, ShardRecord, json_path

FREE = 255  # the member id of an unused slot (a sample with fewer members than the widest one)
MAX_SLOTS = 64
BLOCK = 1 << 18  # rows checked at a time: ~30 MiB of temporaries at 8 member slots
U32 = 1 << 32


def row_dtype(slots: int) -> np.dtype:
    """One sample's row with `slots` member slots (packed: 16 + 17 x slots bytes)."""
    return np.dtype(
        [
            ("episode", "<u4"),
            ("start", "<u4"),
            ("variant", "<u2"),
            ("multiplicity", "<u2"),
            ("shard", "<u4"),
            ("member", "u1", (slots,)),
            ("offset", "<u8", (slots,)),
            ("size", "<u4", (slots,)),
            ("crc32", "<u4", (slots,)),
        ]
    )


def member_names(schema: dict) -> list[str]:
    """Every member name a sample of `schema` can have (each tensor stored plain or zstd-compressed, and meta.json):
    the names a build's rows refer to by position."""
    return sorted({META} | {tensor_suffix(t, z) for t in schema for z in (False, True)})


def shard_index_rows(shard: int, samples: Sequence[SampleRecord], names: list[str], slots: int) -> np.ndarray:
    """The rows of one shard's samples (in tar order), member ids into `names`. ValueError for a value a row cannot
    hold."""
    ids = {name: i for i, name in enumerate(names)}
    rows = np.zeros(len(samples), row_dtype(slots))
    rows["member"], rows["shard"] = FREE, shard
    for r, s in enumerate(samples):
        key = parse_key(s.key)
        if (
            key.episode >= U32
            or key.start >= U32
            or key.variant >= 1 << 16
            or len(s.members) > slots
            or not 0 <= s.anchor_multiplicity < 1 << 16
        ):
            raise ValueError(f"sample {s.key}: episode, start, variant, members or anchor multiplicity out of range")
        n = len(s.members)
        rows[r]["episode"], rows[r]["start"], rows[r]["variant"] = key.episode, key.start, key.variant
        rows[r]["multiplicity"] = s.anchor_multiplicity
        rows[r]["member"][:n] = [ids[m.name] for m in s.members]
        rows[r]["offset"][:n] = [m.offset for m in s.members]
        rows[r]["size"][:n] = [m.size for m in s.members]
        rows[r]["crc32"][:n] = [m.crc32 for m in s.members]
    return rows


def index_rows(shards: Iterable[tuple[int, Sequence[SampleRecord]]]) -> tuple[np.ndarray, list[str]]:
    """(rows sorted by (episode, start, variant), member names) of the samples of `shards`: (shard position, its
    samples in tar order). ValueError for a key twice, or a value a row cannot hold."""
    shards = [(i, list(samples)) for i, samples in shards]
    names = sorted({m.name for _, samples in shards for s in samples for m in s.members})
    slots = max((len(s.members) for _, samples in shards for s in samples), default=1)
    if len(names) >= FREE or slots > MAX_SLOTS:
        raise ValueError(f"{len(names)} member names, {slots} members per sample: more than a row holds")
    parts = [shard_index_rows(i, samples, names, slots) for i, samples in shards]
    rows = np.concatenate(parts) if parts else np.zeros(0, row_dtype(slots))
    rows = rows[np.lexsort((rows["variant"], rows["start"], rows["episode"]))]
    same = _same_key(rows[1:], rows[:-1])
    if same.any():
        r = rows[1:][same][0]
        raise ValueError(f"sample at episode {r['episode']} start {r['start']} variant {r['variant']} appears twice")
    return rows, names


def write_index(path: Path, rows: np.ndarray, names: list[str]) -> dict:
    """Write `rows` as a .npy file at `path` (atomically); returns the manifest's `sample_index` block without its
    file name."""
    with atomic_writer(path) as f:
        np.lib.format.write_array(f, rows, allow_pickle=False)
    return {"sha256": sha256_file(path), "count": int(len(rows)), "members": names}


def write_sample_index(out: Path, records: Sequence[dict]) -> dict:
    """The sample index of the shards whose JSON records (`ShardRecord.to_dict`) are `records`, in their order,
    written into `out`; returns the manifest's `sample_index` block."""
    shards = [(i, ShardRecord.from_dict(r, json_path(r["shard"])).samples) for i, r in enumerate(records)]
    rows, names = index_rows(shards)
    return {"file": SAMPLE_INDEX, **write_index(Path(out) / SAMPLE_INDEX, rows, names)}


def _same_key(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a["episode"] == b["episode"]) & (a["start"] == b["start"]) & (a["variant"] == b["variant"])


def _after(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether each row of `a` sorts strictly after the row of `b` at the same position."""
    return (a["episode"] > b["episode"]) | (
        (a["episode"] == b["episode"])
        & ((a["start"] > b["start"]) | ((a["start"] == b["start"]) & (a["variant"] > b["variant"])))
    )


class SampleTable:
    """The verified, memory-mapped sample index of one shard directory (the file at `path`, a local path or a local
    copy of a remote one), checked against the manifest's `block` and `shards` and its sha256. ShardFormatError
    names `where` (the index file as the user knows it) and the row."""

    def __init__(self, path: Path | str, where: str, block: dict, shards: Sequence[ShardEntry], dataset: str):
        self.path, self.where, self.dataset = str(path), where, dataset
        self.names = list(block["members"])
        self.shard_names = [s.shard for s in shards]
        try:
            check_sha256(where, sha256_regular(path), block["sha256"])
            self.rows = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            if isinstance(err, ShardFormatError):
                raise
            raise ShardFormatError(f"{where}: unreadable: {err}") from None
        if self.rows.ndim != 1 or self.rows.dtype.names is None:
            raise ShardFormatError(f"{where}: not a table of samples")
        slots = self.rows.dtype["member"].shape[0] if "member" in self.rows.dtype.names else 0
        if not 0 < slots <= MAX_SLOTS or self.rows.dtype != row_dtype(slots):
            raise ShardFormatError(f"{where}: rows of {self.rows.dtype}, not this format's")
        if len(self.rows) != block["count"] or len(self.rows) != sum(s.count for s in shards):
            raise ShardFormatError(
                f"{where}: {len(self.rows)} samples, the manifest says {block['count']} and its "
                f"shards {sum(s.count for s in shards)}"
            )
        self.window_starts = self._check(shards)

    def __getstate__(self) -> dict:
        """A loader worker maps the same file again (already verified by its parent) instead of copying the rows."""
        return {k: v for k, v in self.__dict__.items() if k != "rows"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.rows = np.load(self.path, mmap_mode="r", allow_pickle=False)

    def _check(self, shards: Sequence[ShardEntry]) -> np.ndarray:
        """Check every row; returns the first row of each window (and, last, the row count)."""
        n, sizes = len(self.rows), np.array([s.bytes for s in shards], np.uint64)
        counts = np.zeros(len(shards), np.int64)
        starts, names = [], len(self.names)
        for lo in range(0, n, BLOCK):
            block = np.asarray(self.rows[lo : lo + BLOCK])
            before = np.asarray(self.rows[max(lo - 1, 0) : lo + len(block) - 1])
            bad = np.flatnonzero(block["shard"] >= len(shards))
            if bad.size:
                self._refuse(lo + bad[0], f"shard {block['shard'][bad[0]]} of {len(shards)}")
            used = block["member"] != FREE
            bad = np.flatnonzero(
                (~used[:, 0]) | ((block["member"] >= names) & used).any(1) | (~used[:, :-1] & used[:, 1:]).any(1)
            )
            if bad.size:
                self._refuse(lo + bad[0], f"member ids {block['member'][bad[0]].tolist()} of {names} names")
            ends = block["offset"] + block["size"].astype(np.uint64)
            bad = np.flatnonzero(
                (((ends > sizes[block["shard"]][:, None]) | (ends < block["offset"])) & used).any(1)
            ).tolist()
            if bad:
                shard = int(block["shard"][bad[0]])
                self._refuse(
                    lo + bad[0],
                    f"a member lies outside the {sizes[shard]} bytes of "
                    f"{self.shard_names[shard]} (crafted or corrupt): rebuild the shards",
                )
            counts += np.bincount(block["shard"], minlength=len(shards))
            head = block if lo else block[1:]
            bad = np.flatnonzero(~_after(head, before)).tolist()
            if bad:
                self._refuse(
                    lo + bad[0] + (0 if lo else 1), "rows not sorted by (episode, start, variant), or a sample twice"
                )
            new = (head["episode"] != before["episode"]) | (head["start"] != before["start"])
            same_window = ~new
            bad = np.flatnonzero(same_window & (head["multiplicity"] != before["multiplicity"])).tolist()
            if bad:
                self._refuse(
                    lo + bad[0] + (0 if lo else 1), "the variants of its window disagree on anchor_multiplicity"
                )
            starts.append(np.flatnonzero(new) + lo + (0 if lo else 1))
        differ = np.flatnonzero(counts != [s.count for s in shards]).tolist()
        if differ:
            raise ShardFormatError(
                f"{self.where}: {counts[differ[0]]} samples in {self.shard_names[differ[0]]}, the "
                f"manifest says {shards[differ[0]].count}"
            )
        return np.concatenate([[0] if n else [], *starts, [n]]).astype(np.int64)

    def _refuse(self, row: int, reason: str):
        raise ShardFormatError(f"{self.where}: row {row}: {reason}")

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_windows(self) -> int:
        return len(self.window_starts) - 1

    def window_rows(self, w: int) -> range:
        return range(int(self.window_starts[w]), int(self.window_starts[w + 1]))

    def multiplicities(self) -> np.ndarray:
        """Anchor multiplicity of each window."""
        return np.asarray(self.rows["multiplicity"][self.window_starts[:-1]], np.int64)

    def key(self, row: int) -> str:
        r = self.rows[row]
        return sample_key(self.dataset, int(r["episode"]), int(r["start"]), int(r["variant"]))

    def shard(self, row: int) -> int:
        return int(self.rows[row]["shard"])

    def record(self, row: int) -> SampleRecord:
        """The sample's record, as its shard JSON states it."""
        r = self.rows[row]
        used = int((r["member"] != FREE).sum())
        return SampleRecord(
            self.key(row),
            int(r["multiplicity"]),
            tuple(
                MemberRef(self.names[int(r["member"][i])], int(r["offset"][i]), int(r["size"][i]), int(r["crc32"][i]))
                for i in range(used)
            ),
        )

    def shard_rows(self, shard: int) -> list[int]:
        """The rows of one shard in tar order (a scan of the index: for tools, not the training loop)."""
        rows = np.flatnonzero(np.asarray(self.rows["shard"]) == shard)
        return rows[np.argsort(np.asarray(self.rows["offset"][rows, 0]), kind="stable")].tolist()

    def find(self, key: str) -> int | None:
        """The row of sample `key`, or None (a binary search over the sorted rows)."""
        try:
            k = parse_key(key)
        except ValueError:
            return None
        if k.dataset != self.dataset:
            return None
        target = (k.episode, k.start, k.variant)

        def at(i: int) -> tuple[int, int, int]:
            return int(self.rows[i]["episode"]), int(self.rows[i]["start"]), int(self.rows[i]["variant"])

        row = bisect.bisect_left(range(len(self.rows)), target, key=at)
        return row if row < len(self.rows) and at(row) == target else None
