"""The shard directory's manifest: format version, sealed JSON, the typed manifest and the wids shard index.

`manifest.json` is written last; its presence means the directory is complete. Every JSON file of the contract
(manifest, shard JSONs) is *sealed*: `content_sha256` is the sha256 of the file's canonical JSON without that field,
so an edited count, path or offset is caught on read, not trained on.

The seal is a checksum, not a signature: anyone who edits a file can seal it again. So nothing a shard directory
says is trusted beyond that: every path it names must lie inside it (`relative_path`), every number must be in
range (`non_negative`), and JSON files are refused above MAX_JSON_BYTES before they are parsed.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from wampipe.errors import WampipeError
from wampipe.shardformat.files import atomic_write_json, canonical_json
from wampipe.shardformat.layout import IMAGE_MEMBER, MANIFEST, SHARD_NAME, WIDS_INDEX
from wampipe.shardformat.schema import SchemaError, merge_schemas, model_dims, validate

# 2: per-member offsets and CRC-32 in shard JSONs, sealed JSON, wids.json; 3: the sample schema in the manifest;
# 4: the sample index (samples.npy), which readers use instead of the shard JSONs
FORMAT_VERSION = "wampipe-shards/4"
SEAL = "content_sha256"
MAX_JSON_BYTES = 1 << 28  # 256 MiB: far above any manifest or shard JSON, far below what exhausts a reader's memory
# (manifest block, field, pattern) of every file besides the shards that the manifest names
SIDE_FILES = (
    ("text_table", "file", re.compile(r".+\.safetensors")),
    ("text_table", "prompts", re.compile(r".+\.json")),
    ("statistics", "file", re.compile(r".+\.json")),
    ("sample_index", "file", re.compile(r"[^/]+\.npy")),
)


class ShardFormatError(WampipeError, ValueError):
    """A shard directory this code cannot use; `str(err)` names the file (and sample) and the reason."""


def relative_path(name, where, field: str, pattern: re.Pattern | None = None) -> str:
    """`name` if it is a path inside the shard directory: relative, `/`-separated, no empty, `.` or `..` part, no
    backslash or control character, and of `pattern` (matched whole) when given; else ShardFormatError naming the
    file `where` and the field."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if (
        any(p in ("", ".", "..") for p in parts)
        or any(c == "\\" or ord(c) < 32 for c in name)
        or (pattern is not None and not pattern.fullmatch(name))
    ):
        shape = f" of the form {pattern.pattern}" if pattern is not None else ""
        raise ShardFormatError(
            f"{where}: {field} {name!r} is not a relative path{shape} inside the shard directory "
            f"(crafted or corrupt): rebuild the shards"
        )
    return name


def non_negative(value, where, field: str) -> int:
    """`value` if it is a non-negative int (a count, size or offset), else ShardFormatError naming the field."""
    if type(value) is not int or value < 0:
        raise ShardFormatError(f"{where}: {field} is {value!r}, not a count of bytes or samples")
    return value


def check_sha256(where, digest: str, recorded) -> None:
    """ShardFormatError unless a file's sha256 is the one the manifest records for it."""
    if digest != recorded:
        raise ShardFormatError(f"{where}: sha256 differs from the manifest")


def check_json_size(where, size: int) -> None:
    """Refuse a JSON file before it is read whole or parsed when it is larger than any file of the format."""
    if size > MAX_JSON_BYTES:
        raise ShardFormatError(f"{where}: {size} bytes, more than any JSON file of the format ({MAX_JSON_BYTES})")


def content_sha256(obj: dict) -> str:
    return hashlib.sha256(canonical_json({k: v for k, v in obj.items() if k != SEAL})).hexdigest()


def write_sealed_json(path: Path, obj: dict) -> None:
    atomic_write_json(path, {**obj, SEAL: content_sha256(obj)})


def read_sealed_json(path: Path) -> dict:
    """A sealed JSON file of this format version, seal removed; ShardFormatError names the file otherwise."""
    try:
        check_json_size(path, Path(path).stat().st_size)
        data = Path(path).read_bytes()
    except OSError as err:
        raise ShardFormatError(f"{path}: unreadable: {err}") from None
    return parse_sealed_json(data, path)


def parse_sealed_json(data: bytes, where: Path | str) -> dict:
    """`read_sealed_json` of bytes already read (from object storage); `where` names the file."""
    check_json_size(where, len(data))
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


