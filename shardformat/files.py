"""Durable file writes and hashing: a file becomes visible only complete, under its final name.

Every write goes to a hidden temporary name unique to the writing process (`.<name>.wampipe-<pid>-<random>.tmp`,
so two processes racing on one path never share a temporary file), is fsynced, renamed over the target, and the
rename is made durable by fsyncing the directory. The `wampipe-` marker tells these temporaries apart from a user's
own hidden files: cleanups delete only names that `is_temporary` accepts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator


def sha256_file(path: Path | str, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TEMPORARY = re.compile(r"\..+\.wampipe-\d+-[0-9a-f]{8}\.tmp")


def temporary_path(path: Path) -> Path:
    """A hidden sibling name no other process (or earlier call) uses, marked as this package's (`is_temporary`)."""
    return path.with_name(f".{path.name}.wampipe-{os.getpid()}-{secrets.token_hex(4)}.tmp")


def is_temporary(path: Path) -> bool:
    """Whether `path` is named as a temporary of `temporary_path` (only those are ever cleaned up)."""
    return TEMPORARY.fullmatch(path.name) is not None


@contextmanager
def atomic_writer(path: Path | str) -> Iterator[BinaryIO]:
    """Open a binary file that appears at `path` only when the block completes; on error nothing appears."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def canonical_json(obj) -> bytes:
    """The JSON bytes every writer uses (sorted keys), so a file's hash is a function of its content."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def atomic_write_json(path: Path | str, obj) -> None:
    atomic_write_bytes(path, canonical_json(obj))
