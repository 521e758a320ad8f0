"""A shard's JSON: where every member of every sample lies in the tar, its CRC-32, and the sample's weight.

`shard-000000.json` is written after its tar and read instead of scanning tar headers: random access (pread, or an
object-store ranged read) goes straight to a member's bytes, and every read is checked against the recorded CRC-32,
so a flipped byte stops the reader with the shard, sample and member named.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from wampipe.shardformat.layout import MANIFEST, SHARD_NAME
from wampipe.shardformat.manifest import (
    FORMAT_VERSION,
    ShardEntry,
    ShardFormatError,
    non_negative,
    read_sealed_json,
    relative_path,
    write_sealed_json,
)
from wampipe.shardformat.members import checksum, decode_members
from wampipe.shardformat.schema import check_sample


@dataclass(frozen=True)
class MemberRef:
    name: str  # suffix after the key: latents.npy, meta.json, ...
    offset: int  # of the data in the tar
    size: int
    crc32: int


@dataclass(frozen=True)
class SampleRecord:
    key: str
    anchor_multiplicity: int  # meta.json's, so sampling weights need no member decoded
    members: tuple[MemberRef, ...]


@dataclass
class ShardRecord:
    shard: str  # tar file name
    bytes: int
    sha256: str
    samples: list[SampleRecord]  # in tar order

    @property
    def count(self) -> int:
        return len(self.samples)

    @property
    def keys(self) -> list[str]:
        return [s.key for s in self.samples]

    def to_dict(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "shard": self.shard,
            "count": self.count,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "keys": self.keys,
            "samples": {
                s.key: {
                    "anchor_multiplicity": s.anchor_multiplicity,
                    "members": [[m.name, m.offset, m.size, m.crc32] for m in s.members],
                }
                for s in self.samples
            },
        }

    @classmethod
    def from_dict(cls, d: dict, where: Path | str) -> ShardRecord:
        try:
            samples = [
                SampleRecord(
                    k,
                    int(d["samples"][k]["anchor_multiplicity"]),
                    tuple(MemberRef(*m) for m in d["samples"][k]["members"]),
                )
                for k in d["keys"]
            ]
            record = cls(d["shard"], d["bytes"], d["sha256"], samples)
        except (KeyError, TypeError, ValueError) as err:
            raise ShardFormatError(f"{where}: malformed shard record ({type(err).__name__}: {err})") from None
        if record.count != d["count"] or len(d["samples"]) != record.count:
            raise ShardFormatError(f"{where}: count {d['count']}, {len(d['keys'])} keys, {len(d['samples'])} samples")
        relative_path(record.shard, where, "shard", SHARD_NAME)
        record.check_bounds(where)
        return record

    def check_bounds(self, where: Path | str) -> None:
        """Every member lies inside the tar's recorded bytes, so no read is sized by a number the tar cannot hold."""
        non_negative(self.bytes, where, "bytes")
        for sample in self.samples:
            if not sample.members:
                raise ShardFormatError(f"{where}: sample {sample.key}: no members")
            for m in sample.members:
                field = f"sample {sample.key}: member {m.name}"
                if not isinstance(m.name, str) or type(m.crc32) is not int:
                    raise ShardFormatError(f"{where}: {field}: malformed (name {m.name!r}, CRC-32 {m.crc32!r})")
                end = non_negative(m.offset, where, f"{field} offset") + non_negative(m.size, where, f"{field} size")
                if end > self.bytes:
                    raise ShardFormatError(
                        f"{where}: {field}: {m.size} bytes at offset {m.offset} lie outside the "
                        f"tar's {self.bytes} bytes (crafted or corrupt): rebuild the shards"
                    )

    def check_entry(self, entry: ShardEntry, where: Path | str) -> None:
        """ShardFormatError unless the JSON says what the manifest says of its shard (name, count, bytes, sha256)."""
        differ = [f for f in ("shard", "count", "bytes", "sha256") if getattr(self, f) != getattr(entry, f)]
        if differ:
            raise ShardFormatError(f"{where}: disagrees with {MANIFEST} ({', '.join(differ)})")

    @classmethod
    def read(cls, path: Path | str) -> ShardRecord:
        return cls.from_dict(read_sealed_json(Path(path)), path)

    def write(self, path: Path | str) -> None:
        write_sealed_json(Path(path), self.to_dict())


def json_path(shard_tar: Path | str) -> Path:
    """`shard-000000.tar` -> `shard-000000.json`."""
    return Path(shard_tar).with_suffix(".json")


def verify_members(shard: Path | str, sample: SampleRecord, members: dict[str, bytes]) -> None:
    """Check a sample's member bytes ({suffix: bytes}) against its record; ShardFormatError names what differs."""
    expected = {m.name: m for m in sample.members}
    if members.keys() != expected.keys():
        differ = [f"member {m} missing, the shard JSON lists it" for m in sorted(expected.keys() - members.keys())] + [
            f"member {m} not in the shard JSON" for m in sorted(members.keys() - expected.keys())
        ]
        raise ShardFormatError(f"{shard}: sample {sample.key}: {'; '.join(differ)}")
    for name, data in members.items():
        if len(data) != expected[name].size or checksum(data) != expected[name].crc32:
            raise ShardFormatError(f"{shard}: sample {sample.key}: member {name} checksum mismatch (corrupt shard)")


def read_members(read: Callable[[int, int], bytes], sample: SampleRecord) -> dict[str, bytes]:
    """One sample's member bytes ({suffix: bytes}), for `read_sample` to verify. `read(offset, size)` is called
    once, for the span from the first member's data to the last one's end (the tar headers between are a few hundred
    bytes each): one pread, or one ranged request to an object store."""
    start = min(m.offset for m in sample.members)
    span = read(start, max(m.offset + m.size for m in sample.members) - start)
    return {m.name: span[m.offset - start : m.offset - start + m.size] for m in sample.members}


def read_sample(
    shard: Path | str, key: str, members: dict[str, bytes], schema: dict, record: SampleRecord | None
) -> tuple[dict, dict]:
    """(meta, tensors) of one sample's member bytes ({suffix: bytes}), the one decode path of every reader (the
    trainer's, the webdataset decoder, `preprocess check`): the bytes checked against the shard JSON's `record`
    (sizes, CRC-32; None where the JSON is unusable), decoded against meta.json, the tensors against the manifest's
    `schema`, and the prompt ids present. ShardFormatError names the shard, sample and member otherwise."""
    if record is not None:
        verify_members(shard, record, members)
    try:
        meta, tensors = decode_members(members)
        check_sample(meta["tensors"], schema)
    except (ValueError, TypeError, KeyError) as err:  # decode_members raises ValueError; numpy and json their own
        raise ShardFormatError(f"{shard}: sample {key}: {err}") from None
    if not isinstance(meta.get("prompt_ids"), dict):  # a crafted meta.json: one line, not a KeyError where it is used
        raise ShardFormatError(f"{shard}: sample {key}: no prompt_ids")
    return meta, tensors
