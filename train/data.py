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
The state is the next batch number: `state_dict()` / `load_state_dict()` resume exactly where the last consumed
batch ended. This module imports no preprocessing code: the shard format lives in
`shardformat`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from shardformat.keys import parse_key, window_name
from shardformat.manifest import ShardFormatError, check_sha256
from shardformat.members import decode_members
from shardformat.shard import json_path, read_members
from shardformat.stats import normalize_q99, pad_with_mask, stat_vector
from shardformat.storage import STORE_ERRORS, ShardStore
from shardformat.text import TextTable
from train.config import DataConfig
from train.model import DiTConfig, compact_text, compact_text_rows, pad_text

# + text_lengths; clip_pixels in place of clip when the shards hold CLIP's input (the trainer runs CLIP on it)
BATCH_KEYS = ("latents", "clip", "text", "state", "actions", "action_mask", "has_real_action")


@dataclass(frozen=True)
class Window:
    """One training window, how often the reference's sampler draws it, and where each of its augmentation variants
    lives: ((shard index, key), ...)."""

    name: str
    anchor_multiplicity: int
    variants: tuple[tuple[int, str], ...]


class ShardIndex:
    """The manifest's shards and windows, the statistics and the text table of one shard directory (a path or URL;
    `cache_dir`: whole-file copies of remote shards, shardformat.storage).

    Nothing is used before it is checked against the sealed manifest: each tar's size, each shard JSON (sealed, in
    agreement, every member inside its tar), the statistics and text table files by sha256 (hashed once per process
    here; the tars' members are checked by CRC-32 on every read). Raises ShardFormatError (naming the file) for a
    directory this code cannot read or trust."""

    def __init__(self, root: str | os.PathLike, cache_dir: str | os.PathLike | None = None):
        self.store = ShardStore(root, cache_dir)
        self.root = self.store.url
        self.manifest = self.store.manifest()
        self.shards = [self.store.where(entry.shard) for entry in self.manifest.shards]  # for messages
        self.windows = self._read_windows()
        self.q01, self.q99 = self._read_statistics()
        text = self.manifest.text_table  # a local copy, opened by name (safetensors)
        try:
            self.text = TextTable(self.store.local_root(text["file"]), text).verify()
        except STORE_ERRORS as err:
            raise ShardFormatError(f"{self.store.where(text['file'])}: unreadable: {err}") from None

    def _read_windows(self) -> list[Window]:
        """Every sample key of the shard JSONs, grouped by window, sorted by name."""
        names = [entry.shard for entry in self.manifest.shards]
        try:
            sizes = self.store.sizes()
        except STORE_ERRORS as err:
            raise ShardFormatError(f"{self.root}: cannot list: {err}") from None
        for entry in self.manifest.shards:
            if entry.shard not in sizes or json_path(entry.shard).as_posix() not in sizes:
                raise ShardFormatError(f"{self.store.where(entry.shard)}: listed in the manifest but missing (or its "
                                       f".json is)")
            if sizes[entry.shard] != entry.bytes:  # members are bounded by entry.bytes: it must be the tar's size
                raise ShardFormatError(f"{self.store.where(entry.shard)}: {sizes[entry.shard]} bytes, the manifest "
                                       f"says {entry.bytes}")
        grouped: dict[str, list[tuple[int, int, str, int]]] = {}
        for i, (entry, record) in enumerate(zip(self.manifest.shards, self.store.shard_records(names))):
            side = self.store.where(json_path(entry.shard).as_posix())
            record.check_entry(entry, side)
            for sample in record.samples:
                try:
                    variant = parse_key(sample.key).variant
                except ValueError as err:
                    raise ShardFormatError(f"{side}: {err}") from None
                grouped.setdefault(window_name(sample.key), []).append((variant, i, sample.key,
                                                                        sample.anchor_multiplicity))
        return [self._window(name, sorted(v)) for name, v in sorted(grouped.items())]

    def _read_statistics(self) -> tuple[dict, dict]:
        """q01 and q99 of the state and action columns, from the statistics file of the manifest's embodiment."""
        tag, statistics = self.manifest.embodiment, self.manifest.statistics["file"]
        where = self.store.where(statistics)
        try:
            data = self.store.read_bytes(statistics)
        except STORE_ERRORS as err:
            raise ShardFormatError(f"{where}: unreadable: {err}") from None
        check_sha256(where, hashlib.sha256(data).hexdigest(), self.manifest.statistics["sha256"])
        try:
            metadata = json.loads(data)
        except ValueError as err:
            raise ShardFormatError(f"{where}: unreadable: {err}") from None
        if tag not in metadata:
            raise ShardFormatError(f"{where}: no statistics for {tag!r} (has {sorted(metadata)})")
        keys = self.manifest.modality_keys
        try:
            stats = metadata[tag]["statistics"]
            return ({m: stat_vector(stats, m, keys[m], "q01") for m in ("state", "action")},
                    {m: stat_vector(stats, m, keys[m], "q99") for m in ("state", "action")})
        except (KeyError, TypeError, ValueError) as err:
            raise ShardFormatError(f"{where}: statistics of {tag!r} unusable: {err}") from None

    def _window(self, name: str, variants: list[tuple[int, int, str, int]]) -> Window:
        multiplicities = {m for *_, m in variants}
        if len(multiplicities) != 1:
            raise ShardFormatError(f"{self.root}: window {name}: its variants disagree on anchor_multiplicity "
                                   f"({sorted(multiplicities)})")
        return Window(name, multiplicities.pop(), tuple((s, k) for _, s, k, _ in variants))

    def weights(self, sampling: str) -> np.ndarray:
        """Visits of each window per epoch: its anchor multiplicity, or 1 each for uniform sampling."""
        if sampling == "uniform":
            return np.ones(len(self.windows), np.int64)
        return np.array([w.anchor_multiplicity for w in self.windows], np.int64)

    @property
    def longest_prompt(self) -> int:
        """umT5 rows of the longest prompt in the text table."""
        return self.text.longest_prompt

    def __len__(self) -> int:
        return len(self.windows)


