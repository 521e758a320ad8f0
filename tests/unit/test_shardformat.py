"""The shard contract (shardformat): keys, durable writes under real process kills and races, sealed and versioned
JSON, member offsets and checksums, and `preprocess check` on every way a directory can be damaged."""

import json
import shutil
from pathlib import Path

import pytest
import zstandard

from tests.helpers import reindex
from wampipe.preprocess.check import Args, check, run, tar_samples
from wampipe.preprocess.write import shard_done
from wampipe.shardformat.keys import parse_key, sample_key, window_name
from wampipe.shardformat.manifest import FORMAT_VERSION, Manifest, ShardFormatError, write_sealed_json
from wampipe.shardformat.members import encode_sample
from wampipe.shardformat.shard import ShardRecord, json_path


@pytest.fixture
def shards(small_shards) -> Path:
    """The session's small synthetic shards, read only: tests damage a copy."""
    return small_shards


def damaged(shards: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(shards, tmp_path / "copy"))


def test_keys():
    key = sample_key("droid", 12, 34, 1)
    assert key == "droid-e000012-s00034-v1" and parse_key(key) == ("droid", 12, 34, 1)
    assert window_name(key) == "droid-e000012-s00034" and parse_key("franka_pnp-e000001-s00000-v0").episode == 1
    for bad in ("droid-e12-s00034-v1", "droid-e000012-s00034", "dro.id-e000012-s00034-v1", "droid-e000012-s00034-vx"):
        with pytest.raises(ValueError, match="is not <dataset>-e<episode:06d>-s<start:05d>-v<variant>"):
            parse_key(bad)
    with pytest.raises(ValueError):
        encode_sample("a.b", {}, {})


def test_manifest_round_trip_seal_and_version(shards, tmp_path):
    manifest = Manifest.read(shards)
    assert manifest.format == FORMAT_VERSION and Manifest.from_dict(manifest.to_dict()) == manifest
    assert manifest.modality_keys == {"state": ["state"], "action": ["actions"]}
    with pytest.raises(ShardFormatError, match=r"missing fields \['statistics'\], unknown fields \['stats'\]"):
        d = manifest.to_dict()
        d["stats"] = d.pop("statistics")
        Manifest.from_dict(d)
    with pytest.raises(ShardFormatError, match="totals.samples is 1, the shards hold 9"):
        Manifest.from_dict({**manifest.to_dict(), "totals": {"samples": 1}})
    copy = damaged(shards, tmp_path)
    raw = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**raw, "format": "wampipe-shards/1"}))
    with pytest.raises(ShardFormatError, match=f"this code reads '{FORMAT_VERSION}': rebuild the shards"):
        Manifest.read(copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ShardFormatError, match=f"^{copy / 'manifest.json'}: unreadable"):
        Manifest.read(copy)


def test_shard_json_locates_every_member_and_zstd_frames_carry_checksums(shards):
    for entry in Manifest.read(shards).shards:
        path = shards / entry.shard
        record = ShardRecord.read(json_path(path))
        headers = {}
        with open(path, "rb") as f:
            for _ in tar_samples(f, headers):
                pass
        assert {s.key: [[f"{s.key}.{m.name}", m.offset, m.size] for m in s.members] for s in record.samples} == headers
        assert {s.anchor_multiplicity for s in record.samples} <= {1, 2, 3}
    members = encode_sample(
        "droid-e000000-s00000-v0", {"z": __import__("numpy").zeros((64, 64), "float32")}, {}, compress="all"
    )
    assert zstandard.get_frame_parameters(members[0][1]).has_checksum


def test_a_shard_json_of_another_version_is_rewritten_on_resume(shards, tmp_path):
    copy = damaged(shards, tmp_path)
    done = shard_done(copy, 0)
    assert done is not None and done["keys"] == ShardRecord.read(copy / "shard-000000.json").keys
    old = json.loads((copy / "shard-000000.json").read_text())
    (copy / "shard-000000.json").write_text(
        json.dumps({k: old[k] for k in ("shard", "count", "bytes", "sha256", "keys")})
    )
    assert shard_done(copy, 0) is None


def _edit_sealed(path: Path, edit) -> None:
    obj = json.loads(path.read_text())
    obj.pop("content_sha256")
    edit(obj)
    write_sealed_json(path, obj)


def test_check_catches_edits_the_hashes_alone_would_not(shards, tmp_path):
    assert check(shards) == []
    copy = damaged(shards, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "samples_per_shard": 5}))
    assert check(copy) == [f"{copy / 'manifest.json'}: content_sha256 does not match the content (edited or corrupt)"]
    (copy / "manifest.json").write_text(json.dumps(manifest))

    record = ShardRecord.read(copy / "shard-000001.json")
    key = record.keys[0]
    # readers use the sample index, which check verifies against the tars; the shard JSONs only with shard_jsons
    _edit_sealed(copy / "shard-000001.json", lambda o: o["samples"][key]["members"][0].__setitem__(1, 0))
    assert check(copy) == []
    problems = check(copy, shard_jsons=True)
    assert f"shard-000001.json: sample {key}: members and offsets differ from the tar's headers" in problems
    reindex(copy)  # the index written anew from the edited JSONs, as anyone who edits a directory can
    assert f"samples.npy: sample {key}: members and offsets differ from the tar's headers of shard-000001.tar" in check(
        copy
    )
    _edit_sealed(
        copy / "shard-000001.json",
        lambda o: o["samples"][key].update(
            anchor_multiplicity=o["samples"][key]["anchor_multiplicity"] + 1,
            members=[[m.name, m.offset, m.size, m.crc32] for m in record.samples[0].members],
        ),
    )
    reindex(copy)
    assert any(f"shard-000001.tar: sample {key}: anchor_multiplicity" in p for p in check(copy))
    (copy / "shard-000001.json").write_bytes(b"\xff\xfe")
    assert any(p.startswith(f"{copy / 'shard-000001.json'}: unreadable") for p in check(copy, shard_jsons=True))
    (copy / "wids.json").write_text(json.dumps({"wids_version": 1, "shardlist": []}))
    assert "wids.json: disagrees with manifest.json" in check(copy)


def test_check_names_the_member_of_a_flipped_byte(shards, tmp_path):
    copy = damaged(shards, tmp_path)
    sample = ShardRecord.read(copy / "shard-000000.json").samples[1]
    member = next(m for m in sample.members if m.name == "meta.json")
    data = bytearray((copy / "shard-000000.tar").read_bytes())
    data[member.offset + 3] ^= 0x01
    (copy / "shard-000000.tar").write_bytes(bytes(data))
    problems = check(copy, decode=False)
    assert "shard-000000.tar: sha256 differs from the manifest" in problems
    assert f"shard-000000.tar: sample {sample.key}: member meta.json checksum mismatch (corrupt shard)" in problems


def test_check_command_refuses_an_old_format_in_one_line(shards, tmp_path, capsys):
    copy = damaged(shards, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format": "wampipe-shards/1"}))
    assert run(Args(copy)) == 1  # pyright: ignore[reportArgumentType]  # a Path: check() takes any PathLike
    assert capsys.readouterr().out.splitlines()[1:] == [
        f"  {copy / 'manifest.json'}: format 'wampipe-shards/1', this code reads 'wampipe-shards/4': rebuild the "
        f"shards with this version (python -m preprocess shards)"
    ]
