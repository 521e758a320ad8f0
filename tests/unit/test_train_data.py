"""Trainer data path on synthetic shards written by the project's writer: order, weights, equal shares, resume,
verified reads, decoding."""

import json
from typing import cast

import numpy as np
import pytest
import torch

from devtools import synthetic
from wampipe.errors import UsageError
from wampipe.preprocess.check import check
from wampipe.shardformat.index import Window
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.stats import normalize_q99, pad_with_mask
from wampipe.train.config import DataConfig
from wampipe.train.data import (
    SampleReader,
    ShardIndex,
    ShardLoader,
    batch_positions,
    batches_per_epoch,
    epoch_order,
)
from tests.helpers import TINY, take, tiny_loader


def test_synthetic_shards_pass_the_integrity_check(loader_shards):
    assert check(loader_shards) == []
    manifest = json.loads((loader_shards / "manifest.json").read_text())
    assert [s["count"] for s in manifest["shards"]] == [7] * 7 + [1]
    index = ShardIndex(loader_shards)
    assert len(index) == 25
    assert all(len(w.variants) == 2 for w in index.windows)
    assert index.weights("anchor").tolist() == [3, 1, 1, 1, 2] * 5 and index.weights("uniform").tolist() == [1] * 25


def test_epoch_split_is_disjoint_equal_and_seeded():
    n, world, micro = 25, 2, 2
    nb = batches_per_epoch(n, world, micro)
    assert nb == 6  # 25 windows -> 12 per rank -> 6 micro-batches; one window rests each epoch
    for epoch in range(2):
        order = epoch_order(np.ones(n, np.int64), 0, epoch)
        per_rank = [
            np.concatenate([order[batch_positions(n, epoch * nb + b, r, world, micro)[1]] for b in range(nb)])
            for r in range(world)
        ]
        assert [len(p) for p in per_rank] == [12, 12]
        assert not set(per_rank[0]) & set(per_rank[1])
    assert batch_positions(n, 0, 0, world, micro)[0] == 0 and batch_positions(n, nb, 0, world, micro)[0] == 1
    orders = {tuple(epoch_order(np.ones(n, np.int64), s, e)) for s in (0, 1) for e in (0, 1)}
    assert len(orders) == 4  # seed and epoch both change the permutation


def test_anchor_sampling_visits_each_window_as_often_as_its_multiplicity():
    """An epoch is a permutation of the multiset {window i, weights[i] times}: the reference shuffles all anchor rows
    once per epoch, and weights[i] of them give window i. Uniform sampling is a plain permutation."""
    weights = np.random.default_rng(0).integers(1, 4, 200)
    visits = np.zeros_like(weights)
    first_positions = []
    for epoch in range(50):
        order = epoch_order(weights, 7, epoch)
        assert len(order) == weights.sum()
        np.testing.assert_array_equal(np.bincount(order, minlength=len(weights)), weights)
        visits += np.bincount(order, minlength=len(weights))
        first_positions.append(order[0])
    np.testing.assert_array_equal(visits, 50 * weights)
    # the first position of an epoch is drawn in proportion to the weights: chi-square over 2000 epochs
    draws = np.bincount([epoch_order(weights[:8], 1, e)[0] for e in range(2000)], minlength=8)
    expected = 2000 * weights[:8] / weights[:8].sum()
    assert ((draws - expected) ** 2 / expected).sum() < 24.3  # chi-square, 7 dof, p = 0.001
    uniform = epoch_order(np.ones(200, np.int64), 7, 3)
    np.testing.assert_array_equal(np.sort(uniform), np.arange(200))
    np.testing.assert_array_equal(uniform, np.random.default_rng([7, 3]).permutation(200))


def test_loader_draws_windows_by_anchor_multiplicity(loader_shards):
    """Both ranks of one anchor-weighted epoch together visit each window as often as its multiplicity (40 visits,
    10 micro-batches of 2 per rank: nothing rests); --data.sampling uniform visits each window once (one rests)."""
    index = ShardIndex(loader_shards)
    visits = np.zeros(len(index), np.int64)
    for rank in range(2):
        loader = tiny_loader(loader_shards, rank=rank)
        assert (loader.epoch_length, loader.batches_per_epoch) == (40, 10)
        for batch in take(iter(loader), loader.batches_per_epoch):
            np.add.at(visits, batch["window"].numpy(), 1)
    np.testing.assert_array_equal(visits, index.weights("anchor"))
    uniform = np.concatenate(
        [
            b["window"].numpy()
            for rank in range(2)
            for b in take(iter(tiny_loader(loader_shards, rank=rank, sampling="uniform")), 6)
        ]
    )
    assert len(uniform) == len(set(uniform.tolist())) == 24


def test_world_size_change_is_refused_unless_reshuffle(loader_shards):
    first = tiny_loader(loader_shards)
    it = iter(first)
    take(it, 3)
    state = first.state_dict()
    with pytest.raises(UsageError, match="reshuffle-on-resize"):
        tiny_loader(loader_shards, world=1).load_state_dict(state)
    single = tiny_loader(loader_shards, world=1, reshuffle_on_resize=True)
    single.load_state_dict(state)
    assert single.next_batch == single.batches_per_epoch  # the next epoch's permutation, under the new world size
    with pytest.raises(UsageError, match="anchor sampling of 40 visits"):
        tiny_loader(loader_shards, sampling="uniform").load_state_dict(state)
    before_weights = {k: v for k, v in state.items() if k not in ("sampling", "epoch_length")}  # an older checkpoint
    uniform = tiny_loader(loader_shards, sampling="uniform")
    uniform.load_state_dict(before_weights)
    assert uniform.next_batch == 3


