"""The shard directory's manifest: format version, sealed JSON, the typed manifest and the wids shard index.

`manifest.json` is written last; its presence means the directory is complete. Every JSON file of the contract
(manifest, shard JSONs) is *sealed*: `content_sha256` is the sha256 of the file's canonical JSON without that field,
so an edited count, path or offset is caught on read, not trained on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from shardformat.files import atomic_write_json, canonical_json
from shardformat.keys import IMAGE_MEMBER

FORMAT_VERSION = "wampipe-shards/2"  # 2: per-member offsets and CRC-32 in shard JSONs, sealed JSON, wids.json
MANIFEST = "manifest.json"
WIDS_INDEX = "wids.json"
SEAL = "content_sha256"


class ShardFormatError(ValueError):
    """A shard directory this code cannot use; `str(err)` names the file (and sample) and the reason."""


def content_sha256(obj: dict) -> str:
    return hashlib.sha256(canonical_json({k: v for k, v in obj.items() if k != SEAL})).hexdigest()


def write_sealed_json(path: Path, obj: dict) -> None:
    atomic_write_json(path, {**obj, SEAL: content_sha256(obj)})


def read_sealed_json(path: Path) -> dict:
    """A sealed JSON file of this format version, seal removed; ShardFormatError names the file otherwise."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ShardFormatError(f"{path}: unreadable: {err}") from None
    return parse_sealed_json(data, path)


def parse_sealed_json(data: bytes, where: Path | str) -> dict:
    """`read_sealed_json` of bytes already read (from object storage); `where` names the file."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ShardFormatError(f"{where}: unreadable: {err}") from None
    if not isinstance(obj, dict):
        raise ShardFormatError(f"{where}: not a JSON object")
    check_version(where, obj.get("format"))
    if obj.get(SEAL) != content_sha256(obj):
        raise ShardFormatError(f"{where}: {SEAL} does not match the content (edited or corrupt)")
    obj.pop(SEAL)
    return obj


def check_version(path: Path, version) -> None:
    if version != FORMAT_VERSION:
        raise ShardFormatError(f"{path}: format {version!r}, this code reads {FORMAT_VERSION!r}: rebuild the shards "
                               f"with this version (python -m preprocess shards)")


@dataclass(frozen=True)
class ShardEntry:
    """The manifest's line for one shard."""

    shard: str
    count: int
    bytes: int
    sha256: str


@dataclass
class Manifest:
    """Everything `manifest.json` records (docs/FORMAT.md); `from_dict` validates, `to_dict` is what is written."""

    source: dict  # root, fingerprint, codebase version, episodes, fps
    dataset: str
    embodiment: str  # the statistics tag in metadata.json
    model: str
    modality_keys: dict  # {"state": [...], "action": [...]}: sub-keys, in the column order of state.npy / action.npy
    transform: dict
    encoders: dict
    samples_per_shard: int
    seed: int
    compress: str
    shards: list[ShardEntry]
    text_table: dict  # file, prompts, count, sha256
    statistics: dict  # file, sha256
    member_bytes: dict
    failures: list
    skipped: list
    totals: dict
    image_features: str = "encoded"  # what a sample holds of frame 0: CLIP features, or CLIP's input pixels
    format: str = FORMAT_VERSION

    @classmethod
    def from_dict(cls, d: dict, where: Path | str = MANIFEST) -> Manifest:
        check_version(Path(where), d.get("format"))
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing, unknown = sorted(required - d.keys()), sorted(d.keys() - names)
        if missing or unknown:
            raise ShardFormatError(f"{where}: missing fields {missing}, unknown fields {unknown}")
        try:
            shards = [ShardEntry(**s) for s in d["shards"]]
        except TypeError as err:
            raise ShardFormatError(f"{where}: bad shard entry: {err}") from None
        if d.get("image_features", "encoded") not in IMAGE_MEMBER:
            raise ShardFormatError(f"{where}: image_features {d['image_features']!r} is none of {sorted(IMAGE_MEMBER)}")
        if set(d["modality_keys"]) != {"state", "action"}:
            raise ShardFormatError(f"{where}: modality_keys must name the state and action sub-keys")
        total = sum(s.count for s in shards)
        if d["totals"].get("samples") != total:
            raise ShardFormatError(f"{where}: totals.samples is {d['totals'].get('samples')}, the shards hold {total}")
        return cls(**{**d, "shards": shards})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def image_member(self) -> str:
        """The tensor every sample holds for frame 0: `clip` (features) or `clip_pixels` (the trainer runs CLIP)."""
        return IMAGE_MEMBER[self.image_features]

    @classmethod
    def read(cls, root: Path | str) -> Manifest:
        path = Path(root) / MANIFEST
        if not path.is_file():
            raise ShardFormatError(f"{path}: missing (an unfinished run, or not a shard directory)")
        return cls.from_dict(read_sealed_json(path), path)

    def write(self, root: Path | str) -> None:
        """wids.json, then manifest.json (last: it marks the directory complete)."""
        root = Path(root)
        atomic_write_json(root / WIDS_INDEX, self.wids_index())
        write_sealed_json(root / MANIFEST, self.to_dict())

    def wids_index(self) -> dict:
        """The shard list in wids' format; urls are relative to the file, so the directory can move."""
        return {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": self.dataset,
                "shardlist": [{"url": s.shard, "nsamples": s.count, "filesize": s.bytes} for s in self.shards]}
