"""Shard loading for training: manifest -> windows -> per-rank, per-epoch batches that a resumed run reproduces.

Order is a pure function of (seed, epoch, rank), never of timing or worker count:

    windows   every sample key `<dataset>-e<ep>-s<start>-v<variant>` grouped by window (variants of one window),
              sorted by name, so the order does not depend on how samples were cut into shards
    epoch e   one permutation of all windows, seeded by (seed, e); rank r takes every world-th window of it,
              cut to the same number of micro-batches on every rank (no hang at epoch end with uneven shards)
    batch g   global batch counter over epochs; loader worker w produces the batches g = w mod num_workers, so
              the DataLoader's in-order round robin delivers g, g+1, ... exactly
    visit     the variant and the prompt column are drawn from (seed, epoch, window): fresh on every epoch

Samples are read by random access (pread at the tar member offsets), so the permutation is an exact uniform
shuffle over the whole dataset; a streaming shuffle buffer, which only mixes neighbours, is not needed. The state
is the next batch number: `state_dict()` / `load_state_dict()` resume exactly where the last consumed batch ended.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from preprocess.embodiments import get_embodiment
from preprocess.members import decode_members
from preprocess.state_action import normalize_q99, pad_with_mask, stat_vector
from preprocess.write import MANIFEST, member_index
from train.config import DataConfig
from train.model import DiTConfig, compact_text, compact_text_rows, pad_text

BATCH_KEYS = ("latents", "clip", "text", "state", "actions", "action_mask", "has_real_action")  # + text_lengths


@dataclass(frozen=True)
class Window:
    """One training window and where each of its augmentation variants lives: ((shard index, key), ...)."""

    name: str
    variants: tuple[tuple[int, str], ...]


def window_name(key: str) -> str:
    """`droid-e000012-s00034-v1` -> `droid-e000012-s00034` (a key without a variant suffix is its own window)."""
    base, sep, variant = key.rpartition("-v")
    return base if sep and variant.isdigit() else key


class ShardIndex:
    """The manifest's shards and windows, the statistics and the text table of one shard directory."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        path = self.root / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing (not a shard directory, or an unfinished preprocessing run)")
        self.manifest = json.loads(path.read_text())
        self.shards: list[Path] = []
        grouped: dict[str, list[tuple[int, int, str]]] = {}
        for i, entry in enumerate(self.manifest["shards"]):
            shard = self.root / entry["shard"]
            side = shard.with_suffix(".json")
            if not shard.is_file() or not side.is_file():
                raise FileNotFoundError(f"{shard}: listed in {path} but missing (or its .json is)")
            keys = json.loads(side.read_text())["keys"]
            if len(keys) != entry["count"]:
                raise ValueError(f"{side}: {len(keys)} keys, {path} says {entry['count']}")
            self.shards.append(shard)
            for key in keys:
                variant = key.rpartition("-v")[2]
                grouped.setdefault(window_name(key), []).append((int(variant) if variant.isdigit() else 0, i, key))
        self.windows = [Window(name, tuple((s, k) for _, s, k in sorted(v))) for name, v in sorted(grouped.items())]
        self.embodiment = get_embodiment(self.manifest["embodiment"])
        metadata = json.loads((self.root / self.manifest["statistics"]["file"]).read_text())
        if self.embodiment.tag not in metadata:
            raise KeyError(f"{self.root / self.manifest['statistics']['file']}: no statistics for "
                           f"{self.embodiment.tag!r} (has {sorted(metadata)})")
        stats = metadata[self.embodiment.tag]["statistics"]
        keys = {"state": self.embodiment.state_keys, "action": self.embodiment.action_keys}
        self.q01 = {m: stat_vector(stats, m, keys[m], "q01") for m in keys}
        self.q99 = {m: stat_vector(stats, m, keys[m], "q99") for m in keys}
        self.text_table = self.root / self.manifest["text_table"]["file"]

    @property
    def longest_prompt(self) -> int:
        """umT5 rows of the longest prompt in the text table."""
        prompts = json.loads((self.root / self.manifest["text_table"]["prompts"]).read_text())
        return max(p["tokens"] for p in prompts.values())

    def __len__(self) -> int:
        return len(self.windows)