def test_batch_is_normalized_padded_and_text_is_a_table_row(loader_shards):
    index = ShardIndex(loader_shards)
    reader = SampleReader(index, TINY)
    window = cast(Window, index.windows[0])
    rng = np.random.default_rng(0)
    sample = reader.sample(window, rng, variant=1, column="annotation.human.action.task_description")
    meta, raw = reader.raw(*window.variants[1])
    assert meta["variant"] == 1
    state, mask = pad_with_mask(
        normalize_q99(torch.from_numpy(raw["state"]), index.q01["state"], index.q99["state"]), TINY.max_state_dim
    )
    torch.testing.assert_close(sample["state"], state)
    assert sample["state"].shape == (4, 8) and sample["actions"].shape == (16, 8)
    assert sample["action_mask"][:, :7].all() and not sample["action_mask"][:, 7:].any()
    assert sample["actions"].abs().max() <= 1
    torch.testing.assert_close(sample["latents"], raw["latents"], rtol=0, atol=0)
    assert sample["latents"].dtype == torch.bfloat16
    batch = next(iter(tiny_loader(loader_shards)))
    text = batch["text"]
    assert text.shape == (2, TINY.text_len, TINY.text_dim) and text.dtype == torch.bfloat16
    for i, w in enumerate(batch["window"].tolist()):
        meta, _ = reader.raw(*cast(Window, index.windows[w]).variants[0])
        table = reader.text(next(iter(meta["prompt_ids"].values())))
        torch.testing.assert_close(text[i, : len(table)], table, rtol=0, atol=0)
        assert not text[i, len(table) :].any() and int(batch["text_lengths"][i]) == len(table)
    reader.close()


def test_variant_is_drawn_per_visit(loader_shards):
    index = ShardIndex(loader_shards)
    reader = SampleReader(index, TINY)
    window = cast(Window, index.windows[3])
    seen = {
        reader.sample(window, np.random.default_rng([0, epoch, 3, 1]))["latents"].float().sum().item()
        for epoch in range(8)
    }
    assert len(seen) == 2  # both stored variants come up over epochs
    reader.close()


def test_model_config_takes_widths_from_the_shards_and_overrides_depth(loader_shards):
    from wampipe.train.builder import model_config
    from wampipe.train.config import parse_args

    base = model_config(parse_args(["--data.shards", str(loader_shards)]))
    deeper = model_config(parse_args(["--data.shards", str(loader_shards), "--model.num-layers", "5"]))
    assert base.num_layers == TINY.num_layers != 5 and deeper.num_layers == 5
    assert (base.text_dim, base.image_dim) == (32, 24)  # tiny synthetic shards: 32-wide text, 24-wide CLIP
    assert {k: v for k, v in vars(deeper).items() if k != "num_layers"} == {
        k: v for k, v in vars(base).items() if k != "num_layers"
    }


def test_old_or_edited_manifests_are_refused_in_one_line(loader_shards, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(loader_shards, old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "format": "wampipe-shards/1"}))
    with pytest.raises(
        ShardFormatError, match=r"format 'wampipe-shards/1', this code reads 'wampipe-shards/4': rebuild"
    ):
        tiny_loader(old)
    (old / "manifest.json").write_text(json.dumps({**manifest, "seed": manifest["seed"] + 1}))
    with pytest.raises(ShardFormatError, match="content_sha256 does not match the content"):
        tiny_loader(old)


def test_a_resume_over_rebuilt_shards_is_refused_unless_said(tmp_path):
    """The data state records each set's build (its manifest's sha256): the same counts and shapes rebuilt from other
    data at the same path are not the run's data; --data.mixture-changed continues with them at the same batch."""
    import shutil

    root = tmp_path / "shards"
    synthetic.make_synthetic_shards(root, "tiny", episodes=3, windows_per_episode=2, samples_per_shard=4, seed=1)
    cfg = DataConfig(shards=root, micro_batch_size=2, num_workers=0)
    loader = ShardLoader(cfg, TINY, 0, 1, torch.device("cpu"))
    loader.next_batch = 2
    state = loader.state_dict()
    shutil.rmtree(root)
    synthetic.make_synthetic_shards(root, "tiny", episodes=3, windows_per_episode=2, samples_per_shard=4, seed=2)
    again = ShardLoader(cfg, TINY, 0, 1, torch.device("cpu"))
    with pytest.raises(
        UsageError,
        match=f"checkpoint data was read from other builds of {root} \\(manifest "
        f"{state['builds'][0]} -> {again.index.store.build}\\): the shards were "
        f"rebuilt since; pass --data.mixture-changed to continue with them",
    ):
        again.load_state_dict(state)
    said = ShardLoader(
        DataConfig(shards=root, micro_batch_size=2, num_workers=0, mixture_changed=True),
        TINY,
        0,
        1,
        torch.device("cpu"),
    )
    said.load_state_dict(state)
    assert said.next_batch == 2
