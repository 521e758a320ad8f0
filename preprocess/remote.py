"""`preprocess shards --out s3://bucket/prefix`: build in a local staging directory, then upload the finished files.

    url = remote_url(args.out)                        # None: --out is a local directory, built in place
    staging = staging_dir(url, args.staging_dir)      # a private local folder named after the URL, kept for resuming
    check_access(url)                                 # credentials, bucket, write and delete rights: before any unit
    prefetch_remote_state(url, staging, overwrite)    # the remote build's inputs.json, so other inputs are refused
    ... the build claims and writes `staging` as any local --out ...
    if published(url, staging): ...                   # the remote already holds this very build: nothing to do
    publish(staging, url, overwrite=overwrite)        # inputs.json, tars, their JSONs, the rest, manifest.json last

What marks a finished unit (`work/unit-N.tar` + `.json`) stays in the staging directory: object storage receives
only the finished shard directory. An interrupted remote build therefore resumes from the same staging directory:
rerun with the same --out (the default staging folder is derived from the URL and the user) or the same
--staging-dir. An interrupted upload resumes by itself: `publish` skips files already remote with the same size and
sha256. The remote prefix follows the local directory's ownership rule (preprocess.outdir.ownership): a foreign
file at a name the build writes is refused at start, another build is replaced only with --overwrite, and only its
own files are deleted. Every storage failure ends the run with one line: the URL, the operation, the reason and
what to do.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from wampipe.errors import UsageError, WampipeError
from wampipe.preprocess import outdir
from wampipe.shardformat.files import atomic_write_bytes
from wampipe.shardformat.layout import INPUTS, MANIFEST
from wampipe.shardformat.storage import S3_PROTOCOLS, STORE_ERRORS, ShardStore, SyncReport, sync_up, upload_order

try:  # a connection dropped mid-transfer, after s3fs's retries
    from aiohttp import ClientError

    FAILURES: tuple[type[BaseException], ...] = (*STORE_ERRORS, ClientError)
except ImportError:
    FAILURES = STORE_ERRORS
PROBE = ".wampipe-probe"  # the object check_access writes and deletes again
AT_START = "check the URL, the bucket, the AWS_* variables and the network, then run again"
RESUME = "run the same command again to resume (finished units and uploaded files are kept)"


def remote_url(out: str | Path) -> str | None:
    """`out` when it is a URL (s3://..., file://...): the build is staged locally and uploaded; None for a path."""
    out = str(out)
    return out.rstrip("/") if "://" in out else None


def staging_dir(url: str, staging: Path | None = None) -> Path:
    """Where the build for `url` is made: `staging` if given, else a folder named after the URL in this user's
    private folder of the system temporary directory, so a rerun with the same --out finds its finished units."""
    if staging is not None:
        return Path(staging)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", url.split("://", 1)[1]).strip("-")[-60:]
    private = _private_dir(Path(tempfile.gettempdir()) / f"wampipe-staging-{os.getuid()}")
    return private / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def _private_dir(path: Path) -> Path:
    """`path` as a folder only this user can enter: made with mode 0700, or refused when it exists as anything else
    (a link, another user's, or open to others), since other users can create names in a shared temporary folder."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise UsageError(
            f"{path}: not a private folder of this user (a link, another user's, or open to others), so "
            f"the default staging folder cannot be used: remove it, or pass --staging-dir"
        )
    return path


class RemoteError(WampipeError):
    """Object storage failed an operation of the build (network, credentials, permissions): names the URL, the
    operation, the reason and what to do."""


@contextmanager
def failures(url: str, operation: str, advice: str = RESUME) -> Iterator[None]:
    """Turn a storage failure of the block into one line: URL, operation, reason, advice."""
    try:
        yield
    except FAILURES as err:
        reason = " ".join(str(err).split()).rstrip(".") or type(err).__name__
        raise RemoteError(f"{url}: {operation} failed: {reason}; {advice}") from None


def check_access(url: str) -> None:
    """Before any unit is built: on S3 the credentials and the bucket (one listing), then the right to write and to
    delete there (a small private probe object, written and deleted again)."""
    store = ShardStore(url)
    try:
        if store.is_local:  # makes the filesystem, reading the WAMPIPE_S3_* timeouts
            return
    except ValueError as err:
        raise UsageError(str(err)) from None
    if store.protocol in S3_PROTOCOLS:
        bucket, _, prefix = url.split("://", 1)[1].partition("/")
        with failures(url, f"list bucket {bucket}", AT_START):
            # s3fs's S3FileSystem has call_s3(); fsspec's base class, the type of `fs`, does not
            store.fs.call_s3(  # pyright: ignore[reportAttributeAccessIssue]
                "list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1
            )
    probe = f"{PROBE}-{os.getpid()}-{secrets.token_hex(4)}"
    with failures(url, f"write and delete {probe}", AT_START):
        store.fs.pipe_file(store.path(probe), b"")
        store.remove(probe)


def _remote_state(store: ShardStore) -> tuple[list[str], bytes | None]:
    """(the remote build's own files, its inputs.json or None); refuses a foreign file at a name a build writes."""
    own, foreign = outdir.ownership(store.list(), store.read_bytes)
    outdir.refuse_foreign(store.url, foreign)
    return own, store.read_bytes(INPUTS) if INPUTS in own else None


def prefetch_remote_state(url: str, staging: Path, overwrite: bool = False) -> None:
    """Bring the remote build's `inputs.json` into the staging directory (when it has none), so the run's usual
    check (preprocess.outdir.claim) refuses other inputs than the remote was built from. A staging directory that
    records other inputs than the remote refuses to start, and so does a remote that holds a build without a record
    of its inputs. With `overwrite` the remote build is replaced whatever it was made from: nothing is brought. A
    foreign file at a name the build writes is refused either way."""
    with failures(url, "read the remote build's record"):
        own, remote = _remote_state(ShardStore(url))
    if overwrite or not own:
        return
    if remote is None:
        raise UsageError(
            f"{url} holds a build without {INPUTS} (an older wampipe wrote it): pass --overwrite to "
            f"replace it, or use another --out"
        )
    staging.mkdir(parents=True, exist_ok=True)
    local = staging / INPUTS
    if not local.is_file():
        atomic_write_bytes(local, remote)
    elif local.read_bytes() != remote:
        raise UsageError(
            f"{url}/{INPUTS} differs from {local}: the staging directory holds another build than "
            f"{url}; pass --overwrite to replace the remote build, or use another --staging-dir"
        )


def published(url: str, staging: Path) -> bool:
    """Whether `url` already holds the finished build of the staging directory's inputs (its manifest and the same
    inputs.json), so there is nothing to build or upload."""
    store = ShardStore(url)
    local = staging / INPUTS
    with failures(url, "read the remote build's record"):
        if not (local.is_file() and store.exists(MANIFEST) and store.exists(INPUTS)):
            return False
        return store.read_bytes(INPUTS) == local.read_bytes()


def publish(
    staging: Path, url: str, progress: Callable[[str, str], None] | None = None, overwrite: bool = False
) -> SyncReport:
    """Upload the finished staging directory to `url`. Another build there is refused without `overwrite`, and with
    it first loses its manifest (the remote reads as unfinished from then on) and its own files beyond this build's;
    a foreign file at a name the build writes is refused either way. Then shardformat.storage.sync_up uploads
    inputs.json, tars, their JSONs, the rest and manifest.json last, skipping files already there with the same size
    and sha256. `progress(relpath, action)` replaces the progress bar."""
    files = upload_order(staging)
    store = ShardStore(url)
    local = (staging / INPUTS).read_bytes() if (staging / INPUTS).is_file() else None
    bar = tqdm(total=len(files), desc=f"upload {url}", unit="file", disable=progress is not None)

    def advance(relpath: str, action: str) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{action} {relpath}")

    try:
        with failures(url, "upload"):
            own, remote = _remote_state(store)
            if own and remote != local and not overwrite:
                raise UsageError(
                    f"{url} holds another build (its {INPUTS} differs from {staging / INPUTS}); nothing "
                    f"was uploaded or deleted: pass --overwrite to replace it, or use another --out"
                )
            if MANIFEST in own and store.read_bytes(MANIFEST) != (staging / MANIFEST).read_bytes():
                store.remove(MANIFEST)
            for stale in sorted(set(own) - set(files) - {MANIFEST}):
                store.remove(stale)
            return sync_up(staging, url, progress or advance)
    finally:
        bar.close()  # before an error's one line, so that line is the last one printed
