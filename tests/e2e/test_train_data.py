"""Trainer data path on synthetic shards written by the project's writer: order, weights, equal shares, resume,
verified reads, decoding."""

import subprocess
import sys
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from wampipe.shardformat.index import Window
from wampipe.shardformat.keys import parse_key
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.shard import ShardRecord, json_path
from wampipe.train.data import (
    SampleReader,
    ShardIndex,
    collate,
)
from tests.helpers import ROOT, TINY, take, tiny_loader


@pytest.mark.e2e
def test_order_is_independent_of_workers_and_resume_is_exact(loader_shards):
    ref = take(iter(tiny_loader(loader_shards, workers=0)), 9)
    multi = take(iter(tiny_loader(loader_shards, workers=2)), 9)
    for a, b in zip(ref, multi):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    first = tiny_loader(loader_shards, workers=2)
    it = iter(first)
    take(it, 4)
    state = first.state_dict()
    resumed = tiny_loader(loader_shards, workers=2)
    resumed.load_state_dict(state)
    for a, b in zip(ref[4:], take(iter(resumed), 5)):
        assert int(a["batch"]) == int(b["batch"])
        torch.testing.assert_close(a["latents"], b["latents"], rtol=0, atol=0)
        torch.testing.assert_close(a["text"], b["text"], rtol=0, atol=0)


@pytest.mark.e2e
def test_workers_build_batches_in_shared_memory_with_the_main_process_values(loader_shards):
    """Inside a worker, collate writes every sample tensor straight into shared memory (the hand-off copies only a few
    bytes of bookkeeping); the
    512-row text layout, like the compact one above, equals what the main process builds."""
    index = ShardIndex(loader_shards)
    reader = SampleReader(index, TINY)
    samples = [reader.sample(w, np.random.default_rng(0)) for w in cast(list[Window], index.windows[:3])]
    reader.close()

    class Probe(IterableDataset):
        def __iter__(self):
            for rows in (None, 16):
                batch = collate(samples, TINY.text_len, rows)
                yield {k: torch.tensor(v.is_shared()) for k, v in batch.items() if v.dim() > 1}

    for flags in DataLoader(Probe(), batch_size=None, num_workers=1):
        assert flags.keys() == {"latents", "clip", "text", "state", "actions", "action_mask"} and all(flags.values())
    assert not any(v.is_shared() for v in collate(samples, TINY.text_len).values())  # main process: plain memory
    ref = take(iter(tiny_loader(loader_shards, workers=0, compact_text=False)), 3)
    for a, b in zip(ref, take(iter(tiny_loader(loader_shards, workers=2, compact_text=False)), 3)):
        assert a["text"].shape == (2, TINY.text_len, TINY.text_dim) and "text_lengths" not in a
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.e2e
def test_trainer_data_imports_no_preprocessing_code():
    probe = (
        "import wampipe.train.data, sys; bad = sorted(m for m in sys.modules if m.startswith("
        "('preprocess', 'wampipe.preprocess')) or m == 'pyarrow'); assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def _flip_member_byte(root: Path, member: str) -> tuple[Path, str]:
    """Flip one byte inside `member` of the first sample of shard 0 (tar and its JSON otherwise intact)."""
    shard = root / "shard-000000.tar"
    sample = ShardRecord.read(json_path(shard)).samples[0]
    ref = next(m for m in sample.members if m.name == member)
    data = bytearray(shard.read_bytes())
    data[ref.offset + ref.size // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard, sample.key


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [0, 2])
def test_a_flipped_byte_stops_training_with_the_member_named(loader_shards, tmp_path, workers):
    import shutil

    corrupt = tmp_path / "corrupt"
    shutil.copytree(loader_shards, corrupt)
    shard, key = _flip_member_byte(corrupt, "clip.npy")
    message = f"{shard}: sample {key}: member clip.npy checksum mismatch (corrupt shard)"
    index = ShardIndex(corrupt)
    reader = SampleReader(index, TINY)
    with pytest.raises(ShardFormatError) as err:
        reader.raw(0, key)
    assert str(err.value) == message
    reader.close()
    loader = tiny_loader(corrupt, workers=workers, variant=parse_key(key).variant)
    with pytest.raises(ShardFormatError) as stop:
        take(iter(loader), 40)  # 4 epochs of rank 0: the corrupt sample's window comes up (at the latest) there
    assert str(stop.value) == message
