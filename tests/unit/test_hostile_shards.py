"""Shard directories crafted to attack their reader: each file is sealed again with the project's own sealing, as
anyone who edits a directory can do. The trainer's data entry (`ShardIndex`, what train/main.py calls), the
webdataset decoder and `preprocess check` must refuse each in one line naming the file and field, before anything
is read from outside the directory, written outside the cache, allocated from a crafted size or trained on."""

import hashlib
import io
import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from wampipe.preprocess.check import check
from wampipe.shardformat import webdataset_decoder
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.members import MAX_MEMBER_BYTES, checksum
from wampipe.shardformat.shard import ShardRecord
from wampipe.shardformat.storage import ShardStore
from wampipe.train.data import SampleReader, ShardIndex
from wampipe.train.dit.model import preset
from tests.helpers import edit_index, outside_path_refusal, refused, reindex, reseal

ESCAPE = "../../../../tmp/x"  # below <cache>/<bucket>/<prefix>/: <cache>/../../tmp/x


@pytest.fixture
def copy(small_shards, tmp_path) -> Path:
    """A fresh copy of the session's small synthetic shards, at <tmp_path>/a/shards."""
    return Path(shutil.copytree(small_shards, tmp_path / "a" / "shards"))


def test_a_text_table_outside_the_directory_is_refused_locally(copy, tmp_path):
    reseal(copy / "manifest.json", lambda m: m["text_table"].update(file=ESCAPE))
    message = outside_path_refusal(copy / "manifest.json", "text_table.file", ESCAPE)
    assert refused(copy) == message
    assert check(copy) == [message]
    with pytest.raises(ShardFormatError, match="is not a relative path"):
        webdataset_decoder(copy)


def test_statistics_outside_the_directory_are_refused(copy, tmp_path):
    outside = tmp_path / "a" / "outside_stats.json"
    outside.write_bytes((copy / "metadata.json").read_bytes())
    name = "../outside_stats.json"
    reseal(
        copy / "manifest.json",
        lambda m: m["statistics"].update(file=name, sha256=hashlib.sha256(outside.read_bytes()).hexdigest()),
    )
    message = outside_path_refusal(copy / "manifest.json", "statistics.file", name)
    assert refused(copy) == message
    assert check(copy) == [message]


def test_flipped_bits_in_the_text_table_are_refused(copy):
    table = copy / "text" / "embeddings.safetensors"
    data = bytearray(table.read_bytes())
    data[-2] ^= 0x10  # a mantissa bit of the last embedding's last bf16 value
    table.write_bytes(bytes(data))
    message = f"{table}: sha256 differs from the manifest"
    assert refused(copy) == message
    with pytest.raises(ShardFormatError, match=f"^{re.escape(message)}$"):
        webdataset_decoder(copy)
    assert check(copy) == ["text/embeddings.safetensors: sha256 differs from the manifest"]


def test_a_member_size_beyond_its_tar_is_refused_before_any_read(copy):
    record = ShardRecord.read(copy / "shard-000000.json")
    key, member = record.keys[0], record.samples[0].members[0]
    reseal(copy / "shard-000000.json", lambda o: o["samples"][key]["members"][0].__setitem__(2, 2**40))
    message = (
        f"{copy / 'shard-000000.json'}: sample {key}: member {member.name}: {2**40} bytes at offset "
        f"{member.offset} lie outside the tar's {record.bytes} bytes (crafted or corrupt): rebuild the shards"
    )
    assert message in check(copy, decode=False, shard_jsons=True)  # readers never read it: only with shard_jsons
    # the readers' copy of the same numbers, the sample index, crafted the same way
    row = ShardIndex(copy).table.find(key)
    edit_index(copy, lambda rows: rows["offset"].__setitem__((row, 0), 2**40))
    assert refused(copy) == (
        f"{copy / 'samples.npy'}: row {row}: a member lies outside the {record.bytes} bytes of "
        f"shard-000000.tar (crafted or corrupt): rebuild the shards"
    )


def test_a_tar_size_the_manifest_and_json_both_inflate_is_refused(copy):
    """Members are bounded by the shard's recorded size, so that size must be the tar's own."""
    record = ShardRecord.read(copy / "shard-000001.json")
    key = record.keys[0]

    def inflate(o):
        o["bytes"] = 2**41
        o["samples"][key]["members"][0][2] = 2**40

    reseal(copy / "shard-000001.json", inflate)
    reseal(copy / "manifest.json", lambda m: m["shards"][1].update(bytes=2**41))
    assert refused(copy) == f"{copy / 'shard-000001.tar'}: {record.bytes} bytes, the manifest says {2**41}"


