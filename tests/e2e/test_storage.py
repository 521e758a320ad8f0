"""Shard directories on object storage, against a real S3 server on localhost (moto's, in its own process)."""

import multiprocessing
import os
import tarfile
from pathlib import Path

import pytest

from wampipe.shardformat.files import sha256_file
from wampipe.shardformat.storage import MANIFEST, ShardStore, sync_up, upload_order
from devtools.s3 import upload_then_sigkill


def _members(tar: Path) -> list[tuple[int, int]]:
    """(offset, size) of every member's data."""
    with tarfile.open(tar) as f:
        return [(m.offset_data, m.size) for m in f]


def _gets(server, key: str) -> list[str]:
    """Status codes of the server's GETs of `key` so far (its request log, written before each response)."""
    return [status for method, path, status in server.requests() if method == "GET" and path.endswith(key)]


def test_ranged_reads_equal_local_bytes(shard_dir, s3_bucket, s3_server):
    url = f"{s3_bucket}/tiny"
    sync_up(shard_dir, url)
    stores = [ShardStore(url), ShardStore(shard_dir), ShardStore(f"file://{shard_dir}")]
    for store in stores:
        assert store.read_json(MANIFEST) == ShardStore(shard_dir).read_json(MANIFEST)
        for tar in sorted(shard_dir.glob("shard-*.tar")):
            data = tar.read_bytes()
            assert store.size(tar.name) == len(data)
            for offset, size in _members(tar):
                assert store.read_range(tar.name, offset, size) == data[offset : offset + size]
        with pytest.raises(EOFError, match="shard-000000.tar: .* wanted 10"):
            store.read_range("shard-000000.tar", store.size("shard-000000.tar") - 4, 10)
        with pytest.raises(FileNotFoundError, match="shard-000042.json: missing"):
            store.read_json("shard-000042.json")
    # A ranged read is one request: a 206 partial GET, nothing listed or fetched whole.
    before = len(_gets(s3_server, "tiny/shard-000001.tar"))
    offset, size = _members(shard_dir / "shard-000001.tar")[3]
    stores[0].read_range("shard-000001.tar", offset, size)
    assert _gets(s3_server, "tiny/shard-000001.tar")[before:] == ["206"]


def test_cache_fetches_each_file_once_and_replaces_a_truncated_copy(shard_dir, s3_bucket, s3_server, tmp_path):
    url, bucket = f"{s3_bucket}/tiny", s3_bucket.removeprefix("s3://")
    sync_up(shard_dir, url)
    tar = shard_dir / "shard-000002.tar"
    data, members = tar.read_bytes(), _members(tar)
    store = ShardStore(url, cache_dir=tmp_path / "cache")
    for offset, size in members:
        assert store.read_range(tar.name, offset, size) == data[offset : offset + size]
    copy = tmp_path / "cache" / bucket / "tiny" / tar.name
    assert copy.read_bytes() == data
    assert not [p for p in copy.parent.iterdir() if p.name.startswith(".")]  # no temporary left
    gets = len(_gets(s3_server, f"tiny/{tar.name}"))
    other = ShardStore(url, cache_dir=tmp_path / "cache")  # another worker finds the copy complete
    assert [other.read_range(tar.name, o, s) for o, s in members] == [data[o : o + s] for o, s in members]
    assert len(_gets(s3_server, f"tiny/{tar.name}")) == gets

    os.truncate(copy, len(data) // 2)  # a copy cut short (disk full, another tool): fetched again
    offset, size = members[-1]
    assert ShardStore(url, cache_dir=tmp_path / "cache").read_range(tar.name, offset, size) == data[offset:][:size]
    assert copy.read_bytes() == data


@pytest.mark.slow
def test_sync_up_killed_midway_leaves_no_manifest_and_resumes(shard_dir, s3_bucket, tmp_path):
    url = f"{s3_bucket}/tiny"
    store = ShardStore(url)
    stale = tmp_path / "stale-manifest.json"
    stale.write_text('{"shards": []}\n')
    store.upload(stale, MANIFEST)  # an earlier, different run: its manifest must not outlive the new upload's start
    order = upload_order(shard_dir)

    # killed by SIGKILL after the second tar
    assert upload_then_sigkill("shardformat.storage:sync_up", shard_dir, url) == [
        ["uploaded", order[0]],
        ["uploaded", order[1]],
    ]
    assert store.list() == order[:2] and not store.exists(MANIFEST)

    # Objects written by another tool carry no recorded hash: one identical (read back and skipped), one of the
    # same size with other bytes (uploaded again).
    tar2 = shard_dir / order[2]
    store.fs.pipe_file(store.path(order[2]), tar2.read_bytes())
    side = shard_dir / order[4]
    store.fs.pipe_file(store.path(order[4]), bytes(side.stat().st_size))
    seen = []
    report = sync_up(shard_dir, url, lambda p, a: seen.append(p))
    assert seen == order
    assert report.skipped == order[:3] and report.uploaded == order[3:]
    assert store.list() == sorted(order)
    assert all(store.sha256(p) == sha256_file(shard_dir / p) for p in order)
    assert sync_up(shard_dir, url).uploaded == []


def _read_every_other(stores: list[ShardStore], name: str, members: list, worker: int, results) -> None:
    results.put((worker, [[s.read_range(name, offset, size) for offset, size in members[worker::2]] for s in stores]))


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_read_with_their_own_connections(shard_dir, s3_bucket, tmp_path, start_method):
    """Stores already used by the parent (live connections, event loop thread), direct and cached, read in worker
    processes: forked workers inherit them as they are, spawned ones get them pickled, as DataLoader workers do."""
    url = f"{s3_bucket}/tiny"
    sync_up(shard_dir, url)
    tar = shard_dir / "shard-000003.tar"
    data, members = tar.read_bytes(), _members(tar)
    expected = [data[o : o + s] for o, s in members]
    stores = [ShardStore(url), ShardStore(url, cache_dir=tmp_path / "cache")]
    for store in stores:
        assert store.read_range(tar.name, *members[0]) == expected[0]
    ctx = multiprocessing.get_context(start_method)
    results = ctx.Queue()
    workers = [ctx.Process(target=_read_every_other, args=(stores, tar.name, members, i, results)) for i in range(2)]
    for w in workers:
        w.start()
    got = dict(results.get(timeout=120) for _ in workers)
    for w in workers:
        w.join(timeout=30)
        assert w.exitcode == 0
    assert got == {i: [expected[i::2]] * len(stores) for i in range(2)}
