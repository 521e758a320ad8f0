"""Shard directories on any fsspec filesystem: a plain path, file://, s3://, gs:// (the last with gcsfs installed).

    store = ShardStore("s3://bucket/shards/droid", cache_dir="/scratch/shard-cache")
    manifest = store.manifest()                                 # validated; ShardFormatError names the file
    data = store.read_range("shard-000003.tar", offset, size)   # one ranged GET on S3, or a pread of the cached copy
    sync_up("shards/droid", "s3://bucket/shards/droid")          # tars, their JSONs, the rest, manifest.json last

S3: the endpoint and credentials come from the standard AWS variables (AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_S3,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION); endpoint and region are passed to s3fs explicitly, since
botocore reads neither AWS_REGION nor, in every version, AWS_ENDPOINT_URL. Each request gives up after
S3_CONNECT_TIMEOUT seconds without a connection or S3_READ_TIMEOUT seconds without an answer (variables
WAMPIPE_S3_CONNECT_TIMEOUT, WAMPIPE_S3_READ_TIMEOUT), so a stalled endpoint fails within a minute (s3_options_from_env).
Keyword arguments of ShardStore go to the filesystem and win over the environment.

Processes: the filesystem object (and its connection pool) is made lazily by the process that reads and is never
pickled, so one store can be handed to DataLoader workers, forked or spawned; each worker opens its own
connections once and reuses them for every read.

Cache: with `cache_dir`, the first read of a remote file downloads it whole to `cache_dir/<bucket>/<path>` under a
temporary name and renames it (workers racing on one file each write a complete copy; the last rename wins); later
reads pread the copy. Files of a shard directory never change once written, so a copy whose size differs from the
remote file (truncated, or left by another run) is simply fetched again. Local stores ignore the cache. Files that
must be opened by name (the text table, for safetensors) get the same copy from `local_root`, into the cache or,
without one, into a temporary directory of the process.

Reads of the format: `manifest()` and `shard_records()` (the shard JSONs, READ_MANY requests in flight at a time)
check the seals and name the file of any problem (ShardFormatError). Every relative path, whether a caller's or a
manifest's, must lie inside the directory, and every local copy inside its cache or temporary directory
(shardformat.manifest.relative_path); JSON files are read up to MAX_JSON_BYTES and refused beyond.

Uploads are atomic: an S3 PUT (or multipart upload) makes the object visible only complete, and records the
file's sha256 as object metadata so a resumed `sync_up` skips it without reading it back; a local target is
written to a unique temporary name, fsynced and renamed.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, cast

import fsspec
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import get_protocol

from wampipe.errors import UsageError
from wampipe.shardformat.files import atomic_writer, open_regular, sha256_file
from wampipe.shardformat.layout import INPUTS, MANIFEST, WORK_DIR
from wampipe.shardformat.manifest import (
    MAX_JSON_BYTES,
    Manifest,
    ShardFormatError,
    check_json_size,
    parse_sealed_json,
    relative_path,
)
from wampipe.shardformat.shard import ShardRecord, json_path

COPY_BLOCK = 1 << 23  # 8 MiB per read when streaming a whole file
S3_PROTOCOLS = ("s3", "s3a")
READ_MANY = 64  # files in flight together when reading many small ones (the index's shard JSONs)
try:  # what a failed request raises: OSError, or botocore's own errors (no connection, no credentials)
    from botocore.exceptions import BotoCoreError

    STORE_ERRORS: tuple[type[BaseException], ...] = (OSError, BotoCoreError)
except ImportError:
    STORE_ERRORS = (OSError,)


S3_CONNECT_TIMEOUT = 5.0  # seconds to open a connection (WAMPIPE_S3_CONNECT_TIMEOUT)
S3_READ_TIMEOUT = 10.0  # seconds of silence while waiting for a response (WAMPIPE_S3_READ_TIMEOUT)
# s3fs tries a request that timed out S3FileSystem.retries (5) times with short pauses (1.9 s in all): a stalled
# endpoint fails after about 5 x 10 + 2 = 52 s. botocore's own retries would multiply that, so it tries once.
S3_TRIES = 5  # s3fs's S3FileSystem.retries
S3_PAUSES = sum(min(1.7**i * 0.1, 15) for i in range(S3_TRIES))  # s3fs's waits between its tries


def request_deadline() -> float:
    """The longest one read of an object may take, end to end: a connection and s3fs's tries of a silent read with
    their pauses. Why a deadline on top of the timeouts: s3fs retries a ranged read around calls that retry
    themselves, so a frozen endpoint (a hung proxy) held a reader for 25 read timeouts (over four minutes)."""
    return (
        _seconds("WAMPIPE_S3_CONNECT_TIMEOUT", S3_CONNECT_TIMEOUT)
        + S3_TRIES * _seconds("WAMPIPE_S3_READ_TIMEOUT", S3_READ_TIMEOUT)
        + S3_PAUSES
    )


def s3_options_from_env() -> dict:
    """The endpoint and region of the standard AWS variables, and bounded connect and read timeouts, as s3fs
    keyword arguments."""
    options: dict = {
        "config_kwargs": {
            "connect_timeout": _seconds("WAMPIPE_S3_CONNECT_TIMEOUT", S3_CONNECT_TIMEOUT),
            "read_timeout": _seconds("WAMPIPE_S3_READ_TIMEOUT", S3_READ_TIMEOUT),
            "retries": {"total_max_attempts": 1},
        }
    }
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["client_kwargs"] = {"region_name": region}
    return options


def _seconds(variable: str, default: float) -> float:
    value = os.environ.get(variable)
    try:
        seconds = default if value is None else float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{variable}={value}: not a positive number of seconds")
    return seconds


@dataclass
class _ProcessState:
    """What one process opened: the filesystem with its connections, file descriptors, checked cache copies."""

    pid: int
    fs: fsspec.AbstractFileSystem
    root: str
    fds: dict[str, int] = field(default_factory=dict)
    cached: dict[str, Path] = field(default_factory=dict)
    deadline: float | None = None  # request_deadline, read from the environment at the first remote read


class ShardStore:
    """Reads and atomic uploads of the files of one shard directory, given as a URL or a path."""

    def __init__(self, url: str | os.PathLike, cache_dir: str | os.PathLike | None = None, **storage_options):
        self.url = str(url).rstrip("/")
        self.protocol = get_protocol(self.url)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.storage_options = storage_options
        self.build: str | None = None  # the manifest's sha256 (16 hex digits), once read
        self._state: _ProcessState | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_state": None}  # connections and descriptors belong to the process that opened them

    def _process(self) -> _ProcessState:
        if self._state is None or self._state.pid != os.getpid():
            options = {**(s3_options_from_env() if self.protocol in S3_PROTOCOLS else {}), **self.storage_options}
            # A private instance: fsspec's shared instances would hand a forked worker its parent's event loop.
            try:
                fs, root = fsspec.core.url_to_fs(
                    self.url, skip_instance_cache=True, use_listings_cache=False, **options
                )
            except ImportError as err:  # the filesystem's package is missing; fsspec's message names no extra
                need = "s3:// URLs need s3fs: pip install 'wampipe[s3]'" if self.protocol in S3_PROTOCOLS else err
                raise UsageError(f"{self.url}: {need}") from None
            self._state = _ProcessState(os.getpid(), fs, root.rstrip("/"))
        return self._state

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self._process().fs

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, relpath: str) -> str:
        """The filesystem path of a file of the directory; ShardFormatError unless `relpath` lies inside it."""
        return f"{self._process().root}/{relative_path(relpath, self.url, 'file')}"

    def where(self, relpath: str) -> str:
        """The file's URL, for messages."""
        return f"{self.url}/{relative_path(relpath, self.url, 'file')}"

    # ------------------------------------------------------------ reads

    def read_bytes(self, relpath: str) -> bytes:
        """A small file whole, as `read_many` reads it."""
        return self.read_many([relpath])[0]

    def read_json(self, relpath: str):
        return json.loads(self.read_bytes(relpath))

    def read_many(self, relpaths: list[str]) -> list[bytes]:
        """Small files (JSON) whole, in order, each refused (ShardFormatError) above MAX_JSON_BYTES before more is read:
        a local file's size is looked up first, an object is read with a range ending one byte past the limit. On an
        object store up to READ_MANY requests are in flight together."""
        out = []
        for i in range(0, len(relpaths), READ_MANY):
            chunk = relpaths[i : i + READ_MANY]
            if self.is_local:  # regular files only, their size checked before they are read
                out += [self._read_local(relpath) for relpath in chunk]
                continue
            end = MAX_JSON_BYTES + 1
            found = self._bounded(self.fs.cat_ranges, [self.path(p) for p in chunk], 0, end, on_error="return")
            for relpath, data in zip(chunk, found):
                if isinstance(data, FileNotFoundError):
                    raise FileNotFoundError(f"{self.where(relpath)}: missing")
                if isinstance(data, BaseException):
                    raise data
                check_json_size(self.where(relpath), len(data))
                out.append(data)
        return out

    def _read_local(self, relpath: str) -> bytes:
        """A small local file whole: a regular file (files.open_regular) of at most MAX_JSON_BYTES."""
        try:
            fd = open_regular(self.path(relpath))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.where(relpath)}: missing") from None
        with os.fdopen(fd, "rb") as f:
            check_json_size(self.where(relpath), os.fstat(f.fileno()).st_size)
            return f.read(MAX_JSON_BYTES + 1)

    def read_sealed_json(self, relpath: str, data: bytes | None = None, missing: str = "missing") -> dict:
        """A sealed JSON file of the format (shardformat.manifest), seal checked and removed; ShardFormatError
        names the file when it is missing, unreadable or not sealed. `data`: its bytes, when already read."""
        where = self.where(relpath)
        try:
            data = self.read_bytes(relpath) if data is None else data
        except FileNotFoundError:
            raise ShardFormatError(f"{where}: {missing}") from None
        except STORE_ERRORS as err:  # permissions, network
            raise ShardFormatError(f"{where}: unreadable: {err}") from None
        return parse_sealed_json(data, where)

    def manifest(self) -> Manifest:
        """The directory's manifest, validated; ShardFormatError names the file when it is missing or unusable. Its
        sha256 names the build from then on: local copies of remote files are kept per build (`_copy_path`), so a
        prefix rebuilt with other data never reuses the copies of the old one."""
        where = self.where(MANIFEST)
        try:
            data = self.read_bytes(MANIFEST)
        except FileNotFoundError:
            raise ShardFormatError(f"{where}: missing (an unfinished run, or not a shard directory)") from None
        except STORE_ERRORS as err:
            raise ShardFormatError(f"{where}: unreadable: {err}") from None
        obj = self.read_sealed_json(MANIFEST, data)
        self.build = hashlib.sha256(data).hexdigest()[:16]
        return Manifest.from_dict(obj, where)

    def shard_records(self, names: list[str]) -> list[ShardRecord]:
        """The JSONs of the shards `names` (tar names), read together."""
        relpaths = [json_path(name).as_posix() for name in names]
        try:
            datas = self.read_many(relpaths)
        except FileNotFoundError as err:
            raise ShardFormatError(str(err)) from None
        except STORE_ERRORS as err:
            raise ShardFormatError(f"{self.url}: shard JSONs unreadable: {err}") from None
        return [
            ShardRecord.from_dict(self.read_sealed_json(path, data), self.where(path))
            for path, data in zip(relpaths, datas)
        ]

    def open(self, relpath: str) -> BinaryIO:
        """A binary file object for reading the whole file front to back (buffered on object stores)."""
        try:
            if self.is_local:
                return os.fdopen(open_regular(self.path(relpath)), "rb", buffering=COPY_BLOCK)
            # fsspec's open is typed for text modes too; in "rb" it gives a binary file object
            return cast(BinaryIO, self.fs.open(self.path(relpath), "rb", block_size=COPY_BLOCK))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.where(relpath)}: missing") from None

    def local_root(self, *relpaths: str) -> Path:
        """A local directory holding `relpaths` at their relative paths, for readers that open files by name
        (safetensors): the directory itself when local, else their copies in the cache or, without a cache, in a
        temporary directory of this process (removed when it exits); a copy of the remote size is reused."""
        if self.is_local:
            return Path(self._process().root)
        base = self.cache_dir or _process_temp_dir()
        for relpath in relpaths:
            self._fetch_to_cache(relpath, base)
        return self._copy_path(base)

    def _copy_path(self, base: Path, relpath: str = "") -> Path:
        """Where the copy of the directory, or of its file `relpath`, lies under `base` (the cache or this process's
        temporary directory): `<bucket>/<path>[/<relpath>]`, never outside `base`."""
        build = f"/build-{self.build}" if self.build else ""  # one copy per build of the prefix
        inside = self._process().root.lstrip("/") + build + (f"/{relpath}" if relpath else "")
        return base / relative_path(inside, self.where(relpath) if relpath else self.url, "local copy")

    def _bounded(self, call, *args, **kwargs):
        """`call` (an fsspec method) within `request_deadline`: a stalled endpoint is a TimeoutError."""
        state = self._process()
        if state.deadline is None:
            state.deadline = request_deadline()
        deadline = state.deadline
        try:
            return call(*args, timeout=deadline, **kwargs)
        except FSTimeoutError:
            raise TimeoutError(
                f"no answer from the endpoint within {deadline:.0f} s ({S3_TRIES} tries of "
                f"WAMPIPE_S3_READ_TIMEOUT seconds of silence)"
            ) from None

    def read_range(self, relpath: str, offset: int, size: int) -> bytes:
        """`size` bytes at `offset`: a pread of a local (or cached) file, else one ranged request."""
        if size == 0:
            return b""
        local = self._local_file(relpath)
        if local is None:
            # fsspec's inferred type for cat_file allows str (its open's text modes); it reads bytes
            data = cast(bytes, self._bounded(self.fs.cat_file, self.path(relpath), start=offset, end=offset + size))
        else:
            state = self._process()
            fd = state.fds.get(relpath)
            if fd is None:
                fd = state.fds[relpath] = open_regular(local)
            data = os.pread(fd, size, offset)
        if len(data) != size:
            raise EOFError(f"{self.where(relpath)}: {len(data)} bytes at offset {offset}, wanted {size} (truncated?)")
        return data

    def _local_file(self, relpath: str) -> str | Path | None:
        """A local path holding the file's bytes, or None when reads must go to the remote filesystem."""
        if self.is_local:
            return self.path(relpath)
        if self.cache_dir is None:
            return None
        state = self._process()
        if relpath not in state.cached:
            state.cached[relpath] = self._fetch_to_cache(relpath, self.cache_dir)
        return state.cached[relpath]

    def _fetch_to_cache(self, relpath: str, base: Path) -> Path:
        target = self._copy_path(base, relpath)
        size = self.size(relpath)
        if target.is_file() and target.stat().st_size == size:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_writer(target) as out, self.open(relpath) as src:
            shutil.copyfileobj(src, out, COPY_BLOCK)
            if out.tell() != size:
                raise EOFError(f"{self.where(relpath)}: downloaded {out.tell()} bytes, the listing says {size}")
        return target

    def close(self) -> None:
        """Close this process's file descriptors (connections close with the process)."""
        if self._state is not None and self._state.pid == os.getpid():
            for fd in self._state.fds.values():
                os.close(fd)
            self._state.fds.clear()

    # ------------------------------------------------------------ listing

    def exists(self, relpath: str) -> bool:
        return self.fs.exists(self.path(relpath))

    def size(self, relpath: str) -> int:
        try:
            # fsspec types the size Optional (an info that lacks one); a file's listing has it
            return cast(int, self.fs.size(self.path(relpath)))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.where(relpath)}: missing") from None

    def list(self) -> list[str]:
        """Every file under the directory, as sorted paths relative to it."""
        return sorted(self.sizes())

    def sizes(self) -> dict[str, int]:
        """Every file under the directory, as its path relative to it -> its size in bytes (one listing)."""
        root = self._process().root
        found = cast(dict[str, dict], self.fs.find(root, detail=True))  # detail=True: path -> info, not a list
        return {p[len(root) + 1 :]: info["size"] for p, info in found.items()}

    def sha256(self, relpath: str) -> str:
        """The file's sha256: the one recorded at upload on S3, else read through."""
        if self.protocol in S3_PROTOCOLS:
            # s3fs's S3FileSystem has metadata(); fsspec's base class, the type of `fs`, does not
            recorded = self.fs.metadata(self.path(relpath)).get("sha256")  # pyright: ignore[reportAttributeAccessIssue]
            if recorded:
                return recorded
        with self.fs.open(self.path(relpath), "rb") as f:
            # fsspec's open is typed for text modes too; in "rb" it gives a binary file, with the readinto needed
            return hashlib.file_digest(f, "sha256").hexdigest()  # pyright: ignore[reportArgumentType]

    # ------------------------------------------------------------ writes

    def upload(self, local: str | os.PathLike, relpath: str, sha256: str | None = None) -> None:
        """Copy a finished local file to `relpath` so that it appears only complete."""
        if self.is_local:
            target = Path(self.path(relpath))
            target.parent.mkdir(parents=True, exist_ok=True)
            with atomic_writer(target) as out, open(local, "rb") as src:
                shutil.copyfileobj(src, out, COPY_BLOCK)
        elif self.protocol in S3_PROTOCOLS:
            self.fs.put_file(os.fspath(local), self.path(relpath), Metadata={"sha256": sha256 or sha256_file(local)})
        else:  # object stores: an upload becomes visible only complete
            self.fs.put_file(os.fspath(local), self.path(relpath))

    def remove(self, relpath: str) -> None:
        self.fs.rm_file(self.path(relpath))