def epoch_permutation(num_windows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_windows)


def batches_per_epoch(num_windows: int, world_size: int, micro_batch_size: int) -> int:
    return num_windows // world_size // micro_batch_size


def batch_windows(num_windows: int, seed: int, g: int, rank: int, world_size: int, micro: int) -> tuple[int, np.ndarray]:
    """(epoch, window indices) of global batch `g` on `rank`."""
    nb = batches_per_epoch(num_windows, world_size, micro)
    epoch, b = divmod(g, nb)
    mine = epoch_permutation(num_windows, seed, epoch)[rank::world_size][: nb * micro]
    return epoch, mine[b * micro : (b + 1) * micro]


def data_dims(root: Path | str) -> dict:
    """The DiTConfig fields a shard directory fixes: latent channels (+ y), tokens per latent frame, actions per block,
    text and CLIP widths, longest prompt. The tiny preset takes them from the data; real presets are checked."""
    index = ShardIndex(root)
    reader = SampleReader(index, None)
    try:
        shard, key = index.windows[0].variants[0]
        _, t = reader.raw(shard, key)
        with reader._text_table() as table:
            text_dim = table.get_slice(next(iter(table.keys()))).get_shape()[-1]
    finally:
        reader.close()
    c, frames, h, w = t["latents"].shape
    blocks = (frames - 1) // 2  # num_frame_per_block = 2
    dims = {"model_type": "i2v" if "y" in t else "ti2v", "in_dim": c + (t["y"].shape[0] if "y" in t else 0),
            "out_dim": c, "frame_seqlen": (h // 2) * (w // 2), "num_action_per_block": t["action"].shape[0] // blocks,
            "text_dim": int(text_dim), "image_dim": int(t["clip"].shape[-1]), "image_len": int(t["clip"].shape[0])}
    return dims | {"text_len": index.longest_prompt}


class SampleReader:
    """Random access to samples (pread at member offsets) and decoding into model inputs; one per worker."""

    def __init__(self, index: ShardIndex, model: DiTConfig):
        self.index, self.model = index, model
        self._fds: dict[int, int] = {}
        self._members = lru_cache(maxsize=64)(lambda shard: member_index(self.index.shards[shard]))
        self._text = None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def raw(self, shard: int, key: str) -> tuple[dict, dict]:
        members = self._members(shard).get(key)
        if members is None:
            raise KeyError(f"{self.index.shards[shard]}: sample {key} listed in the shard's JSON but not in the tar")
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self.index.shards[shard], os.O_RDONLY)
        data = {name.partition(".")[2]: os.pread(fd, size, offset) for name, offset, size in members}
        try:
            return decode_members(data)
        except ValueError as err:
            raise ValueError(f"{self.index.shards[shard]}: sample {key}: {err}") from None

    def _text_table(self):
        from safetensors import safe_open

        return safe_open(str(self.index.text_table), framework="pt")

    def text(self, prompt_id: str) -> torch.Tensor:
        if self._text is None:
            self._text = self._text_table()
        return self._text.get_tensor(prompt_id)

    def sample(self, window: Window, rng: np.random.Generator, variant: int = -1, column: str = "") -> dict:
        """One window's model inputs, with this visit's variant and prompt column."""
        if variant >= 0 and variant >= len(window.variants):
            raise ValueError(f"window {window.name} has {len(window.variants)} variants, --data.variant {variant}")
        pick = rng.integers(len(window.variants)) if variant < 0 else variant
        shard, key = window.variants[pick]
        meta, t = self.raw(shard, key)
        prompt_ids = meta["prompt_ids"]
        if column and column not in prompt_ids:
            raise KeyError(f"{self.index.shards[shard]}: sample {key} has no prompt column {column!r} "
                           f"(has {sorted(prompt_ids)})")
        columns = sorted(prompt_ids)
        column = column or columns[rng.integers(len(columns))]
        m = self.model
        out = {"latents": t["latents"], "clip": t["clip"], "text": self.text(prompt_ids[column])}
        for name, width in (("state", m.max_state_dim), ("action", m.action_dim)):
            x = torch.from_numpy(np.asarray(t[name], np.float32))
            if x.shape[-1] != self.index.q01[name].size:
                raise ValueError(f"{self.index.shards[shard]}: sample {key}: {name} has {x.shape[-1]} dims, the "
                                 f"statistics of {self.index.embodiment.tag} have {self.index.q01[name].size}")
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
    """Infinite stream of one rank's batches from global batch `start` on, split over loader workers."""

    def __init__(self, root: Path, model: DiTConfig, cfg: DataConfig, rank: int, world_size: int, start: int):
        self.root, self.model, self.cfg = root, model, cfg
        self.rank, self.world_size, self.start = rank, world_size, start

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        index = ShardIndex(self.root)
        reader = SampleReader(index, self.model)
        n, cfg = len(index), self.cfg
        # one text width for the whole run (the longest prompt's): compiled blocks see a single shape
        rows = compact_text_rows(index.longest_prompt, self.model.text_len) if cfg.compact_text else None
        try:
            g = self.start + wid
            while True:
                epoch, windows = batch_windows(n, cfg.seed, g, self.rank, self.world_size, cfg.micro_batch_size)
                samples = [reader.sample(index.windows[w], np.random.default_rng([cfg.seed, epoch, int(w), 1]),
                                         cfg.variant, cfg.text_column) for w in windows]
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

    def __init__(self, cfg: DataConfig, model: DiTConfig, rank: int, world_size: int, device: torch.device):
        if cfg.shards is None:
            raise SystemExit("--data.shards is required (a directory with manifest.json)")
        self.cfg, self.model, self.rank, self.world_size, self.device = cfg, model, rank, world_size, device
        self.index = ShardIndex(cfg.shards)
        self.num_windows = len(self.index)
        self.batches_per_epoch = batches_per_epoch(self.num_windows, world_size, cfg.micro_batch_size)
        if self.batches_per_epoch == 0:
            raise SystemExit(f"{cfg.shards}: {self.num_windows} windows cannot fill one micro-batch of "
                             f"{cfg.micro_batch_size} on each of {world_size} ranks")
        self.next_batch = 0
        self.wait_s = 0.0

    @property
    def epoch(self) -> int:
        return self.next_batch // self.batches_per_epoch

    def state_dict(self) -> dict:
        return {"next_batch": self.next_batch, "world_size": self.world_size, "seed": self.cfg.seed,
                "micro_batch_size": self.cfg.micro_batch_size, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        same = {k: state[k] for k in ("world_size", "micro_batch_size", "num_windows", "seed")} == {
            "world_size": self.world_size, "micro_batch_size": self.cfg.micro_batch_size,
            "num_windows": self.num_windows, "seed": self.cfg.seed}
        if same:
            self.next_batch = state["next_batch"]
            return
        if not self.cfg.reshuffle_on_resize:
            raise SystemExit(
                f"checkpoint data state (world size {state['world_size']}, micro-batch {state['micro_batch_size']}, "
                f"{state['num_windows']} windows, seed {state['seed']}) differs from this run (world size "
                f"{self.world_size}, micro-batch {self.cfg.micro_batch_size}, {self.num_windows} windows, seed "
                f"{self.cfg.seed}); pass --data.reshuffle-on-resize to continue at the next epoch")
        old_epoch = state["next_batch"] // batches_per_epoch(state["num_windows"], state["world_size"],
                                                             state["micro_batch_size"])
        self.next_batch = (old_epoch + 1) * self.batches_per_epoch

    def _loader(self) -> DataLoader:
        cfg = self.cfg
        stream = BatchStream(Path(cfg.shards), self.model, cfg, self.rank, self.world_size, self.next_batch)
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
