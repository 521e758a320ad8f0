"""Write DreamZero's metadata.json (the official `experiment_cfg/metadata.json` format) for one or more LeRobot
datasets of one embodiment. Reads only; nothing is written into a source dataset.

    python -m preprocess stats --src /data/droid --embodiment oxe_droid --out metadata.json

Per state/action sub-key of the dataset's modality: max, min, mean, std, q01, q99 over every row (float32 columns,
numpy's linear quantiles, as the official `calculate_dataset_statistics`). Relative action keys get relative
statistics instead: `action[i + k] - state[i]` for k < H and every i with i + H <= L, pooled (official
`relative_stats_dreamzero.json`). Several datasets are merged as the official mixture does: weighted mean and
std (weights = rows x --weights), min of min, max of max, min of q01, max of q99. Bad episodes (NaN, a parquet of
another length than meta/ says, ...) are left out and reported, one line each.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Mapping, Sequence

import numpy as np
import tyro
from tqdm import tqdm

from wampipe.errors import UsageError
from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.shardformat.embodiments import Embodiment, get_embodiment
from wampipe.shardformat.files import atomic_write_bytes

STAT_NAMES = ("max", "min", "mean", "std", "q01", "q99")  # the official DatasetStatisticalValues field order
RELATIVE_STATS_SEED = 42  # the official code samples episodes for relative stats with default_rng(42)


@dataclass
class Args:
    src: Annotated[list[Path], tyro.conf.UseAppendAction]
    """LeRobot dataset root; repeat `--src` to merge several datasets of one embodiment."""
    embodiment: str
    """Embodiment tag: oxe_droid, libero_sim or franka_pnp."""
    out: Path
    """metadata.json to write (must lie outside every source dataset)."""
    weights: Annotated[list[float], tyro.conf.UseAppendAction] = field(default_factory=list)
    """Mixture weight per --src (default 1 each); multiplied by each dataset's row count, as the official mixture."""
    max_relative_episodes: int = 10000
    """Relative statistics use at most this many episodes, drawn with default_rng(42) as the official code; 0 = all."""