_TEMP_DIRS: dict[int, Path] = {}  # pid -> that process's temporary directory of `local_root`


def _process_temp_dir() -> Path:
    pid = os.getpid()
    if pid not in _TEMP_DIRS:
        _TEMP_DIRS[pid] = Path(tempfile.mkdtemp(prefix="wampipe-store-"))
        atexit.register(_remove_temp_dir, pid)
    return _TEMP_DIRS[pid]


def _remove_temp_dir(pid: int) -> None:
    if os.getpid() == pid and pid in _TEMP_DIRS:  # a forked child inherits the exit hook, not the directory
        shutil.rmtree(_TEMP_DIRS.pop(pid), ignore_errors=True)


def remove_temporary_copies() -> None:
    """Delete this process's temporary copies now: for an exit that skips Python's exit handlers (os._exit), which
    would otherwise leave a `wampipe-store-*` folder behind."""
    _remove_temp_dir(os.getpid())


# ---------------------------------------------------------------- sync


def upload_order(local_dir: Path) -> list[str]:
    """The files of a finished shard directory in the order that keeps the remote copy consistent at every moment:
    the build's record (inputs.json: a remote holding any file of a build holds it), tars, then their JSONs, then
    everything else (text table, statistics), manifest.json last. Leaves out the work/ spills and hidden
    (temporary) and lock files."""
    files = {
        p.relative_to(local_dir).as_posix()
        for p in local_dir.rglob("*")
        if p.is_file() and not _private(p.relative_to(local_dir))
    }

    def rank(name: str) -> int:
        if name == INPUTS:
            return -1
        if name == MANIFEST:
            return 3
        if name.endswith(".tar"):
            return 0
        return 1 if name.endswith(".json") and name.removesuffix(".json") + ".tar" in files else 2

    return sorted(files, key=lambda name: (rank(name), name))


