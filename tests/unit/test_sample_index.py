"""The sample index (samples.npy): written by every producer, equal to what the shard JSONs say, sealed by the
manifest, checked row by row before use, and the only per-sample file a reader opens."""

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from devtools.synthetic import make_synthetic_shards
from wampipe.preprocess.check import check
from wampipe.shardformat.manifest import Manifest, ShardFormatError
from wampipe.shardformat.samples import index_rows
from wampipe.shardformat.shard import MemberRef, SampleRecord
from wampipe.train.data import SampleReader, ShardIndex
from wampipe.train.dit.model import preset
from tests.helpers import edit_index, refused, reseal


@pytest.fixture
def copy(small_shards, tmp_path) -> Path:
    return Path(shutil.copytree(small_shards, tmp_path / "shards"))


def test_a_reader_finds_every_sample_by_key_and_refuses_others(tiny_shards):
    index = ShardIndex(tiny_shards)
    reader = SampleReader(index, preset("tiny"))
    for row in range(len(index.table)):
        key = index.table.key(row)
        assert index.table.find(key) == row
        assert reader.raw(index.table.shard(row), key)[0]["window_start"] == int(key.rsplit("-s", 1)[1][:5])
    for key in ("tiny-e999999-s00000-v0", "other-e000000-s00000-v0", "not a key"):
        assert index.table.find(key) is None
    with pytest.raises(ShardFormatError, match="no sample tiny-e999999-s00000-v0"):
        reader.raw(0, "tiny-e999999-s00000-v0")


def test_a_byte_changed_in_the_index_is_refused_by_its_seal(copy):
    data = bytearray((copy / "samples.npy").read_bytes())
    data[-3] ^= 1
    (copy / "samples.npy").write_bytes(bytes(data))
    assert refused(copy) == f"{copy / 'samples.npy'}: sha256 differs from the manifest"
    assert check(copy)[0] == "samples.npy: sha256 differs from the manifest"


def test_an_index_sealed_again_over_a_wrong_crc_is_refused_at_the_read(copy):
    """Sealed again, the CRC-32 is a number like any other: the read of that sample stops in one line naming the
    tar, sample and member, and so does `check` (which verifies the index against the tars)."""
    edit_index(copy, lambda rows: rows["crc32"].__setitem__((0, 0), rows["crc32"][0, 0] ^ 1))
    index = ShardIndex(copy)
    key, name = index.table.key(0), index.table.record(0).members[0].name
    tar = copy / index.manifest.shards[index.table.shard(0)].shard
    with pytest.raises(
        ShardFormatError, match=f"^{re.escape(str(tar))}: sample {key}: member {re.escape(name)} checksum mismatch"
    ):
        SampleReader(index, preset("tiny")).raw_row(0)
    assert any(p.startswith(f"{tar.name}: sample {key}: member {name} checksum mismatch") for p in check(copy))
    # with the shard JSONs read too, their disagreement with the index is named as well
    assert any(
        p.startswith("samples.npy: the samples of shard-") and "differ from" in p for p in check(copy, shard_jsons=True)
    )


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda r: r["shard"].__setitem__(0, 7), "row 0: shard 7 of 3"),
        (lambda r: r["member"].__setitem__((1, 0), 200), "row 1: member ids"),
        (lambda r: r.__setitem__(1, r[0]), "row 1: rows not sorted by (episode, start, variant), or a sample twice"),
    ],
    ids=["shard", "member", "twice"],
)
def test_crafted_rows_are_refused_in_one_line(copy, edit, reason):
    edit_index(copy, edit)
    message = refused(copy)
    assert message.startswith(f"{copy / 'samples.npy'}: {reason}")


def test_variants_disagreeing_on_their_multiplicity_are_refused(tmp_path):
    root = tmp_path / "shards"
    make_synthetic_shards(root, "tiny", episodes=2, windows_per_episode=2, augment_variants=2, samples_per_shard=3)
    edit_index(root, lambda r: r["multiplicity"].__setitem__(1, r["multiplicity"][1] + 5))
    assert refused(root) == (
        f"{root / 'samples.npy'}: row 1: the variants of its window disagree on anchor_multiplicity"
    )


def test_counts_per_shard_must_be_the_manifests(copy):
    def move(rows):
        rows["shard"][np.flatnonzero(rows["shard"] == 1)[0]] = 0

    edit_index(copy, move)
    manifest = Manifest.read(copy)
    assert refused(copy) == (
        f"{copy / 'samples.npy'}: {manifest.shards[0].count + 1} samples in shard-000000.tar, "
        f"the manifest says {manifest.shards[0].count}"
    )


@pytest.mark.parametrize("name", ["../samples.npy", "/etc/passwd.npy", "sub/samples.npy", "samples.json"])
def test_an_index_outside_the_directory_is_refused(copy, name):
    reseal(copy / "manifest.json", lambda m: m["sample_index"].update(file=name))
    message = (
        f"{copy / 'manifest.json'}: sample_index.file {name!r} is not a relative path of the form "
        f"[^/]+\\.npy inside the shard directory (crafted or corrupt): rebuild the shards"
    )
    assert refused(copy) == message
    assert check(copy) == [message]


def test_an_older_build_names_the_command_that_upgrades_it(copy):
    reseal(copy / "manifest.json", lambda m: m.update(format="wampipe-shards/3"))
    assert refused(copy) == (
        f"{copy / 'manifest.json'}: format 'wampipe-shards/3', this code reads "
        f"'wampipe-shards/4': rebuild the shards with this version (python -m preprocess shards)"
    )


def test_a_key_twice_is_refused_when_the_index_is_built():
    record = SampleRecord("d-e000001-s00002-v0", 1, (MemberRef("meta.json", 512, 10, 0),))
    with pytest.raises(ValueError, match="episode 1 start 2 variant 0 appears twice"):
        index_rows([(0, [record]), (1, [record])])


def test_a_loader_worker_maps_the_index_instead_of_copying_it(tiny_shards):
    import pickle

    table = ShardIndex(tiny_shards).table
    state = pickle.dumps(table)
    assert len(state) < 4096 < table.rows.nbytes + 4096
    again = pickle.loads(state)
    assert isinstance(again.rows, np.memmap) and np.array_equal(again.rows, table.rows)