def open_index(root: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> ShardIndex:
    """ShardIndex, or a one-line SystemExit naming the file when the directory cannot be read."""
    try:
        return ShardIndex(root, cache_dir)
    except ShardFormatError as err:
        raise SystemExit(str(err)) from None


def epoch_order(weights: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """Window at each position of `epoch`: window i `weights[i]` times, in a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(np.repeat(np.arange(len(weights)), weights))


def batches_per_epoch(epoch_length: int, world_size: int, micro_batch_size: int) -> int:
    return epoch_length // world_size // micro_batch_size


def batch_positions(epoch_length: int, g: int, rank: int, world_size: int, micro: int) -> tuple[int, np.ndarray]:
    """(epoch, positions in the epoch order) of global batch `g` on `rank`: every world-th position, from `rank`."""
    epoch, b = divmod(g, batches_per_epoch(epoch_length, world_size, micro))
    return epoch, rank + world_size * np.arange(b * micro, (b + 1) * micro)


def data_dims(source: str | os.PathLike | ShardIndex) -> dict:
    """The DiTConfig fields a shard directory fixes: latent channels (+ y), tokens per latent frame, actions per block,
    text and CLIP widths, longest prompt. The tiny preset takes them from the data; real presets are checked. Shards
    of CLIP's input pixels fix no CLIP width: the trainer's CLIP does (train/main.py)."""
    index = source if isinstance(source, ShardIndex) else open_index(source)
    reader = SampleReader(index, None)
    try:
        _, t = reader.raw(*index.windows[0].variants[0])
    except ShardFormatError as err:
        raise SystemExit(str(err)) from None
    finally:
        reader.close()
    c, frames, h, w = t["latents"].shape
    blocks = (frames - 1) // 2  # num_frame_per_block = 2
    dims = {"model_type": "i2v" if "y" in t else "ti2v", "in_dim": c + (t["y"].shape[0] if "y" in t else 0),
            "out_dim": c, "frame_seqlen": (h // 2) * (w // 2), "num_action_per_block": t["action"].shape[0] // blocks,
            "text_dim": index.text.dim, "text_len": index.longest_prompt}
    if "clip" in t:
        dims |= {"image_dim": int(t["clip"].shape[-1]), "image_len": int(t["clip"].shape[0])}
    return dims


class SampleReader:
    """Verified random access to samples (one read per sample at the recorded member offsets, CRC-32 checked) and
    decoding into model inputs; one per worker."""

    def __init__(self, index: ShardIndex, model: DiTConfig):
        self.index, self.model = index, model
        self._records = lru_cache(maxsize=64)(self._read_record)

    def _read_record(self, shard: int) -> dict:
        """{key: SampleRecord} of one shard (its JSON is read again after dropping out of the LRU cache)."""
        (record,) = self.index.store.shard_records([self.index.manifest.shards[shard].shard])
        return {s.key: s for s in record.samples}

    def close(self) -> None:
        self.index.store.close()

    def raw(self, shard: int, key: str) -> tuple[dict, dict]:
        """(meta, tensors) of one sample; ShardFormatError names the shard, sample and member of any corruption."""
        name, where = self.index.manifest.shards[shard].shard, self.index.shards[shard]
        record = self._records(shard).get(key)
        if record is None:
            raise ShardFormatError(f"{self.index.store.where(json_path(name).as_posix())}: no sample {key}")
        try:
            members = read_members(lambda offset, size: self.index.store.read_range(name, offset, size), where, record)
        except (*STORE_ERRORS, EOFError) as err:  # a truncated file, or the object store failed
            raise ShardFormatError(f"{where}: sample {key}: unreadable: {err}") from None
        try:
            return decode_members(members)
        except ValueError as err:
            raise ShardFormatError(f"{where}: sample {key}: {err}") from None

    def text(self, prompt_id: str) -> torch.Tensor:
        return self.index.text.get(prompt_id)

    def sample(self, window: Window, rng: np.random.Generator, variant: int = -1, column: str = "") -> dict:
        """One window's model inputs, with this visit's variant and prompt column."""
        if variant >= 0 and variant >= len(window.variants):
            raise ValueError(f"window {window.name} has {len(window.variants)} variants, --data.variant {variant}")
        pick = rng.integers(len(window.variants)) if variant < 0 else variant
        shard, key = window.variants[pick]
        meta, t = self.raw(shard, key)
        prompt_ids = meta["prompt_ids"]
        if column and column not in prompt_ids:
            raise ShardFormatError(f"{self.index.shards[shard]}: sample {key} has no prompt column {column!r} "
                           f"(has {sorted(prompt_ids)})")
        columns = sorted(prompt_ids)
        column = column or columns[rng.integers(len(columns))]
        m = self.model
        image = self.index.manifest.image_member  # CLIP's features, or its input pixels
        out = {"latents": t["latents"], image: t[image], "text": self.text(prompt_ids[column])}
        for name, width in (("state", m.max_state_dim), ("action", m.action_dim)):
            x = torch.from_numpy(np.asarray(t[name], np.float32))
            if x.shape[-1] != self.index.q01[name].size:
                raise ShardFormatError(f"{self.index.shards[shard]}: sample {key}: {name} has {x.shape[-1]} dims, the "
                                       f"statistics of {self.index.manifest.embodiment} have "
                                       f"{self.index.q01[name].size}")
            x, mask = pad_with_mask(normalize_q99(x, self.index.q01[name], self.index.q99[name]), width)
            out["actions" if name == "action" else name] = x
            if name == "action":
                out["action_mask"] = mask
        if "y" in t:
            out["y"] = t["y"]
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
    """Infinite stream of one rank's batches from global batch `start` on, split over loader workers.

    A corrupt or unreadable sample ends the stream with {"error": message} in place of its batch."""

    def __init__(self, index: ShardIndex, model: DiTConfig, cfg: DataConfig, rank: int, world_size: int, start: int):
        self.index, self.model, self.cfg = index, model, cfg
        self.rank, self.world_size, self.start = rank, world_size, start

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        index, cfg = self.index, self.cfg
        reader = SampleReader(index, self.model)
        weights = index.weights(cfg.sampling)
        epoch_length, order, order_epoch = int(weights.sum()), None, None
        # one text width for the whole run (the longest prompt's): compiled blocks see a single shape
        rows = compact_text_rows(index.longest_prompt, self.model.text_len) if cfg.compact_text else None
        try:
            g = self.start + wid
            while True:
                epoch, positions = batch_positions(epoch_length, g, self.rank, self.world_size, cfg.micro_batch_size)
                if epoch != order_epoch:
                    order, order_epoch = epoch_order(weights, cfg.seed, epoch), epoch
                windows = order[positions]
                try:
                    samples = [reader.sample(index.windows[w], np.random.default_rng([cfg.seed, epoch, int(p), 1]),
                                             cfg.variant, cfg.text_column) for w, p in zip(windows, positions)]
                except ShardFormatError as err:
                    yield {"error": str(err)}  # the trainer stops with this one line when the batch is due
                    return
                batch = collate(samples, self.model.text_len, rows)
                batch["window"] = torch.as_tensor(windows, dtype=torch.int64)
                batch["batch"] = torch.tensor(g)
                yield batch
                g += nw
        finally:
            reader.close()


class ShardLoader:
    """One rank's batches on `device`, with pinned memory and the next batch's H2D copy overlapping compute.

    Iterating yields batches from the saved position on; `wait_s` accumulates the time spent blocked on data.
    """

    def __init__(self, cfg: DataConfig, model: DiTConfig, rank: int, world_size: int, device: torch.device,
                 index: ShardIndex | None = None):
        """`index`: the shard directory's index when the caller has opened it already (reading every shard JSON once
        per rank, not twice); else it is opened here from cfg.shards and cfg.cache_dir."""
        if cfg.shards is None:
            raise SystemExit("--data.shards is required (a directory or URL with manifest.json)")
        self.cfg, self.model, self.rank, self.world_size, self.device = cfg, model, rank, world_size, device
        self.index = index or open_index(cfg.shards, cfg.cache_dir)
        self.num_windows = len(self.index)
        self.epoch_length = int(self.index.weights(cfg.sampling).sum())
        self.batches_per_epoch = batches_per_epoch(self.epoch_length, world_size, cfg.micro_batch_size)
        if self.batches_per_epoch == 0:
            raise SystemExit(f"{cfg.shards}: {self.epoch_length} window visits per epoch cannot fill one micro-batch "
                             f"of {cfg.micro_batch_size} on each of {world_size} ranks")
        self.next_batch = 0
        self.wait_s = 0.0

    @property
    def epoch(self) -> int:
        return self.next_batch // self.batches_per_epoch

    def state_dict(self) -> dict:
        return {"next_batch": self.next_batch, "world_size": self.world_size, "seed": self.cfg.seed,
                "micro_batch_size": self.cfg.micro_batch_size, "num_windows": self.num_windows,
                "sampling": self.cfg.sampling, "epoch_length": self.epoch_length}

    def load_state_dict(self, state: dict) -> None:
        # states saved before weighted sampling existed were uniform: one visit per window and epoch
        state = {"sampling": "uniform", "epoch_length": state["num_windows"], **state}
        layout = ("world_size", "micro_batch_size", "num_windows", "seed", "sampling", "epoch_length")
        mine = {k: v for k, v in self.state_dict().items() if k in layout}
        if {k: state[k] for k in layout} == mine:
            self.next_batch = state["next_batch"]
            return
        if not self.cfg.reshuffle_on_resize:
            raise SystemExit(
                f"checkpoint data state ({_describe(state)}) differs from this run ({_describe(mine)}); pass "
                f"--data.reshuffle-on-resize to continue at the next epoch")
        old_epoch = state["next_batch"] // batches_per_epoch(state["epoch_length"], state["world_size"],
                                                             state["micro_batch_size"])
        self.next_batch = (old_epoch + 1) * self.batches_per_epoch

    def _loader(self) -> DataLoader:
        cfg = self.cfg
        stream = BatchStream(self.index, self.model, cfg, self.rank, self.world_size, self.next_batch)
        pin = cfg.pin_memory and self.device.type == "cuda"
        kwargs = {"prefetch_factor": cfg.prefetch_factor} if cfg.num_workers else {}
        return DataLoader(stream, batch_size=None, num_workers=cfg.num_workers, pin_memory=pin, **kwargs)

    def _to_device(self, batch: dict, stream) -> dict:
        if self.device.type != "cuda":
            return batch
        with torch.cuda.stream(stream):
            # bookkeeping ("batch", "window") stays on the host: reading it must not sync the GPU
            return {k: v if k in ("batch", "window") else v.to(self.device, non_blocking=True)
                    for k, v in batch.items()}

    def __iter__(self):
        source = iter(self._loader())
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

        def fetch():
            t0 = time.perf_counter()
            batch = next(source)
            self.wait_s += time.perf_counter() - t0
            if "error" in batch:
                raise SystemExit(batch["error"])
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
    return (f"world size {state['world_size']}, micro-batch {state['micro_batch_size']}, {state['num_windows']} "
            f"windows, seed {state['seed']}, {state['sampling']} sampling of {state['epoch_length']} visits")