def _npy_header(shape: tuple) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return f.getvalue()


HUGE = 2**40
# A zstd frame header (magic, single segment, 8-byte content size) declaring HUGE bytes, then an empty raw block.
ZSTD_HUGE = struct.pack("<IBQ", 0xFD2FB528, 0xE0, HUGE) + b"\x01\x00\x00"


@pytest.mark.parametrize(
    "member, crafted, why",
    [
        ("action.npy", _npy_header((HUGE,)), f"its header declares {4 * HUGE} bytes of data, it holds"),
        ("state.npy.zst", ZSTD_HUGE, f"zstd frame of content size {HUGE}, not between 0 and {MAX_MEMBER_BYTES}"),
    ],
)
def test_a_member_declaring_a_huge_array_is_refused_without_allocating_it(copy, member, crafted, why):
    """The member keeps its size (every offset holds) and gets its CRC-32 recorded: only its content lies."""
    tar, side = copy / "shard-000000.tar", copy / "shard-000000.json"
    sample = ShardRecord.read(side).samples[0]
    i, ref = next((i, m) for i, m in enumerate(sample.members) if m.name == member)
    data = bytearray(tar.read_bytes())
    data[ref.offset : ref.offset + ref.size] = crafted.ljust(ref.size, b"\0")
    tar.write_bytes(bytes(data))
    reseal(
        side, lambda o: o["samples"][sample.key]["members"][i].__setitem__(3, checksum(crafted.ljust(ref.size, b"\0")))
    )
    reindex(copy)
    reader = SampleReader(ShardIndex(copy), preset("tiny"))
    with pytest.raises(ShardFormatError) as err:
        reader.raw(0, sample.key)
    assert str(err.value).startswith(f"{tar}: sample {sample.key}: member {member}: {why}")
    assert any(p.startswith(f"shard-000000.tar: sample {sample.key}: member {member}: {why}") for p in check(copy))


@pytest.mark.parametrize(
    "name",
    [
        "../shard-000000.tar",
        "/etc/passwd",
        "shard-000000.tar/",
        "a//shard-000000.tar",
        "shard-000000.tar\x00",
        "..\\shard-000000.tar",
        "shard-0.tar",
        "manifest.json",
    ],
)
def test_shard_names_must_be_shards_of_the_directory(copy, name):
    reseal(copy / "manifest.json", lambda m: m["shards"][0].update(shard=name))
    message = (
        f"{copy / 'manifest.json'}: shards[0].shard {name!r} is not a relative path of the form "
        f"shard-\\d{{6,}}\\.tar inside the shard directory (crafted or corrupt): rebuild the shards"
    )
    assert refused(copy) == message
    assert check(copy) == [message]


def test_the_store_refuses_a_path_out_of_its_directory(copy):
    store = ShardStore(copy)
    for name in ("../outside", "/etc/passwd", "text/../../outside", "", "text\\x"):
        with pytest.raises(ShardFormatError, match="is not a relative path inside the shard directory"):
            store.read_bytes(name)


def test_a_prompt_id_the_text_table_lacks_is_named_in_one_line(copy):
    """A sample's meta.json (checked by CRC-32 only, which its author records) may name any prompt id."""
    index = ShardIndex(copy)
    with pytest.raises(
        ShardFormatError,
        match=re.escape(f"{copy / 'text/embeddings.safetensors'}: prompt id 'nope': File does not contain tensor nope"),
    ):
        index.text.get("nope")


def test_a_sample_lacking_what_every_sample_holds_is_named_in_one_line(copy):
    """A meta.json rewritten without its prompt ids (same size, CRC-32 recorded anew): one line, not a KeyError."""
    tar, side = copy / "shard-000000.tar", copy / "shard-000000.json"
    sample = ShardRecord.read(side).samples[0]
    i, ref = next((i, m) for i, m in enumerate(sample.members) if m.name == "meta.json")
    data = bytearray(tar.read_bytes())
    meta = json.loads(bytes(data[ref.offset : ref.offset + ref.size]))
    crafted = json.dumps({k: v for k, v in meta.items() if k != "prompt_ids"}).encode().ljust(ref.size)
    data[ref.offset : ref.offset + ref.size] = crafted
    tar.write_bytes(bytes(data))
    reseal(side, lambda o: o["samples"][sample.key]["members"][i].__setitem__(3, checksum(crafted)))
    reindex(copy)
    with pytest.raises(ShardFormatError, match=f"^{re.escape(f'{tar}: sample {sample.key}: no prompt_ids')}$"):
        SampleReader(ShardIndex(copy), preset("tiny")).raw(0, sample.key)
