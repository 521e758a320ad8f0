"""`preprocess shards --out s3://bucket/prefix`: build in a local staging directory, then upload the finished files.

    url = remote_url(args.out)                        # None: --out is a local directory, built in place
    staging = staging_dir(url, args.staging_dir)      # a local folder named after the URL, kept for resuming
    prefetch_remote_state(url, staging, overwrite)    # the remote build's inputs.json, so other inputs are refused
    ... the build claims and writes `staging` as any local --out ...
    if published(url, staging): ...                   # the remote already holds this very build: nothing to do
    publish(staging, url)                             # tars, their JSONs, the rest, manifest.json last

What marks a finished unit (`work/unit-N.tar` + `.json`) stays in the staging directory: object storage receives
only the finished shard directory. An interrupted remote build therefore resumes from the same staging directory:
rerun with the same --out (the default staging folder is derived from the URL) or the same --staging-dir. An
interrupted upload resumes by itself: `publish` skips files already remote with the same size and sha256.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from preprocess.outdir import INPUTS
from shardformat.files import atomic_write_bytes
from shardformat.manifest import MANIFEST
from shardformat.storage import ShardStore, SyncReport, sync_up, upload_order

SHARD_FILE = re.compile(r"shard-\d{6,}\.(tar|json)")  # preprocess.write.SHARD_PATTERN and its JSON


def remote_url(out: str | Path) -> str | None:
    """`out` when it is a URL (s3://..., file://...): the build is staged locally and uploaded; None for a path."""
    out = str(out)
    return out.rstrip("/") if "://" in out else None


def staging_dir(url: str, staging: Path | None = None) -> Path:
    """Where the build for `url` is made: `staging` if given, else a folder under the system temporary directory
    named after the URL, so a rerun with the same --out finds its finished units again."""
    if staging is not None:
        return Path(staging)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", url.split("://", 1)[1]).strip("-")[-60:]
    return Path(tempfile.gettempdir()) / "wampipe-staging" / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def prefetch_remote_state(url: str, staging: Path, overwrite: bool = False) -> None:
    """Bring the remote build's `inputs.json` into the staging directory (when it has none), so the run's usual
    check (preprocess.outdir.claim) refuses other inputs than the remote was built from. A staging directory that
    records other inputs than the remote refuses to start. With `overwrite` the remote build is replaced whatever
    it was made from: nothing is brought."""
    store = ShardStore(url)
    if overwrite or not store.exists(INPUTS):
        return
    remote = store.read_bytes(INPUTS)
    staging.mkdir(parents=True, exist_ok=True)
    local = staging / INPUTS
    if not local.is_file():
        atomic_write_bytes(local, remote)
    elif local.read_bytes() != remote:
        raise SystemExit(f"{store.where(INPUTS)} differs from {local}: the staging directory holds another build "
                         f"than {url}; pass --overwrite to replace the remote build, or use another --staging-dir")


def published(url: str, staging: Path) -> bool:
    """Whether `url` already holds the finished build of the staging directory's inputs (its manifest and the same
    inputs.json), so there is nothing to build or upload."""
    store = ShardStore(url)
    local = staging / INPUTS
    if not (local.is_file() and store.exists(MANIFEST) and store.exists(INPUTS)):
        return False
    return store.read_bytes(INPUTS) == local.read_bytes()


def publish(staging: Path, url: str, progress: Callable[[str, str], None] | None = None) -> SyncReport:
    """Upload the finished staging directory to `url`. A different build there first loses its manifest (the remote
    reads as unfinished from then on) and its shards beyond this build's; then shardformat.storage.sync_up uploads
    tars, their JSONs, the rest and manifest.json last, skipping files already there with the same size and sha256.
    `progress(relpath, action)` replaces the progress bar."""
    files = upload_order(staging)
    store = ShardStore(url)
    if store.exists(MANIFEST) and store.read_bytes(MANIFEST) != (staging / MANIFEST).read_bytes():
        store.remove(MANIFEST)
    for stale in sorted(set(filter(SHARD_FILE.fullmatch, store.list())) - set(files)):
        store.remove(stale)
    bar = tqdm(total=len(files), desc=f"upload {url}", unit="file", disable=progress is not None)

    def advance(relpath: str, action: str) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{action} {relpath}")

    report = sync_up(staging, url, progress or advance)
    bar.close()
    return report
