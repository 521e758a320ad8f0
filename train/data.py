"""Shard loading for training: manifest -> windows -> per-rank, per-epoch batches that a resumed run reproduces.

Order is a pure function of (seed, epoch, rank), never of timing or worker count:

    windows   every sample key `<dataset>-e<ep>-s<start>-v<variant>` grouped by window (variants of one window),
              sorted by name, so the order does not depend on how samples were cut into shards
    epoch e   a permutation, seeded by (seed, e), in which each window appears as often as its anchor
              multiplicity (`--data.sampling anchor`: the reference's sampler shuffles all anchor rows, and episode
              starts and ends are the window of 2-3 anchors) or once (`uniform`); rank r takes every world-th
              position, cut to the same number of micro-batches on every rank (no hang at epoch end)
    batch g   global batch counter over epochs; loader worker w produces the batches g = w mod num_workers, so
              the DataLoader's in-order round robin delivers g, g+1, ... exactly
    visit     the variant and the prompt column are drawn from (seed, epoch, position): fresh on every visit

Samples are read by random access (one pread, or one ranged request to an object store, per sample at the member
offsets the shard JSONs record, each member checked against its CRC-32), so the permutation is an exact shuffle over
the whole dataset; a streaming shuffle buffer, which only mixes neighbours, is not needed. `--data.shards` is a path
or an fsspec URL (s3://...), read through shardformat.storage; the order never depends on where the shards lie.
A mixture (`--data.mixture`) holds several shard sets, each with its own index, statistics and text table. Batch g
of a rank comes from one set, drawn with the mixture's probabilities from (seed, rank, g) (`SetDraws`); it is that
set's k-th batch on the rank, k = the rank's earlier batches of the set, taken from the set's own epoch order as
above. Every micro-batch thus holds one set's shapes, and everything stays a pure function of the batch number.
The state is the next batch number: `state_dict()` / `load_state_dict()` resume exactly where the last consumed
batch ended. This module imports no preprocessing code: the shard format lives in
`shardformat`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from wampipe.errors import UsageError
from wampipe.shardformat.layout import ACTION, LATENTS, MANIFEST, STATE, VAL_DIR, Y
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.stats import normalize_q99, pad_with_mask
from wampipe.shardformat.index import ShardIndex, ShardReader, Window
from wampipe.train.config import AUTO, Auto, DataConfig, ShardSet
from wampipe.train.dit.text import compact_text, compact_text_rows, pad_text

if TYPE_CHECKING:  # annotations only: the loader never builds the model
    from wampipe.train.dit.model import DiTConfig

# + text_lengths; clip_pixels in place of clip when the shards hold CLIP's input (the trainer runs CLIP on it)
BATCH_KEYS = ("latents", "clip", "text", "state", "actions", "action_mask", "has_real_action")


def epoch_order(weights: np.ndarray, seed: int, epoch: int, stream: int = 0) -> np.ndarray:
    """Window at each position of `epoch`: window i `weights[i]` times, in a permutation seeded by (seed, epoch) and,
    for a mixture's set after the first, its position `stream`."""
    return np.random.default_rng(_seed(seed, epoch, stream)).permutation(np.repeat(np.arange(len(weights)), weights))


def _seed(*parts: int) -> list[int]:
    """An RNG seed of `parts` whose last part is a mixture's set; set 0 adds nothing, so a single set draws as
    before mixtures existed."""
    return list(parts[:-1]) + ([parts[-1]] if parts[-1] else [])


