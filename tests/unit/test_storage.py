"""Shard directories on object storage, against a real S3 server on localhost (moto's, in its own process)."""

import pytest

from wampipe.preprocess.check import check
from wampipe.shardformat.storage import MANIFEST, sync_up, upload_order


def test_upload_order_puts_tars_first_manifest_last_and_leaves_out_spills(shard_dir):
    order = upload_order(shard_dir)
    tars = sorted(p.name for p in shard_dir.glob("shard-*.tar"))
    assert len(tars) == 4 and (shard_dir / "work").is_dir()
    assert order[: len(tars)] == tars
    assert order[len(tars) : 2 * len(tars)] == [t.replace(".tar", ".json") for t in tars]
    rest = order[2 * len(tars) : -1]
    assert {"metadata.json", "text/embeddings.safetensors", "text/prompts.json"} <= set(rest)
    assert not [p for p in rest if p.startswith(("shard-", "work/", ".")) or p.endswith((".lock", ".tmp"))]
    assert order[-1] == MANIFEST
    everything = {p.relative_to(shard_dir).as_posix() for p in shard_dir.rglob("*") if p.is_file()}
    assert everything - set(order) == {".shard-000009.tar.123.0a1b2c3d.tmp", "finalize.lock"} | {
        p for p in everything if p.startswith("work/")
    }


def test_sync_up_to_a_local_directory_passes_the_integrity_check(shard_dir, tmp_path):
    target = tmp_path / "copy"
    report = sync_up(shard_dir, f"file://{target}")
    assert report.uploaded == upload_order(shard_dir)
    assert check(target) == []
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()) == sorted(report.uploaded)
    assert sync_up(shard_dir, target).skipped == report.uploaded


def test_sync_up_refuses_an_unfinished_directory(shard_dir, tmp_path):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "shard-000000.tar").write_bytes((shard_dir / "shard-000000.tar").read_bytes())
    with pytest.raises(FileNotFoundError, match="manifest.json: missing"):
        sync_up(unfinished, tmp_path / "remote")
    assert not (tmp_path / "remote").exists()