def run(args: Args) -> None:
    if not args.src:
        raise UsageError("give at least one --src dataset")
    try:
        embodiment = get_embodiment(args.embodiment)
    except KeyError as err:
        raise UsageError(f"--embodiment: {err.args[0]}") from None
    out = args.out.resolve()
    if out.is_dir():
        raise UsageError(f"--out {args.out} is a directory; give the path of the metadata.json to write")
    bad = [w for w in args.weights if not (math.isfinite(w) and w > 0)]
    if bad:
        raise UsageError(f"--weights must be positive, finite numbers (a dataset's share of the mixture), got {bad[0]}")
    if args.max_relative_episodes < 0:
        raise UsageError(f"--max-relative-episodes must be 0 (all) or more, got {args.max_relative_episodes}")
    for src in args.src:
        if out.is_relative_to(Path(src).resolve()):
            raise UsageError(f"--out {args.out} lies inside the source dataset {src}; write it elsewhere")
    if args.weights and len(args.weights) != len(args.src):
        raise UsageError(f"{len(args.weights)} --weights for {len(args.src)} --src")
    skipped: list[dict] = []
    metadata = build_metadata(args.src, embodiment, args.weights or None, args.max_relative_episodes, skipped=skipped)
    for bad in skipped:
        print(f"skipped {bad['reason']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_metadata(out, metadata)
    print(f"wrote {out} ({embodiment.tag}, {len(args.src)} dataset(s), {len(skipped)} bad episode(s) left out)")


def write_metadata(path: Path, metadata: dict) -> None:
    """Atomically, in the official layout (statistics in their field order, not sorted)."""
    atomic_write_bytes(path, (json.dumps(metadata, indent=4) + "\n").encode())


def build_metadata(
    roots: Sequence[Path | LeRobotDataset],
    embodiment: Embodiment,
    weights: list[float] | None = None,
    max_relative_episodes: int = 10000,
    exclude: Mapping[int, str] | None = None,
    skipped: list[dict] | None = None,
) -> dict:
    """{tag: {"statistics": ..., "modalities": ..., "embodiment_tag": tag}} for one or several datasets.

    Episodes in `exclude` (index -> reason, e.g. those a shard build could not use) and episodes whose rows cannot
    be used (NaN, a parquet of another length than meta/ says, ...) are left out; each is appended to `skipped`
    as {"episode", "reason"}."""
    parts = []
    for root in roots:
        skip = dict(exclude or {})
        ds = root if isinstance(root, LeRobotDataset) else LeRobotDataset(root)  # a dataset: as a build selected it
        parts.append(dataset_metadata(ds, embodiment, max_relative_episodes, skip))
        if skipped is not None:
            skipped += [{"episode": i, "reason": reason} for i, reason in sorted(skip.items())]
    if len(parts) == 1:
        return {embodiment.tag: parts[0][0]}
    rows = np.array([n for _, n in parts], dtype=np.float64)
    mix = rows * (np.asarray(weights, dtype=np.float64) if weights else 1.0)
    return {embodiment.tag: merge_metadata([m for m, _ in parts], mix, [str(getattr(r, "root", r)) for r in roots])}


# ---------------------------------------------------------------- one dataset


def dataset_metadata(
    ds: LeRobotDataset, embodiment: Embodiment, max_relative_episodes: int = 10000, skip: dict[int, str] | None = None
) -> tuple[dict, int]:
    """(metadata of one dataset, the row count it is computed from). Episodes in `skip` (index -> reason) are left
    out; episodes whose rows cannot be used are added to it with their reason."""
    skip = {} if skip is None else skip
    modality = ds.modality
    for kind, keys, entries in (
        ("state", embodiment.state_keys, modality.state),
        ("action", embodiment.action_keys, modality.action),
    ):
        missing = [k for k in keys if k not in entries]
        if missing:
            raise DatasetError(
                ds.root / "meta",
                None,
                f"{embodiment.tag} needs {kind} sub-keys {missing}; modality has {sorted(entries)}",
            )
    cameras = [c for c in embodiment.cameras if c not in modality.video]
    if cameras:
        raise DatasetError(
            ds.root / "meta", None, f"{embodiment.tag} needs cameras {cameras}; dataset has {sorted(modality.video)}"
        )

    columns = list(dict.fromkeys(e.original_key for e in [*modality.state.values(), *modality.action.values()]))
    absolute, rows = _column_statistics(ds, columns, skip)
    relative = _relative_statistics(ds, embodiment, max_relative_episodes, skip)

    statistics = {}
    for kind, entries in (("state", modality.state), ("action", modality.action)):
        statistics[kind] = {}
        for sub, e in entries.items():
            if kind == "action" and sub in relative:
                statistics[kind][sub] = relative[sub]
            else:
                statistics[kind][sub] = {s: absolute[e.original_key][s][e.start : e.end] for s in STAT_NAMES}

    modalities = {"video": {}, "state": {}, "action": {}}
    for short in modality.video:
        key = modality.video[short]
        h, w, c = ds.camera_shape(key)
        fps = ds.features[key].get("info", {}).get("video.fps", ds.fps)
        modalities["video"][short] = {"resolution": [w, h], "channels": c, "fps": float(fps)}  # [width, height]
    for kind, entries in (("state", modality.state), ("action", modality.action)):
        for sub, e in entries.items():
            modalities[kind][sub] = {
                "absolute": e.absolute,
                "rotation_type": None,
                "shape": [e.dim],
                "continuous": bool(np.issubdtype(np.dtype(e.dtype), np.floating)),
            }
    return {"statistics": statistics, "modalities": modalities, "embodiment_tag": embodiment.tag}, rows


def summarize(values: np.ndarray) -> dict[str, list[float]]:
    return {
        "max": np.max(values, axis=0).tolist(),
        "min": np.min(values, axis=0).tolist(),
        "mean": np.mean(values, axis=0).tolist(),
        "std": np.std(values, axis=0).tolist(),
        "q01": np.quantile(values, 0.01, axis=0).tolist(),
        "q99": np.quantile(values, 0.99, axis=0).tolist(),
    }


def _column_statistics(
    ds: LeRobotDataset, columns: list[str], skip: dict[int, str]
) -> tuple[dict[str, dict[str, list[float]]], int]:
    """Statistics of whole float32-cast columns over the rows of every usable episode (filled in place: no list of
    per-episode copies), and the number of those rows. Unusable episodes are added to `skip`. The arrays grow with the
    rows read (doubling), never sized by the lengths meta/ claims: a length of 4e10 there fails its episode, not the
    allocation."""
    dims = {c: int(np.prod(ds.features[c]["shape"])) for c in columns}
    data = {c: np.empty((min(ds.total_frames, 1 << 16), d), dtype=np.float32) for c, d in dims.items()}
    row = 0
    for index in tqdm(ds.episode_indices, desc=f"stats {ds.root.name}", unit="episode"):
        if index in skip:
            continue
        try:
            episode = ds.episode(index, columns, cameras=False)
            values = {c: episode.columns[c].reshape(episode.length, -1) for c in columns}
            for c, v in values.items():
                if v.shape[1] != dims[c]:
                    raise DatasetError(ds.root, index, f"column {c!r} has {v.shape[1]} dims, info.json says {dims[c]}")
        except DatasetError as err:
            skip[index] = str(err)
            continue
        for c, v in values.items():
            if row + len(v) > len(data[c]):
                grown = np.empty((max(2 * len(data[c]), row + len(v)), dims[c]), dtype=np.float32)
                grown[:row] = data[c][:row]
                data[c] = grown
            data[c][row : row + len(v)] = v
        row += episode.length
    if not row:
        raise DatasetError(ds.root, None, f"no usable episode for statistics ({len(skip)} left out)")
    return {c: summarize(filled[:row]) for c, filled in data.items()}, row


def _relative_statistics(
    ds: LeRobotDataset, embodiment: Embodiment, max_episodes: int, skip: dict[int, str]
) -> dict[str, dict[str, list[float]]]:
    keys = [k for k in embodiment.relative_action_keys if k in ds.modality.action and k in ds.modality.state]
    if not keys:
        return {}
    horizon = embodiment.window.action_horizon
    indices = np.array(ds.episode_indices)
    if 0 < max_episodes < len(indices):
        indices = indices[
            np.random.default_rng(RELATIVE_STATS_SEED).choice(len(indices), size=max_episodes, replace=False)
        ]
    entries = {k: (ds.modality.state[k], ds.modality.action[k]) for k in keys}
    columns = list(dict.fromkeys(e.original_key for pair in entries.values() for e in pair))
    pooled: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for index in tqdm(indices.tolist(), desc=f"relative stats {ds.root.name}", unit="episode"):
        if index in skip:  # drawn before skipping, so a dataset without bad episodes draws as the official code
            continue
        episode = ds.episode(index, columns, cameras=False)
        n = episode.length - horizon + 1  # reference states i = 0 .. L - H
        if n <= 0:
            continue
        for k, (state_entry, action_entry) in entries.items():
            state, action = episode.slice(state_entry), episode.slice(action_entry)
            windows = np.stack([action[i : i + horizon] for i in range(n)])  # [n, H, d]
            pooled[k].append((windows - state[:n, None, :]).reshape(n * horizon, -1))
    empty = [k for k, v in pooled.items() if not v]
    if empty:
        raise DatasetError(
            ds.root, None, f"no episode is longer than the action horizon {horizon}: no relative stats for {empty}"
        )
    return {k: summarize(np.concatenate(v)) for k, v in pooled.items()}


# ---------------------------------------------------------------- several datasets


def merge_metadata(parts: list[dict], weights: np.ndarray, names: list[str]) -> dict:
    """The official mixture merge: weighted mean/std, min of min, max of max, min of q01, max of q99."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    first = parts[0]
    for part, name in zip(parts[1:], names[1:]):
        if part["modalities"] != first["modalities"]:
            raise DatasetError(
                name, None, f"modalities differ from {names[0]}; only datasets of one layout can be merged"
            )
    statistics = {}
    for kind in ("state", "action"):
        statistics[kind] = {}
        for sub in first["statistics"][kind]:
            stats = [p["statistics"][kind][sub] for p in parts]
            means = np.array([s["mean"] for s in stats], dtype=np.float64)
            stds = np.array([s["std"] for s in stats], dtype=np.float64)
            mean = w @ means
            var = w @ (stds**2 + means**2) - mean**2
            statistics[kind][sub] = {
                "max": np.max([s["max"] for s in stats], axis=0).tolist(),
                "min": np.min([s["min"] for s in stats], axis=0).tolist(),
                "mean": mean.tolist(),
                "std": np.sqrt(np.maximum(var, 0)).tolist(),
                "q01": np.min([s["q01"] for s in stats], axis=0).tolist(),
                "q99": np.max([s["q99"] for s in stats], axis=0).tolist(),
            }
    return {"statistics": statistics, "modalities": first["modalities"], "embodiment_tag": first["embodiment_tag"]}
