"""Durable file writes, hashing and directory locks: a file becomes visible only complete, under its final name.

Every write goes to a hidden temporary name unique to the writing process (`.<name>.wampipe-<pid>-<random>.tmp`,
so two processes racing on one path never share a temporary file), is fsynced, renamed over the target, and the
rename is made durable by fsyncing the directory. The `wampipe-` marker tells these temporaries apart from a user's
own hidden files: cleanups delete only names that `is_temporary` accepts.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from wampipe.errors import UsageError


class NotRegularFile(OSError):
    """A path that is a link, pipe, device or folder where a regular file belongs."""


def open_regular(path: Path | str) -> int:
    """A read-only descriptor of the regular file at `path`, opened without following a link and without blocking
    (a FIFO would block a reader forever, a link to /dev/zero feed it without end); NotRegularFile otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, f"{path}: a link, not a regular file: refused") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"{path}: not a regular file (a pipe, device or folder): refused")
    return fd


def sha256_regular(path: Path | str, block: int = 1 << 22) -> str:
    """`sha256_file` of a file of a shard directory, which must be a regular file (`open_regular`)."""
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike, block: int = 1 << 22) -> str:
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


def lock_directory(lock: Path, what: str, instead: str, shared: bool = False) -> int:
    """Lock the directory of the file `lock` for this process: an flock (shared, for the array jobs of one build) on
    `lock`, which then names this process's pid; the returned descriptor holds it until closed (or the process ends,
    however it ends). The lock file is never a link (a planted one would make this truncate the file it points to)
    nor anything but a plain file of its own. UsageError in one line where it cannot be the lock, or another `what`
    holds it; both name `instead`, what to do otherwise."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        why = "a symbolic link" if os.path.islink(lock) else err.strerror
        raise UsageError(f"{lock}: cannot be the lock file ({why}): remove it, or {instead}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise UsageError(
                f"{lock}: not a plain file of its own (a device, pipe or hard link): remove it, or {instead}"
            )
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise UsageError(
                f"{lock.parent} is in use by another {what} (pid {holder}): wait for it to end, or {instead}"
            ) from None
        os.ftruncate(fd, 0)  # every holder names itself: the pid shown is a process that holds the directory now
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def free_space(path: Path) -> str:
    """How much its file system has left, for the line of a failed write."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return "free space unknown"
    return f"{fs.f_bavail * fs.f_frsize / 2**20:.1f} MiB free there"