def _private(relpath: Path) -> bool:
    hidden = any(part.startswith(".") for part in relpath.parts)  # temporaries of atomic writes
    return relpath.parts[0] == WORK_DIR or hidden or relpath.suffix == ".lock"


@dataclass
class SyncReport:
    uploaded: list[str]
    skipped: list[str]  # already remote with the same size and sha256


def sync_up(
    local_dir: str | os.PathLike, url: str | os.PathLike, progress: Callable[[str, str], None] | None = None
) -> SyncReport:
    """Upload a finished shard directory to `url` in `upload_order`, skipping files already there with the same
    size and sha256, so a rerun after an interruption resumes. `progress(relpath, "uploaded" | "skipped")` is called
    after each file. A different manifest.json already at `url` is removed first: the remote directory then counts
    as unfinished until the new manifest lands (readers that loaded the old one see its files change: give each
    run its own URL). Remote files the local directory lacks are left alone; a remote file at one of its names is
    replaced, so a caller that must not replace another build's files checks first (preprocess.remote.publish)."""
    local_dir = Path(local_dir)
    if not (local_dir / MANIFEST).is_file():
        raise FileNotFoundError(
            f"{local_dir / MANIFEST}: missing (an unfinished run; only finished shard directories are uploaded)"
        )
    store = ShardStore(url)
    report = SyncReport([], [])
    manifest_sha = sha256_file(local_dir / MANIFEST)
    if store.exists(MANIFEST) and not _same(store, MANIFEST, local_dir / MANIFEST, manifest_sha):
        store.remove(MANIFEST)
    for relpath in upload_order(local_dir):
        local = local_dir / relpath
        digest = manifest_sha if relpath == MANIFEST else sha256_file(local)
        skip = _same(store, relpath, local, digest)
        if not skip:
            store.upload(local, relpath, digest)
        (report.skipped if skip else report.uploaded).append(relpath)
        if progress is not None:
            progress(relpath, "skipped" if skip else "uploaded")
    return report


def _same(store: ShardStore, relpath: str, local: Path, sha256: str) -> bool:
    try:
        size = store.size(relpath)
    except FileNotFoundError:
        return False
    return size == local.stat().st_size and store.sha256(relpath) == sha256
