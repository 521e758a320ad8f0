"""The sample index (samples.npy): written by every producer, equal to what the shard JSONs say, sealed by the
manifest, checked row by row before use, and the only per-sample file a reader opens."""

import json
import re
from pathlib import Path

import pytest

from devtools.synthetic import make_synthetic_shards
from wampipe.preprocess.check import check
from wampipe.shardformat.keys import window_name
from wampipe.shardformat.manifest import Manifest
from wampipe.shardformat.shard import SampleRecord, ShardRecord, json_path
from wampipe.shardformat.storage import sync_up
from wampipe.train.data import ShardIndex


def shard_json_records(root: Path) -> list[list[SampleRecord]]:
    return [ShardRecord.read(root / json_path(e.shard)).samples for e in Manifest.read(root).shards]


@pytest.mark.e2e  # the real builds are the CLI's
@pytest.mark.parametrize("build", ["droid_shards", "libero_shards", "tiny_shards"])
def test_the_index_says_what_the_shard_jsons_say(build, request):
    """Real builds of the DROID and LIBERO sample data (and their validation splits) and a synthetic one: every
    sample of every shard JSON is a row, with the same key, multiplicity and members; windows group the variants."""
    root = request.getfixturevalue(build)
    for split in [root, *([root / "val"] if (root / "val" / "manifest.json").is_file() else [])]:
        index = ShardIndex(split)
        jsons = shard_json_records(split)
        table = index.table
        assert [[table.record(r) for r in table.shard_rows(s)] for s in range(len(jsons))] == jsons
        keys = sorted(s.key for samples in jsons for s in samples)
        assert [table.key(r) for r in range(len(table))] == keys
        assert [w.name for w in index.windows] == sorted({window_name(k) for k in keys})
        assert [k for w in index.windows for _, k in w.variants] == keys
        assert check(split) == []


def test_the_trainer_and_check_read_no_shard_json_from_object_storage(tmp_path, s3_bucket, s3_server):
    """Two builds of 3 and 12 shards: opening either for training reads the same files (manifest, index, statistics,
    text table) and lists once, whatever the shard count; no shard JSON is read, by the trainer or by `check`."""
    reads = []
    for shards in (3, 12):
        root = tmp_path / f"s{shards}"
        make_synthetic_shards(root, "tiny", episodes=shards, windows_per_episode=2, samples_per_shard=2)
        url = f"{s3_bucket}/s{shards}"
        sync_up(root, url)
        before = len(s3_server.requests())
        assert len(ShardIndex(url)) == 2 * shards
        got = [
            (m, p.split("/", 3)[-1] if m == "GET" and "." in p.rsplit("/", 1)[-1] else "")
            for m, p, _ in s3_server.requests()[before:]
        ]
        assert not [p for _, p in got if re.fullmatch(r"shard-\d+\.json", p)]
        reads.append(sorted(got))
        before = len(s3_server.requests())
        assert check(url) == []
        checked = [p for m, p, _ in s3_server.requests()[before:] if m == "GET"]
        assert sum(p.endswith(".tar") for p in checked) >= shards  # every tar read through...
        assert not [p for p in checked if re.search(r"shard-\d+\.json$", p)]  # ... and no shard JSON
    assert reads[0] == reads[1]
    assert json.dumps(reads[0]).count("samples.npy") >= 1


@pytest.mark.e2e  # a pool of processes writes the shards
def test_shards_written_by_two_processes_are_the_bytes_one_writes(tmp_path):
    """Each shard is a task of its own: the directory is the same, byte for byte, whoever wrote which shard; the
    work directory keeps nothing of the mixing but the plan and the rows of the shards."""
    for workers in (1, 2):
        make_synthetic_shards(
            tmp_path / f"w{workers}",
            "tiny",
            episodes=6,
            windows_per_episode=3,
            augment_variants=2,
            samples_per_shard=5,
            seed=3,
            workers=workers,
        )
    files = [
        {
            p.relative_to(tmp_path / f"w{w}"): p.read_bytes()
            for p in sorted((tmp_path / f"w{w}").rglob("*"))
            if p.is_file()
        }
        for w in (1, 2)
    ]
    assert files[0] == files[1] and Path("samples.npy") in files[0]
    assert not [p for p in files[0] if p.name.startswith("bucket-")]
