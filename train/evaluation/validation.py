"""Validation loss: the training loss on each set's validation split (`preprocess shards --val-episodes` writes it to
<shards>/val, a shard directory that training never reads), the same number for the same weights on any number of
ranks, after a resume, and whatever the training RNG has drawn.

    samples   every sample (window x variant) of the split, sorted by key; at most --metrics.val-samples of them,
              evenly spaced over that order
    batches   runs of --metrics.val-batch consecutive samples of one set: a list fixed by the data and the flags
    ranks     batch i runs on rank i mod world; a rank without a batch in a round repeats one and discards it (FSDP's
              forward is collective)
    noise     a batch's timesteps, noise and prompt columns come from generators seeded by its keys
    result    each batch's loss terms x its sample count go into a vector indexed by batch, all-reduced (one rank adds
              each non-zero entry, so the sum is exact) and summed in batch order on every rank

Forward only, in eval mode under torch.no_grad. The training loop calls `Validation.after_step` once per step; it
returns the fields to log (`val_loss`, `val_loss_dynamics`, `val_loss_action`, and per set of a mixture
`val_loss/<set>` ...) on the steps it runs: every --metrics.val-interval steps and at the run's last step.
`torchrun train/validate.py` measures it on a run's checkpoint.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist

from wampipe.shardformat.index import ShardIndex
from wampipe.train.config import AUTO, Config, ShardSet
from wampipe.train.data import SampleReader, check_alongside, collate, set_names
from wampipe.train.dit.loss import FlowMatchScheduler, flow_matching_loss
from wampipe.train.dit.model import CausalWanModel, DiTBatch
from wampipe.train.dit.text import compact_text_rows

TERMS = ("loss", "loss_dynamics", "loss_action")
INPUTS = [f.name for f in fields(DiTBatch)]


def key_seed(*keys: str) -> int:
    """A 63-bit seed of sample keys: the same on every rank and run."""
    return int.from_bytes(hashlib.sha256("\n".join(keys).encode()).digest()[:8], "little") >> 1


def val_dir(shards: str, index: ShardIndex) -> str | None:
    """Where a set's validation split lies (its manifest's validation.val_dir, under the set), or None."""
    name = index.manifest.validation.get("val_dir")
    return None if name is None else f"{str(shards).rstrip('/')}/{name}"


def val_samples(index: ShardIndex, cap: int) -> list[tuple[int, str, int]]:
    """(window, key, variant) of at most `cap` samples of a split: all sorted by key, evenly spaced."""
    table = index.table
    n, starts = len(table), table.window_starts
    if not n:
        return []
    window = np.repeat(np.arange(table.num_windows), np.diff(starts))
    variant = np.asarray(table.rows["variant"])
    # keys sort a window's variants by their digits as text (v10 before v2): rank each variant number so
    spelled = [str(v) for v in range(int(variant.max()) + 1)]
    text_rank = np.argsort(np.argsort(spelled, kind="stable"), kind="stable")
    order = np.lexsort((text_rank[variant], window))
    picked = order if n <= cap else order[[i * n // cap for i in range(cap)]]
    return [(int(window[r]), table.key(int(r)), int(r - starts[window[r]])) for r in picked]


class Validation:
    """The validation loss of a run (module docstring). Sets without a validation split are left out; with none at
    all, or --metrics.val-interval 0, `after_step` never runs anything."""

    def __init__(
        self,
        cfg: Config,
        model: CausalWanModel,
        indexes: list[ShardIndex],
        fm: FlowMatchScheduler,
        device: torch.device,
        image_encoder=None,
    ):
        self.cfg, self.model, self.fm, self.device, self.image_encoder = cfg, model, fm, device, image_encoder
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.names, self.splits = [], []
        sets = cfg.data.sets()
        if cfg.metrics.val_shards:  # given splits instead of the sets' own
            places = list(zip(set_names([ShardSet(d) for d in cfg.metrics.val_shards]), cfg.metrics.val_shards))
        else:
            places = [(name, val_dir(s.shards, index)) for name, s, index in zip(set_names(sets), sets, indexes)]
        for name, where in places:
            if where is not None and cfg.metrics.val_interval:
                self.names.append(name)
                self.splits.append(ShardIndex(where, cfg.data.cache_dir))
                check_alongside(self.splits[-1], indexes, "a validation split")
        if cfg.metrics.val_interval and not self.splits and self.rank == 0:
            print(
                f"no validation split in {', '.join(str(s.shards) for s in sets)} (preprocess shards "
                f"--val-episodes): no validation loss",
                flush=True,
            )
        size = cfg.data.micro() if cfg.metrics.val_batch == AUTO else cfg.metrics.val_batch
        # (set, [(window, key, variant), ...]) of every batch, in one order on every rank
        self.batches = [
            (s, picked[i : i + size])
            for s, split in enumerate(self.splits)
            for picked in [val_samples(split, cfg.metrics.val_samples)]
            for i in range(0, len(picked), size)
        ]
        longest = max([ix.longest_prompt for ix in indexes] + [ix.longest_prompt for ix in self.splits])
        self.text_rows = compact_text_rows(longest, model.cfg.text_len) if cfg.data.compact_text else None
        self.cache: dict[int, dict] = {}  # this rank's batches, read once

    def after_step(self, step: int, end: int) -> dict:
        """Collective: the validation fields at the steps it is due (every val-interval steps, and `end`), else {}."""
        interval = self.cfg.metrics.val_interval
        if not self.batches or not interval or (step % interval and step != end):
            return {}
        return self.evaluate()

    def evaluate(self) -> dict:
        """Collective: {field: value} of the weights as they are now, and val_s, the seconds it took."""
        started = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        sums = torch.zeros(len(self.batches), len(TERMS), dtype=torch.float64)
        mine = list(range(self.rank, len(self.batches), self.world))
        rounds = math.ceil(len(self.batches) / self.world)
        try:
            with torch.no_grad():
                for r in range(rounds):
                    i = mine[r] if r < len(mine) else mine[0] if mine else 0  # a spare forward, discarded
                    terms = self.batch_terms(i)
                    if r < len(mine):
                        sums[i] = torch.stack([terms[k].double().cpu() for k in TERMS]) * len(self.batches[i][1])
        finally:
            self.model.train(was_training)
        sums = sums.to(self.device)
        dist.all_reduce(sums)
        return self.summed(sums.cpu()) | {"val_s": time.perf_counter() - started}

    def summed(self, sums: torch.Tensor) -> dict:
        """The fields of the all-reduced [batch, term] sums: each set's in batch order, then all sets'."""
        counts = [len(picked) for _, picked in self.batches]
        owner = [s for s, _ in self.batches]
        out, total = {}, torch.zeros(len(TERMS), dtype=torch.float64)
        for s, name in enumerate(self.names):
            rows = [i for i in range(len(self.batches)) if owner[i] == s]
            per_set = torch.zeros(len(TERMS), dtype=torch.float64)
            for i in rows:  # in batch order: the same sum on every rank and world size
                per_set += sums[i]
            total += per_set
            if len(self.names) > 1 or self.cfg.data.mixture:
                n = sum(counts[i] for i in rows)
                out |= {f"val_{k}/{name}": v / n for k, v in zip(TERMS, per_set.tolist())}
        return {f"val_{k}": v / sum(counts) for k, v in zip(TERMS, total.tolist())} | out

    def batch_terms(self, i: int) -> dict[str, torch.Tensor]:
        """The loss terms of validation batch `i`, noise and timesteps seeded by its keys."""
        s, picked = self.batches[i]
        batch = self.cache.get(i)
        if batch is None:
            batch = self.cache[i] = self.read(s, picked)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if self.image_encoder is not None:  # as the training step: CLIP's features of the stored pixels, as bf16
            batch["clip"] = self.image_encoder.encode_pixels(batch.pop("clip_pixels")).to(torch.bfloat16)
        generator = torch.Generator(self.device).manual_seed(key_seed(*(key for _, key, _ in picked)))
        inputs = DiTBatch(**{k: batch[k] for k in INPUTS if k in batch})
        _, terms = flow_matching_loss(self.model, inputs, self.fm, self.cfg.loss, generator=generator)
        return terms

    def read(self, s: int, picked: list[tuple[int, str, int]]) -> dict:
        split = self.splits[s]
        reader = SampleReader(split, self.model.cfg)
        try:  # a corrupt sample: a ShardFormatError naming it
            samples = [
                reader.sample(split.windows[w], np.random.default_rng(key_seed(key)), v, self.cfg.data.text_column)
                for w, key, v in picked
            ]
        finally:
            reader.close()
        return collate(samples, self.model.cfg.text_len, self.text_rows)