class SetDraws:
    """The set of every batch g of one rank, drawn with probabilities `probs` in blocks seeded by (seed, rank, block):
    a pure function of (seed, rank, g), the same in every loader worker and after a resume."""

    BLOCK = 4096

    def __init__(self, probs: Sequence[float] | np.ndarray, seed: int, rank: int):
        self.probs, self.seed, self.rank = np.asarray(probs, np.float64), seed, rank
        self.block = lru_cache(maxsize=4)(self._draw)
        # a whole block's counts, kept: counting up to a late batch (metrics, a resume) draws each block once
        self.block_counts = lru_cache(maxsize=None)(lambda b: np.bincount(self._draw(b), minlength=len(self.probs)))

    def _draw(self, block: int) -> np.ndarray:
        if len(self.probs) == 1:
            return np.zeros(self.BLOCK, np.int64)
        rng = np.random.default_rng([self.seed, self.rank, block, 2])
        return rng.choice(len(self.probs), self.BLOCK, p=self.probs)

    def __getitem__(self, g: int) -> int:
        return int(self.block(g // self.BLOCK)[g % self.BLOCK])

    def counts(self, stop: int) -> np.ndarray:
        """Batches of each set among g < stop."""
        full, rest = divmod(stop, self.BLOCK)
        n = len(self.probs)
        total = sum((self.block_counts(b) for b in range(full)), np.zeros(n, np.int64))
        return total + np.bincount(self.block(full)[:rest], minlength=n)


def set_names(sets: Sequence[ShardSet]) -> list[str]:
    """Short names of a mixture's sets for metrics: the folder name (a validation split's: `<build>-val`), with its
    position where two share one."""

    def name(i: int, s: ShardSet) -> str:
        parts = str(s.shards).rstrip("/").rsplit("/", 2)
        if parts[-1] == VAL_DIR and len(parts) > 1 and parts[-2]:
            return f"{parts[-2]}-{VAL_DIR}"
        return parts[-1] or f"set{i}"

    base = [name(i, s) for i, s in enumerate(sets)]
    return [b if base.count(b) == 1 else f"{b}-{i}" for i, b in enumerate(base)]


def set_probabilities(sets: Sequence[ShardSet], epoch_lengths: Sequence[int], weighting: str) -> np.ndarray:
    """Probability of drawing each set for a batch: its weight (`set`) or weight x visits per epoch (`size`),
    normalised."""
    w = np.array([s.weight for s in sets], np.float64)
    if weighting == "size":
        w = w * np.asarray(epoch_lengths, np.float64)
    return w / w.sum()


def batches_per_epoch(epoch_length: int, world_size: int, micro_batch_size: int) -> int:
    return epoch_length // world_size // micro_batch_size


def batch_positions(epoch_length: int, g: int, rank: int, world_size: int, micro: int) -> tuple[int, np.ndarray]:
    """(epoch, positions in the epoch order) of global batch `g` on `rank`: every world-th position, from `rank`."""
    epoch, b = divmod(g, batches_per_epoch(epoch_length, world_size, micro))
    return epoch, rank + world_size * np.arange(b * micro, (b + 1) * micro)


# DiTConfig fields every set of a mixture must share (a batch carries its own latent grid and action horizon)
SHARED_DIMS = ("model_type", "in_dim", "out_dim", "text_dim", "image_dim", "image_len")
# encoders whose outputs the DiT reads: another file means another DiT recipe
SHARED_ENCODERS = {"vae": "VAE", "text_encoder": "text encoder", "image_encoder": "image encoder"}


def open_sets(cfg: DataConfig) -> list[ShardIndex]:
    """The index of every set of the run (`--data.shards` or `--data.mixture`), checked to share one DiT recipe."""
    indexes = [ShardIndex(s.shards, cfg.cache_dir) for s in cfg.sets()]
    for s, index in zip(cfg.sets(), indexes):
        if not len(index):
            raise UsageError(f"{s.shards}: no windows (an empty shard set)")
        variants = max(1, int(index.manifest.transform.get("augment_variants", 0)))  # every window holds them all
        if cfg.variant != AUTO and cfg.variant >= variants:
            raise UsageError(
                f"--data.variant {cfg.variant}: {s.shards} holds {variants} variant(s) per window "
                f"(0-{variants - 1}; auto draws one per visit)"
            )
    if len(indexes) > 1:
        mixture_dims(indexes)
    return indexes


def check_alongside(index: ShardIndex, run: Sequence[ShardIndex], role: str) -> None:
    """A validation or action-evaluation set, checked at start against the run's sets: built for the same DiT recipe
    (`mixture_dims`) and holding windows; UsageError naming it and the field otherwise."""
    if not len(index):
        raise UsageError(f"{index.root}: no windows (an empty {role})")
    mixture_dims([run[0], index], f"{role} must be built like the data it evaluates")


def mixture_dims(
    indexes: Sequence[ShardIndex], rule: str = "the sets of a mixture share the encoders and the DiT's widths"
) -> dict:
    """`data_dims` of the run's sets: the first set's, text_len the longest prompt of all. A set built for another DiT
    recipe (encoders, latent channels, text or CLIP width, CLIP features or pixels) stops the run in one line naming
    the set and the field."""
    first, dims = indexes[0], data_dims(indexes[0])
    for index in indexes[1:]:
        own = data_dims(index)
        fields = [(k, dims.get(k), own.get(k)) for k in SHARED_DIMS]
        fields.append(("image_features", first.manifest.image_features, index.manifest.image_features))
        fields += [
            (name, first.manifest.encoders.get(k, {}).get("sha256"), index.manifest.encoders.get(k, {}).get("sha256"))
            for k, name in SHARED_ENCODERS.items()
        ]
        for field, want, got in fields:
            if want != got:
                raise UsageError(
                    f"{index.root}: built for another DiT recipe than {first.root}: {field} {got} vs {want}; {rule}"
                )
        dims["text_len"] = max(dims["text_len"], own["text_len"])
    return dims


def data_dims(source: str | os.PathLike | ShardIndex) -> dict:
    """The DiTConfig fields a shard directory fixes: those of its manifest's sample schema (latent channels (+ y),
    tokens per latent frame, actions per block, CLIP width: shardformat.schema.model_dims) and of its text table
    (width, longest prompt); no sample is decoded. The tiny preset takes them from the data; real presets are checked.
    Shards of CLIP's input pixels fix no CLIP width: the trainer's CLIP does (train/main.py)."""
    index = source if isinstance(source, ShardIndex) else ShardIndex(source)
    return index.manifest.dims | {"text_dim": index.text.dim, "text_len": index.longest_prompt}


class SampleReader(ShardReader):
    """`ShardReader` decoding samples into model inputs; one per worker."""

    def __init__(self, index: ShardIndex, model: DiTConfig):
        super().__init__(index)
        self.model = model

    def text(self, prompt_id: str) -> torch.Tensor:
        return self.index.text.get(prompt_id)

    def sample(self, window: Window, rng: np.random.Generator, variant: int | Auto = AUTO, column: str = AUTO) -> dict:
        """One window's model inputs, with this visit's variant and prompt column (auto: drawn with `rng`)."""
        if variant != AUTO and variant >= len(window.rows):
            raise ValueError(f"window {window.name} has {len(window.rows)} variants, --data.variant {variant}")
        pick = rng.integers(len(window.rows)) if variant == AUTO else variant
        row = window.rows[pick]
        shard, key = self.index.table.shard(row), self.index.table.key(row)
        meta, t = self.raw_row(row)
        prompt_ids = meta["prompt_ids"]
        if column != AUTO and column not in prompt_ids:
            raise ShardFormatError(
                f"{self.index.shards[shard]}: sample {key} has no prompt column {column!r} (has {sorted(prompt_ids)})"
            )
        columns = sorted(prompt_ids)
        column = columns[rng.integers(len(columns))] if column == AUTO else column
        m = self.model
        image = self.index.manifest.image_member  # CLIP's features, or its input pixels
        out = {LATENTS: t[LATENTS], image: t[image], "text": self.text(prompt_ids[column])}
        for name, width in ((STATE, m.max_state_dim), (ACTION, m.action_dim)):
            x = torch.from_numpy(np.asarray(t[name], np.float32))
            if x.shape[-1] != self.index.q01[name].size:
                raise ShardFormatError(
                    f"{self.index.shards[shard]}: sample {key}: {name} has {x.shape[-1]} dims, the "
                    f"statistics of {self.index.manifest.embodiment} have "
                    f"{self.index.q01[name].size}"
                )
            x, mask = pad_with_mask(normalize_q99(x, self.index.q01[name], self.index.q99[name]), width)
            out["actions" if name == ACTION else name] = x
            if name == ACTION:
                out["action_mask"] = mask
        if Y in t:
            out[Y] = t[Y]
        return out


def collate(samples: list[dict], text_len: int, compact_rows: int | None = None) -> dict:
    """Stack a micro-batch; text as `compact_text` with `compact_rows` rows (text + text_lengths) or, when None,
    `pad_text` (text_len rows)."""
    # Inside a loader worker the stacked tensors and the text go straight into shared memory (default_collate does so
    # for stacks), so handing the batch to the trainer copies them no more: ~15 % of a worker's time at the 5B shape.
    batch = {k: default_collate([s[k] for s in samples]) for k in samples[0] if k != "text"}
    texts = [s["text"] for s in samples]
    rows = text_len if compact_rows is None else compact_rows
    out = None
    if get_worker_info() is not None:
        like = texts[0]
        storage = torch.UntypedStorage._new_shared(len(texts) * rows * like.shape[-1] * like.element_size())
        out = like.new_empty(0).set_(storage).view(len(texts), rows, like.shape[-1])
    if compact_rows is not None:
        batch["text"], batch["text_lengths"] = compact_text(texts, text_len, rows=compact_rows, out=out)
    else:
        batch["text"] = pad_text(texts, text_len, out=out)
    batch["has_real_action"] = torch.ones(len(samples), dtype=torch.bool)
    return batch


class BatchStream(IterableDataset):
    """Infinite stream of one rank's batches from global batch `start` on, split over loader workers; each batch from
    the set `SetDraws` gives it (one set: always that one).

    A corrupt or unreadable sample ends the stream with {"error": message} in place of its batch."""

    def __init__(
        self,
        indexes: Sequence[ShardIndex],
        probs: np.ndarray,
        model: DiTConfig,
        cfg: DataConfig,
        rank: int,
        world_size: int,
        start: int,
    ):
        self.indexes, self.probs, self.model, self.cfg = indexes, probs, model, cfg
        self.rank, self.world_size, self.start = rank, world_size, start

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        cfg, micro = self.cfg, self.cfg.micro()
        readers = [SampleReader(index, self.model) for index in self.indexes]
        weights = [index.weights(cfg.sampling) for index in self.indexes]
        lengths = [int(w.sum()) for w in weights]
        orders: dict[int, tuple[int, np.ndarray]] = {}  # set -> (epoch, its order)
        draws = SetDraws(self.probs, cfg.seed, self.rank)
        # one text width for the whole run (the longest prompt of all sets): compiled blocks see a single text shape
        longest = max(index.longest_prompt for index in self.indexes)
        rows = compact_text_rows(longest, self.model.text_len) if cfg.compact_text else None
        try:
            g = self.start + wid
            seen = draws.counts(g)  # batches of each set before g on this rank
            while True:
                s = draws[g]
                epoch, positions = batch_positions(lengths[s], int(seen[s]), self.rank, self.world_size, micro)
                if orders.get(s, (None,))[0] != epoch:
                    orders[s] = (epoch, epoch_order(weights[s], cfg.seed, epoch, s))
                windows = orders[s][1][positions]
                try:
                    # one window per int (Windows returns a list only for a slice)
                    samples = [
                        readers[s].sample(
                            cast(Window, self.indexes[s].windows[w]),
                            np.random.default_rng(_seed(cfg.seed, epoch, int(p), 1, s)),
                            cfg.variant,
                            cfg.text_column,
                        )
                        for w, p in zip(windows, positions)
                    ]
                except ShardFormatError as err:
                    yield {"error": str(err)}  # the trainer stops with this one line when the batch is due
                    return
                batch = collate(samples, self.model.text_len, rows)
                batch["window"] = torch.as_tensor(windows, dtype=torch.int64)
                batch["set"] = torch.tensor(s)
                batch["batch"] = torch.tensor(g)
                yield batch
                for later in range(g, g + nw):
                    seen[draws[later]] += 1
                g += nw
        finally:
            for reader in readers:
                reader.close()


class ShardLoader:
    """One rank's batches on `device`, with pinned memory and the next batch's H2D copy overlapping compute.

    Iterating yields batches from the saved position on; `wait_s` accumulates the time spent blocked on data.
    """

    def __init__(
        self,
        cfg: DataConfig,
        model: DiTConfig,
        rank: int,
        world_size: int,
        device: torch.device,
        index: ShardIndex | Sequence[ShardIndex] | None = None,
    ):
        """`index`: the index of each set (`open_sets`) when the caller has opened them already (reading every shard
        JSON once per rank, not twice); else they are opened here from cfg."""
        if cfg.shards is None and not cfg.mixture:
            raise UsageError(f"--data.shards is required (a directory or URL with {MANIFEST})")
        self.cfg, self.model, self.rank, self.world_size, self.device = cfg, model, rank, world_size, device
        self.indexes = [index] if isinstance(index, ShardIndex) else list(index or open_sets(cfg))
        self.index = self.indexes[0]
        self.sets, self.names = cfg.sets(), set_names(cfg.sets())
        self.num_windows = sum(len(index) for index in self.indexes)
        self.epoch_lengths = [int(index.weights(cfg.sampling).sum()) for index in self.indexes]
        self.epoch_length = sum(self.epoch_lengths)
        for s, index, length in zip(self.sets, self.indexes, self.epoch_lengths):
            if batches_per_epoch(length, world_size, cfg.micro()) == 0:
                raise UsageError(
                    f"{s.shards}: {length} window visits per epoch cannot fill one micro-batch of "
                    f"{cfg.micro_batch_size} on each of {world_size} ranks"
                )
            for name, width in ((STATE, model.max_state_dim), (ACTION, model.action_dim)):
                if index.q01[name].size > width:
                    raise UsageError(
                        f"{s.shards}: {name} has {index.q01[name].size} dims, more than the model's "
                        f"{width} ({'max_state_dim' if name == 'state' else 'action_dim'})"
                    )
        self.probs = set_probabilities(self.sets, self.epoch_lengths, cfg.mixture_weighting)
        self.draws = SetDraws(self.probs, cfg.seed, rank)  # the main process's, for samples_seen
        self.batches_per_epoch = batches_per_epoch(self.epoch_length, world_size, cfg.micro())
        self.next_batch = 0
        self.wait_s = 0.0

    @property
    def epoch(self) -> int:
        return self.next_batch // self.batches_per_epoch

    def samples_seen(self) -> np.ndarray:
        """Samples this rank has taken from each set: a function of the batch position, so exact after a resume."""
        return self.draws.counts(self.next_batch) * self.cfg.micro()

    def mixture(self) -> list | None:
        """[shards, weight, windows, visits per epoch] of each set, with the weighting; None without --data.mixture."""
        if not self.cfg.mixture:
            return None
        return [
            [str(s.shards), s.weight, len(index), length]
            for s, index, length in zip(self.sets, self.indexes, self.epoch_lengths)
        ] + [self.cfg.mixture_weighting]

    def state_dict(self) -> dict:
        return {
            "next_batch": self.next_batch,
            "world_size": self.world_size,
            "seed": self.cfg.seed,
            "micro_batch_size": self.cfg.micro(),
            "num_windows": self.num_windows,
            "sampling": self.cfg.sampling,
            "epoch_length": self.epoch_length,
            "mixture": self.mixture(),
            "builds": [index.store.build for index in self.indexes],
        }

    def load_state_dict(self, state: dict) -> None:
        # states saved before weighted sampling existed were uniform: one visit per window and epoch
        state = {"sampling": "uniform", "epoch_length": state["num_windows"], "mixture": None, **state}
        mine = self.state_dict()
        changed = [
            f"{s.shards} (manifest {old} -> {new})"
            for s, old, new in zip(self.sets, state.get("builds") or mine["builds"], mine["builds"])
            if old != new
        ]
        if changed and state["mixture"] == mine["mixture"] and not self.cfg.mixture_changed:
            raise UsageError(
                f"checkpoint data was read from other builds of {', '.join(changed)}: the shards were "
                f"rebuilt since; pass --data.mixture-changed to continue with them"
            )
        if state["mixture"] != mine["mixture"]:
            if not self.cfg.mixture_changed:
                raise UsageError(
                    f"checkpoint data ({_describe_mixture(state['mixture'])}) differs from this run's "
                    f"({_describe_mixture(mine['mixture'])}); pass --data.mixture-changed to continue "
                    f"with this run's data"
                )
            state = {**state, "num_windows": mine["num_windows"], "epoch_length": mine["epoch_length"]}
        layout = ("world_size", "micro_batch_size", "num_windows", "seed", "sampling", "epoch_length")
        if {k: state[k] for k in layout} == {k: mine[k] for k in layout}:
            self.next_batch = state["next_batch"]
            return
        if not self.cfg.reshuffle_on_resize:
            raise UsageError(
                f"checkpoint data state ({_describe(state)}) differs from this run ({_describe(mine)}); pass "
                f"--data.reshuffle-on-resize to continue at the next epoch"
            )
        old_epoch = state["next_batch"] // batches_per_epoch(
            state["epoch_length"], state["world_size"], state["micro_batch_size"]
        )
        self.next_batch = (old_epoch + 1) * self.batches_per_epoch

    def _loader(self) -> DataLoader:
        cfg = self.cfg
        stream = BatchStream(self.indexes, self.probs, self.model, cfg, self.rank, self.world_size, self.next_batch)
        pin = cfg.pin_memory and self.device.type == "cuda"
        kwargs: dict[str, Any] = {"prefetch_factor": cfg.prefetch_factor} if cfg.num_workers else {}
        return DataLoader(stream, batch_size=None, num_workers=cfg.num_workers, pin_memory=pin, **kwargs)

    def _to_device(self, batch: dict, stream) -> dict:
        if self.device.type != "cuda":
            return batch
        with torch.cuda.stream(stream):
            # bookkeeping ("batch", "window", "set") stays on the host: reading it must not sync the GPU
            return {
                k: v if k in ("batch", "window", "set") else v.to(self.device, non_blocking=True)
                for k, v in batch.items()
            }

    def __iter__(self):
        source = iter(self._loader())
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

        def fetch():
            t0 = time.perf_counter()
            batch = next(source)
            self.wait_s += time.perf_counter() - t0
            if "error" in batch:
                raise ShardFormatError(batch["error"])
            return self._to_device(batch, stream)

        pending = fetch()
        while True:
            if stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(stream)
                for v in pending.values():
                    if v.is_cuda:
                        v.record_stream(torch.cuda.current_stream(self.device))
            batch, pending = pending, None
            expected = self.next_batch
            if int(batch["batch"]) != expected:
                raise RuntimeError(f"loader delivered batch {int(batch['batch'])}, expected {expected}")
            self.next_batch += 1
            pending = fetch()  # the next batch's H2D copy runs on its own stream while this one is computed on
            yield batch


def _describe(state: dict) -> str:
    return (
        f"world size {state['world_size']}, micro-batch {state['micro_batch_size']}, {state['num_windows']} "
        f"windows, seed {state['seed']}, {state['sampling']} sampling of {state['epoch_length']} visits"
    )


def _describe_mixture(mixture: list | None) -> str:
    if mixture is None:
        return "one set, --data.shards"
    *sets, weighting = mixture
    return f"mixture by {weighting} of " + ", ".join(
        f"{shards}={weight:g} ({windows} windows)" for shards, weight, windows, _ in sets
    )
