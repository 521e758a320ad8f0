"""The shards read with the real `webdataset` and `wids` packages through `shardformat.webdataset_decoder` give
exactly the tensors and text embeddings the trainer's SampleReader gives for the same keys."""

import pickle
import shutil
from typing import Any
from pathlib import Path

import numpy as np
import pytest
import torch
import wids
from webdataset.compat import WebDataset

from devtools import synthetic
from wampipe.shardformat import ShardFormatError, webdataset_decoder
from wampipe.shardformat.manifest import Manifest
from wampipe.shardformat.shard import ShardRecord, json_path
from wampipe.train.data import SampleReader, ShardIndex
from wampipe.train.dit.model import preset


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """12 samples (3 episodes x 2 windows x 2 variants) in shards of 5; every tensor member zstd-compressed."""
    out = tmp_path_factory.mktemp("wds") / "tiny"
    synthetic.make_synthetic_shards(
        out, "tiny", episodes=3, windows_per_episode=2, augment_variants=2, samples_per_shard=5, seed=1, compress="all"
    )
    return out


def _urls(root: Path) -> list[str]:
    return [str(root / s.shard) for s in Manifest.read(root).shards]


def _expected(root: Path) -> dict[str, tuple[dict, dict, dict]]:
    """key -> (meta, tensors, {column: text}) as the trainer's reader returns them."""
    index = ShardIndex(root)
    reader = SampleReader(index, preset("tiny"))
    out = {}
    for window in index.windows:
        for shard, key in window.variants:
            meta, tensors = reader.raw(shard, key)
            out[key] = meta, tensors, {c: reader.text(p) for c, p in meta["prompt_ids"].items()}
    reader.close()
    return out


def _assert_same(sample: dict, expected: tuple[dict, dict, dict]) -> None:
    meta, tensors, text = expected
    assert sample["meta"] == meta
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            assert sample[name].dtype == value.dtype == torch.bfloat16 and torch.equal(sample[name], value)
        else:
            np.testing.assert_array_equal(sample[name], value)
            assert sample[name].dtype == value.dtype
    assert sample["text"].keys() == text.keys()
    for column, embedding in text.items():
        assert torch.equal(sample["text"][column], embedding)


def test_webdataset_reads_what_the_trainer_reads(shards):
    expected = _expected(shards)
    decode = pickle.loads(pickle.dumps(webdataset_decoder(shards)))  # as a spawned DataLoader worker gets it
    # webdataset's stubs type .map() as a FluidInterface, which they give no __iter__
    samples = list(WebDataset(_urls(shards), shardshuffle=False).map(decode))  # pyright: ignore[reportArgumentType]
    assert sorted(s["__key__"] for s in samples) == sorted(expected) and len(samples) == 12
    assert any(m["zstd"] for m in samples[0]["meta"]["tensors"].values())  # the .zst path is exercised
    for sample in samples:
        _assert_same(sample, expected[sample["__key__"]])


def test_wids_random_access_reads_what_the_trainer_reads(shards, tmp_path):
    expected = _expected(shards)
    # wids leaves `transformations` unannotated: its default "PIL" types it as str, though it takes a list of functions
    transformations: Any = [webdataset_decoder(shards)]
    dataset = wids.ShardListDataset(
        str(shards / "wids.json"), cache_dir=str(tmp_path / "cache"), transformations=transformations
    )
    assert len(dataset) == 12
    for i in (11, 0, 7, 3):  # across shards, out of order
        sample = dataset[i]
        _assert_same(sample, expected[sample["__key__"]])
    dataset.close()


def test_the_decoder_refuses_a_flipped_byte(shards, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(shards, corrupt)
    shard = corrupt / Manifest.read(corrupt).shards[1].shard
    sample = ShardRecord.read(json_path(shard)).samples[2]
    member = next(m for m in sample.members if m.name.startswith("latents"))
    data = bytearray(shard.read_bytes())
    data[member.offset + 40] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError) as err:
        decoded = WebDataset(_urls(corrupt), shardshuffle=False).map(webdataset_decoder(corrupt))
        list(decoded)  # pyright: ignore[reportArgumentType]  # the stubs' FluidInterface again
    assert str(err.value) == f"{shard}: sample {sample.key}: member {member.name} checksum mismatch (corrupt shard)"