def check_version(path: Path | str, version) -> None:
    if version != FORMAT_VERSION:
        raise ShardFormatError(
            f"{path}: format {version!r}, this code reads {FORMAT_VERSION!r}: rebuild the shards "
            f"with this version (python -m preprocess shards)"
        )


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
    sample_index: dict  # file, sha256, count, members (the member names its rows refer to): shardformat.samples
    member_bytes: dict
    schema: dict  # {tensor member: {dtype, shape}}, the same in every sample (shardformat.schema)
    failures: list
    skipped: list
    totals: dict
    image_features: str = "encoded"  # what a sample holds of frame 0: CLIP features, or CLIP's input pixels
    # the held-out episodes (--val-episodes): split ("train" | "val"), choice, episodes and, in the training split's
    # manifest, val_dir; empty for a build without a validation split
    validation: dict = field(default_factory=dict)
    # which episodes and rows the build used (preprocess.selection: filters, counts, unreadable episodes); empty
    # for a build of every episode and row
    selection: dict = field(default_factory=dict)
    format: str = FORMAT_VERSION

    @classmethod
    def from_dict(cls, d: dict, where: Path | str = MANIFEST) -> Manifest:
        check_version(Path(where), d.get("format"))
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing, unknown = sorted(required - d.keys()), sorted(d.keys() - names)
        if missing or unknown:
            raise ShardFormatError(f"{where}: missing fields {missing}, unknown fields {unknown}")
        for f in fields(cls):
            kind = {"dict": dict, "list": list, "str": str, "int": int}[f.type.partition("[")[0]]
            if f.name in d and not isinstance(d[f.name], kind):
                raise ShardFormatError(f"{where}: {f.name} is a {type(d[f.name]).__name__}, not a {kind.__name__}")
        try:
            shards = [ShardEntry(**s) for s in d["shards"]]
        except TypeError as err:
            raise ShardFormatError(f"{where}: bad shard entry: {err}") from None
        for i, s in enumerate(shards):
            relative_path(s.shard, where, f"shards[{i}].shard", SHARD_NAME)
            non_negative(s.count, where, f"shards[{i}].count")
            non_negative(s.bytes, where, f"shards[{i}].bytes")
        if len({s.shard for s in shards}) != len(shards):
            raise ShardFormatError(f"{where}: shards lists a shard twice")
        for block, name, pattern in SIDE_FILES:
            relative_path(d[block].get(name), where, f"{block}.{name}", pattern)
        members = d["sample_index"].get("members")
        if (
            not isinstance(members, list)
            or not all(isinstance(m, str) for m in members)
            or not isinstance(d["sample_index"].get("sha256"), str)
        ):
            raise ShardFormatError(f"{where}: sample_index needs sha256 and a list of member names")
        non_negative(d["sample_index"].get("count"), where, "sample_index.count")
        if d.get("image_features", "encoded") not in IMAGE_MEMBER:
            raise ShardFormatError(f"{where}: image_features {d['image_features']!r} is none of {sorted(IMAGE_MEMBER)}")
        if d.get("validation", {}).get("val_dir") is not None:
            relative_path(d["validation"]["val_dir"], where, "validation.val_dir")
        if set(d["modality_keys"]) != {"state", "action"}:
            raise ShardFormatError(f"{where}: modality_keys must name the state and action sub-keys")
        total = sum(s.count for s in shards)
        if d["totals"].get("samples") != total:
            raise ShardFormatError(f"{where}: totals.samples is {d['totals'].get('samples')}, the shards hold {total}")
        try:
            validate(d["schema"], d.get("image_features", "encoded"), total)
        except SchemaError as err:
            raise ShardFormatError(f"{where}: {err}") from None
        return cls(**{**d, "shards": shards})

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("validation", "selection"):  # a build without either keeps the manifest of builds before them
            if not out[name]:
                del out[name]
        return out

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

    @property
    def dims(self) -> dict:
        """The DiT fields its samples fix (shardformat.schema.model_dims), read from the schema."""
        return model_dims(self.schema)

    def wids_index(self) -> dict:
        """The shard list in wids' format; urls are relative to the file, so the directory can move."""
        return {
            "__kind__": "wids-shard-index-v1",
            "wids_version": 1,
            "name": self.dataset,
            "shardlist": [{"url": s.shard, "nsamples": s.count, "filesize": s.bytes} for s in self.shards],
        }


def build_manifest(units: list[dict], shards: list[dict], **fields) -> Manifest:
    """The manifest of a finished build (real or synthetic), checked: `units` are the records of the units it mixed
    (their samples' schema, episodes encoded, failures and skips), `shards` those of its shards (shard, count,
    bytes, sha256, ...), `fields` every other Manifest field (source, dataset, ..., statistics, sample_index,
    member_bytes)."""
    failures = [f for u in units for f in u["failures"]]
    skipped = [s for u in units for s in u["skipped"]]
    entries = [{k: s[k] for k in ("shard", "count", "bytes", "sha256")} for s in shards]
    try:
        schema = merge_schemas([u["schema"] for u in units if u["count"]])
    except SchemaError as err:
        raise ShardFormatError(str(err)) from None
    totals = {
        "samples": sum(s["count"] for s in entries),
        "bytes": sum(s["bytes"] for s in entries),
        "shards": len(entries),
        "episodes_encoded": sum(len(u["encoded"]) for u in units),
        "episodes_failed": len(failures),
        "episodes_skipped": len(skipped),
    }
    return Manifest.from_dict(
        {
            "format": FORMAT_VERSION,
            **fields,
            "shards": entries,
            "schema": schema,
            "failures": failures,
            "skipped": skipped,
            "totals": totals,
        }
    )
