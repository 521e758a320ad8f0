"""The sample schema of the manifest: written by the producer from what it built, checked on every read of a sample
(one decode path: the trainer's reader, the webdataset decoder, `preprocess check`), and the one source of the
widths the trainer gives its DiT."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from wampipe import configs
from devtools.synthetic import SHAPES
from wampipe.preprocess.check import check, tar_samples
from wampipe.preprocess.write import read_unit_index, unit_paths, write_tar, write_unit
from wampipe.shardformat import webdataset_decoder
from wampipe.shardformat.layout import ACTION, CLIP, LATENTS, MANIFEST, STATE, Y, shard_file
from wampipe.shardformat.manifest import Manifest, ShardFormatError, read_sealed_json, write_sealed_json
from wampipe.shardformat.members import checksum, decode_members, encode_sample, split_member_name
from wampipe.shardformat.schema import model_dims
from wampipe.shardformat.shard import MemberRef, SampleRecord, ShardRecord, json_path
from wampipe.train.data import SampleReader, ShardIndex, data_dims
from wampipe.train.dit.model import preset
from tests.helpers import reindex


@pytest.fixture
def copy(small_shards, tmp_path) -> Path:
    return Path(shutil.copytree(small_shards, tmp_path / "shards"))


def rewrite_first_sample(root: Path, edit) -> str:
    """Encode the first sample of shard 0 again with `edit` applied to its tensors, and make everything that
    describes it agree, sealed again: its meta.json, the tar, the shard JSON (offsets, CRC-32s), the manifest's entry
    (bytes, sha256) and wids.json. Only the manifest's schema can tell the sample apart. Returns its key."""
    tar = root / shard_file(0)
    with open(tar, "rb") as f:
        samples = list(tar_samples(f))
    key, members = samples[0]
    meta, tensors = decode_members(members)
    edit(tensors)
    meta.pop("tensors")
    samples[0] = (key, {split_member_name(n)[1]: d for n, d in encode_sample(key, tensors, meta)})
    named = [(f"{k}.{suffix}", data) for k, group in samples for suffix, data in group.items()]
    written = write_tar(tar, named)
    located = iter(zip(written["members"], named))
    old = {s.key: s for s in ShardRecord.read(json_path(tar)).samples}
    records = [
        SampleRecord(
            k,
            old[k].anchor_multiplicity,
            tuple(
                MemberRef(split_member_name(name)[1], offset, size, checksum(data))
                for (name, offset, size), (_, data) in (next(located) for _ in group)
            ),
        )
        for k, group in samples
    ]
    ShardRecord(tar.name, written["bytes"], written["sha256"], records).write(json_path(tar))
    manifest = Manifest.read(root)
    entry = manifest.shards[0]
    manifest.shards[0] = dataclasses.replace(entry, bytes=written["bytes"], sha256=written["sha256"])
    manifest.totals["bytes"] += written["bytes"] - entry.bytes
    manifest.write(root)
    reindex(root)
    return key


@pytest.mark.parametrize(
    "edit, found",
    [
        (lambda t: t.__setitem__(STATE, t[STATE].astype(np.float64)), "float64 [4, 8]"),
        (lambda t: t.__setitem__(STATE, np.concatenate([t[STATE], t[STATE][:, :1]], 1)), "float32 [4, 9]"),
    ],
    ids=["dtype", "shape"],
)
def test_a_sample_that_disagrees_with_the_schema_is_refused_in_one_line_by_every_reader(copy, edit, found):
    key = rewrite_first_sample(copy, edit)
    tar = copy / shard_file(0)
    problem = f"sample {key}: member state: {found}, the manifest's schema says float32 [4, 8]"
    assert check(copy) == [f"{tar.name}: {problem}"]
    with pytest.raises(ShardFormatError, match=f"^{re.escape(f'{tar}: {problem}')}$"):
        SampleReader(ShardIndex(copy), preset("tiny")).raw(0, key)
    with open(tar, "rb") as f:
        members = next(tar_samples(f))[1]
    with pytest.raises(ShardFormatError, match=f"^{re.escape(f'{tar}: {problem}')}$"):
        webdataset_decoder(copy)({"__key__": key, "__url__": str(tar), **members})


def test_a_sample_lacking_a_member_of_the_schema_is_refused(copy):
    key = rewrite_first_sample(copy, lambda t: t.pop(ACTION))
    assert check(copy) == [
        f"{shard_file(0)}: sample {key}: member action: absent, the manifest's schema says float32 [16, 7]"
    ]


def test_a_unit_whose_samples_differ_in_their_tensors_is_refused(tmp_path):
    keys = [f"d-e000000-s0000{i}-v0" for i in range(2)]
    samples = [
        (key, encode_sample(key, {STATE: np.zeros((4, 8 + i))}, {"anchor_multiplicity": 1}))
        for i, key in enumerate(keys)
    ]
    with pytest.raises(
        ValueError,
        match=r"unit 0: samples differ in their tensors \(state float64 \[4, 8\]; state "
        r"float64 \[4, 9\]\)",
    ):
        write_unit(tmp_path, 0, samples, {})


def test_the_trainer_takes_its_widths_from_the_manifest_not_from_a_sample(copy):
    assert data_dims(copy) == {
        "model_type": "ti2v",
        "in_dim": 4,
        "out_dim": 4,
        "frame_seqlen": 4,
        "num_action_per_block": 4,
        "image_len": 5,
        "image_dim": 24,
        "text_dim": 32,
        "text_len": ShardIndex(copy).longest_prompt,
    }
    # a schema edited (and sealed again) changes what the trainer uses, though every sample is as before
    path = copy / MANIFEST
    manifest = read_sealed_json(path)
    manifest["schema"][LATENTS]["shape"] = [6, 9, 8, 12]
    manifest["schema"][Y] = {"dtype": "bfloat16", "shape": [20, 9, 8, 12]}
    manifest["schema"][ACTION]["shape"] = [32, 7]
    write_sealed_json(path, manifest)
    assert {
        k: v
        for k, v in data_dims(copy).items()
        if k in ("model_type", "in_dim", "out_dim", "frame_seqlen", "num_action_per_block")
    } == {"model_type": "i2v", "in_dim": 26, "out_dim": 6, "frame_seqlen": 24, "num_action_per_block": 8}


@pytest.mark.parametrize("name", [n for n in configs.names() if n != "tiny"])
def test_the_schema_of_a_recipe_fixes_its_dit(name):
    shapes, dit = SHAPES[name], preset(name)
    tensors = {LATENTS: shapes.latents, CLIP: shapes.clip, STATE: shapes.state, ACTION: shapes.action, Y: shapes.y}
    schema = {k: {"dtype": "bfloat16", "shape": list(v)} for k, v in tensors.items() if v is not None}
    assert model_dims(schema) == {k: getattr(dit, k) for k in model_dims(schema)}


def test_a_manifest_without_the_members_every_sample_holds_is_refused(copy):
    path = copy / MANIFEST
    manifest = read_sealed_json(path)
    del manifest["schema"][STATE]
    write_sealed_json(path, manifest)
    assert check(copy) == [f"{path}: schema lacks ['state'], which every sample holds"]


def test_a_unit_written_before_units_recorded_their_schema_still_finalizes(copy):
    """Its schema comes from its first sample, so a build begun by an older wampipe resumes."""
    path = unit_paths(copy, 0)[1]
    index = json.loads(path.read_text())
    recorded = index.pop("schema")
    path.write_text(json.dumps(index))
    assert recorded == Manifest.read(copy).schema and read_unit_index(copy, 0)["schema"] == recorded
