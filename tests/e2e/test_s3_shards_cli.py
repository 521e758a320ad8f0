"""`python -m preprocess shards --out s3://...` and `check s3://...` against the local S3 server: the remote build is
the local build, byte for byte, and a rerun finds it published."""

from __future__ import annotations

import subprocess

from wampipe.preprocess.check import check
from wampipe.shardformat.storage import MANIFEST, ShardStore
from tests.helpers import ROOT, manifest, shards_cmd


def test_shards_to_s3_equal_the_local_build_and_a_rerun_uploads_nothing(
    droid_shards, droid_root, tiny_checkpoints, s3_bucket, tmp_path
):
    url = f"{s3_bucket}/droid"
    cmd = shards_cmd(droid_root, url, "droid", tiny_checkpoints, "--staging-dir", str(tmp_path / "staging"))
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    assert check(url) == []
    store = ShardStore(url)
    assert store.read_json(MANIFEST)["shards"] == manifest(droid_shards)["shards"]
    for record in manifest(droid_shards)["shards"]:
        assert store.read_bytes(record["shard"]) == (droid_shards / record["shard"]).read_bytes()

    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    assert f"{url} already holds this build" in again.stdout
    done = subprocess.run([*cmd[:3], "check", url], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
