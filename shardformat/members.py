"""Sample members: how one training sample's tensors and metadata become tar members, and back.

Every tensor is an `.npy` member, bf16 stored as its uint16 bits; a member whose zstd frame is at least 10 % smaller
is stored as `.npy.zst` (frames carry a content checksum); `meta.json` records every tensor's dtype, shape and
compression so a reader can restore and verify it. Each member's CRC-32 is recorded in the shard's JSON
(shardformat.shard) and checked on every read. A reader allocates no more than a member declares in ways its bytes
bear out: a zstd frame's content size is capped (MAX_MEMBER_BYTES), and an `.npy` header must account for exactly
the bytes that follow it.
"""

from __future__ import annotations

import io
import json
import math
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
import zstandard

from wampipe.shardformat.keys import parse_key
from wampipe.shardformat.layout import META, tensor_suffix

if TYPE_CHECKING:  # torch is imported where a bf16 tensor is met: the CLIs' --help stays quick
    import torch

ZSTD_LEVEL = 3
COMPRESS_MODES = ("auto", "none", "all")
# zstd is kept only where it saves at least this fraction: bf16 latents are near-incompressible noise.
MIN_SAVING = 0.10
MAX_MEMBER_BYTES = 1 << 30  # 1 GiB: far above any tensor of a sample (the 14B latents are ~1 MiB)


def checksum(data: bytes) -> int:
    """The per-member checksum the shard JSON records (CRC-32)."""
    return zlib.crc32(data)


def to_numpy_bits(value: np.ndarray | torch.Tensor) -> tuple[np.ndarray, str]:
    """An array to store and its logical dtype name; bf16 becomes its uint16 bit pattern."""
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.uint16).numpy(), "bfloat16"
        value = tensor.numpy()
    return np.ascontiguousarray(value), str(value.dtype)


def from_numpy_bits(array: np.ndarray, dtype: str) -> np.ndarray | torch.Tensor:
    """Inverse of `to_numpy_bits`: bf16 comes back as a torch tensor, everything else as numpy."""
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(array.astype(np.uint16, copy=False)).view(torch.bfloat16)
    if str(array.dtype) != dtype:
        raise ValueError(f"stored dtype {array.dtype} does not match recorded dtype {dtype}")
    return array


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def encode_sample(key: str, tensors: dict[str, Any], meta: dict, compress: str = "auto") -> list[tuple[str, bytes]]:
    """Tar members of one sample, in a fixed order: tensors sorted by name, then meta.json."""
    parse_key(key)
    if compress not in COMPRESS_MODES:
        raise ValueError(f"compress must be one of {COMPRESS_MODES}")
    members, records = [], {}
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
    for name in sorted(tensors):
        if "." in name:
            raise ValueError(f"tensor name {name!r} must not contain '.'")
        array, dtype = to_numpy_bits(tensors[name])
        raw = npy_bytes(array)
        packed = compressor.compress(raw) if compress != "none" else raw
        use_zstd = compress == "all" or (compress == "auto" and len(packed) <= (1 - MIN_SAVING) * len(raw))
        members.append((f"{key}.{tensor_suffix(name, use_zstd)}", packed if use_zstd else raw))
        records[name] = {"dtype": dtype, "shape": list(array.shape), "zstd": use_zstd}
    meta = {**meta, "tensors": records}
    members.append((f"{key}.{META}", json.dumps(meta, sort_keys=True).encode()))
    return members


def split_member_name(name: str) -> tuple[str, str]:
    """`key.latents.npy.zst` -> (`key`, `latents.npy.zst`); keys are dot-free, so the first dot splits."""
    key, _, suffix = name.partition(".")
    return key, suffix


def load_npy(data: bytes, suffix: str) -> np.ndarray:
    """`np.load` of a member's `.npy` bytes once its header's shape and dtype account for exactly the bytes stored:
    numpy allocates the array the header declares before reading, so a crafted header would size the allocation."""
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        shape, _, dtype = read_header[version](f)
    except (ValueError, KeyError) as err:
        raise ValueError(f"member {suffix}: not an .npy array ({err})") from None
    declared, stored = math.prod(shape) * dtype.itemsize, len(data) - f.tell()
    if declared != stored:
        raise ValueError(f"member {suffix}: its header declares {declared} bytes of data, it holds {stored}")
    return np.load(io.BytesIO(data), allow_pickle=False)


def decompress(decompressor: zstandard.ZstdDecompressor, data: bytes, suffix: str) -> bytes:
    """A member's zstd frame, whose content size (in its header, as every writer records it) is at most
    MAX_MEMBER_BYTES: the output buffer is allocated at that size before decompressing."""
    size = zstandard.frame_content_size(data) if data else -1
    if not 0 <= size <= MAX_MEMBER_BYTES:
        raise ValueError(f"member {suffix}: zstd frame of content size {size}, not between 0 and {MAX_MEMBER_BYTES}")
    try:
        return decompressor.decompress(data)
    except zstandard.ZstdError as err:
        raise ValueError(f"member {suffix}: {err}") from None


def decode_members(members: dict[str, bytes]) -> tuple[dict, dict[str, np.ndarray | torch.Tensor]]:
    """{suffix: bytes} of one sample (suffixes as `split_member_name` gives) -> (meta, tensors).

    Raises ValueError naming the member for anything that does not match meta.json.
    """
    if META not in members:
        raise ValueError(f"no {META} member")
    meta = json.loads(members[META])
    records = meta.get("tensors", {}) if isinstance(meta, dict) else None
    if not isinstance(records, dict) or not all(
        isinstance(r, dict) and {"dtype", "shape", "zstd"} <= r.keys() for r in records.values()
    ):
        raise ValueError(f"{META}: tensors is not a record of dtype, shape and zstd per tensor")
    tensors = {}
    seen = {META}
    decompressor = zstandard.ZstdDecompressor()
    for name, record in records.items():
        suffix = tensor_suffix(name, record["zstd"])
        if suffix not in members:
            raise ValueError(f"member {suffix} listed in {META} is missing")
        seen.add(suffix)
        data = members[suffix]
        array = load_npy(decompress(decompressor, data, suffix) if record["zstd"] else data, suffix)
        if list(array.shape) != record["shape"]:
            raise ValueError(f"member {suffix} has shape {list(array.shape)}, {META} says {record['shape']}")
        tensors[name] = from_numpy_bits(array, record["dtype"])
    extra = sorted(set(members) - seen)
    if extra:
        raise ValueError(f"members {extra} are not listed in {META}")
    return meta, tensors
