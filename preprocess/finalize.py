"""Finalize: mix the samples of every unit into shards, encode each unique prompt once, write the statistics and,
last, the manifest (its presence means the directory is complete).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import cast, overload

import numpy as np
import torch

from wampipe.errors import UsageError
from wampipe.preprocess import write
from wampipe.preprocess.tasks import auto_workers, run_tasks
from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.preprocess.pipeline import VAE_OF_MODEL
from wampipe.preprocess.selection import read_selection, source
from wampipe.preprocess.spec import BuildSpec
from wampipe.preprocess.validation import HELD_OUT, split_summaries
from wampipe.shardformat.embodiments import get_embodiment
from wampipe.shardformat.files import atomic_write_bytes, atomic_writer, sha256_file
from wampipe.shardformat.layout import STATISTICS, VAL_DIR
from wampipe.shardformat.manifest import ShardFormatError, build_manifest
from wampipe.shardformat.samples import member_names
from wampipe.shardformat.text import write_text_table


# Without `part` the training split's manifest; with it, one array job's shards and None.
@overload
def finalize(
    spec: BuildSpec,
    units: list[list[int]],
    workers: int = 0,
    part: None = None,
    ray_address: str | None = None,
    on_ray: bool = False,
) -> dict: ...
@overload
def finalize(
    spec: BuildSpec,
    units: list[list[int]],
    workers: int = 0,
    *,
    part: tuple[int, int],
    ray_address: str | None = None,
    on_ray: bool = False,
) -> None: ...
def finalize(
    spec: BuildSpec,
    units: list[list[int]],
    workers: int = 0,
    part: tuple[int, int] | None = None,
    ray_address: str | None = None,
    on_ray: bool = False,
) -> dict | None:
    """Shards, text table, statistics and manifest from the finished units; returns the training split's manifest.
    With held-out episodes (`spec.held_out`), their samples go into the validation split OUT/val, a sealed shard
    directory of its own (the same text table and statistics), written before the training split's manifest.
    `workers` processes (0: tasks.auto_workers) write the shards, each a task of its own
    (write.write_planned_shard), or with `on_ray` as Ray tasks of the cluster at `ray_address`. `part` (i, n): one
    job of an array writes only the shards k with k % n == i of each split and returns None; a run without it keeps
    them and writes the rest."""
    ray = {"ray_address": ray_address, "on_ray": on_ray}
    out = Path(spec.out)
    missing = [u for u in range(len(units)) if not write.unit_done(out, u)]
    if missing:
        raise UsageError(
            f"cannot finalize {out}: units {missing[:10]}{'...' if len(missing) > 10 else ''} are not done"
        )
    read: list[dict | None] = [None] * len(units)
    for u, summary in run_tasks(
        write.summarize_unit,
        [(out, u) for u in range(len(units))],
        auto_workers(workers, len(units)),
        "units read",
        **ray,
    ):
        read[u] = summary
    summaries = cast(list[dict], read)  # run_tasks gives every task's result: no None is left
    if part is not None:
        for val in (False, True)[: 1 + bool(spec.held_out)]:
            into = out / VAL_DIR if val else out
            into.mkdir(exist_ok=True)
            mix(
                out,
                into,
                summaries,
                spec.samples_per_shard,
                spec.seed,
                spec.held_out,
                {"split": "val"} if val else None,
                spec.dataset,
                workers,
                part,
                ray,
            )
        return None
    if not sum(summary["count"] for summary in summaries):  # before the text encoder loads: nothing to encode
        raise UsageError(no_samples(out, summaries))
    prompts = {pid: text for summary in summaries for pid, text in summary["prompts"].items()}
    failures = [f for summary in summaries for f in summary["failures"]]
    shared = {"text_table": encode_text_table(out, prompts, spec), "statistics": write_statistics(out, spec, failures)}
    if not spec.held_out:
        return write_split(out, summaries, spec, units, shared, workers, ray=ray)
    train, val = split_summaries(summaries, list(spec.held_out))
    held = {"choice": spec.val_episodes, "episodes": list(spec.held_out)}
    val_dir = out / VAL_DIR
    val_dir.mkdir(exist_ok=True)
    for name in (shared["text_table"]["file"], shared["text_table"]["prompts"], shared["statistics"]["file"]):
        (val_dir / name).parent.mkdir(parents=True, exist_ok=True)
        with open(out / name, "rb") as src, atomic_writer(val_dir / name) as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    write_split(val_dir, val, spec, units, shared, workers, {"split": "val", **held}, ray)
    return write_split(out, train, spec, units, shared, workers, {"split": "train", **held, "val_dir": VAL_DIR}, ray)


def no_samples(out: Path, summaries: list[dict]) -> str:
    """The one line of a build whose every episode failed or was too short: the counts by reason, the first of each."""
    failures = [f for s in summaries for f in s["failures"]]
    skipped = [s for summary in summaries for s in summary["skipped"]]
    reasons = "; ".join(
        f"{len(group)} {what}, e.g. {group[0]['reason']}"
        for what, group in (("failed", failures), ("shorter than a window", skipped))
        if group
    )
    return f"cannot finalize {out}: no episode gave a sample ({reasons or 'no episodes'})"


def write_split(
    into: Path,
    summaries: list[dict],
    spec: BuildSpec,
    units: list[list[int]],
    shared: dict,
    workers: int,
    validation: dict | None = None,
    ray: dict | None = None,
) -> dict:
    """The shards of the samples of `summaries` (the units' records of this split) in `into`, then its sample index
    and manifest (`shared`: the text table and statistics blocks, whose files lie in `into`); returns the manifest."""
    emb = get_embodiment(spec.embodiment)
    ds = LeRobotDataset(spec.src)
    stated = spec.manifest_fields()
    stated["transform"] |= {
        "view_hw": list(emb.view_size(spec.model)),
        "vae_variant": VAE_OF_MODEL[spec.model],
        "target_hw": list(emb.preset(spec.model).target_hw),
    }
    try:
        shards, sample_index, member_bytes = mix(
            Path(spec.out),
            into,
            summaries,
            spec.samples_per_shard,
            spec.seed,
            spec.held_out,
            validation,
            spec.dataset,
            workers,
            ray=ray,
        )
        manifest = build_manifest(
            summaries,
            shards,
            **stated,
            source={
                "root": spec.src,
                "fingerprint": spec.digests["src"],
                "codebase_version": ds.version,
                "episodes": sum(len(u) for u in units),
                "fps": ds.fps,
            },
            modality_keys={"state": list(emb.state_keys), "action": list(emb.action_keys)},
            validation=validation or {},
            sample_index=sample_index,
            member_bytes=member_bytes,
            **shared,
            selection={} if spec.selection is None else read_selection(spec.out, spec.selection).summary(),
        )
    except ShardFormatError as err:
        raise UsageError(f"cannot finalize {into}: {err}") from None
    manifest.write(into)
    return manifest.to_dict()


# Without `part` the shard entries and index blocks; with it, one array job's shards and None.
@overload
def mix(
    out: Path,
    into: Path,
    summaries: list[dict],
    samples_per_shard: int,
    seed: int,
    held: tuple | list,
    validation: dict | None,
    dataset: str,
    workers: int,
    part: None = None,
    ray: dict | None = None,
) -> tuple[list[dict], dict, dict]: ...
@overload
def mix(
    out: Path,
    into: Path,
    summaries: list[dict],
    samples_per_shard: int,
    seed: int,
    held: tuple | list,
    validation: dict | None,
    dataset: str,
    workers: int,
    part: tuple[int, int],
    ray: dict | None = None,
) -> None: ...
def mix(
    out: Path,
    into: Path,
    summaries: list[dict],
    samples_per_shard: int,
    seed: int,
    held: tuple | list,
    validation: dict | None,
    dataset: str,
    workers: int,
    part: tuple[int, int] | None = None,
    ray: dict | None = None,
) -> tuple[list[dict], dict, dict] | None:
    """Every sample of the units of `out` in one seeded permutation (write.plan_split), cut into shards of `into`
    written by `workers` processes, then the sample index. Returns (shard entries, sample_index block,
    member_bytes); with `part` (i, n), only the shards k with k % n == i, and None. `ray`: run_tasks' Ray
    arguments."""
    val = bool(validation) and validation.get("split") == "val"
    plan = write.plan_split(out, summaries, seed, held, val, dataset)
    schemas = [s["schema"] for s in summaries if s["count"]]
    names = member_names(schemas[0]) if schemas else []
    count = len(np.load(plan, mmap_mode="r"))
    shards = range(-(-count // samples_per_shard))
    if part is not None:
        shards = shards[part[0] :: part[1]]
    tasks = [(out, into, plan, shard, samples_per_shard, names, dataset) for shard in shards]
    written: list[dict | None] = [None] * len(tasks)
    for i, entry in run_tasks(
        write.write_planned_shard, tasks, auto_workers(workers, len(tasks)), "shards", **(ray or {})
    ):
        written[i] = entry
    if part is not None:
        return None
    entries = cast(list[dict], written)  # run_tasks gives every task's result: no None is left
    sample_index, member_bytes = write.assemble_index(out, into, plan, entries, samples_per_shard, names)
    return entries, sample_index, member_bytes


def encode_text_table(out: Path, prompts: dict[str, str], spec: BuildSpec) -> dict:
    """umT5 output per unique prompt, trimmed to its token count, written as the shard directory's text table."""
    from wampipe.encoders.text_encoder import load_text_encoder

    ids = sorted(prompts)
    dtype = getattr(torch, spec.dtype)
    encoder = load_text_encoder(spec.text_encoder, spec.tokenizer, device=spec.device, dtype=dtype)
    with torch.inference_mode():
        embeddings = encoder.encode([prompts[i] for i in ids])
    return write_text_table(out, prompts, dict(zip(ids, embeddings)))


def write_statistics(out: Path, spec: BuildSpec, failures: list[dict]) -> dict:
    """metadata.json: --metadata's copy, or computed without the episodes the units could not use, the held-out
    episodes (--val-episodes: the statistics are the training split's) and any other episode whose rows are
    unusable, each listed with its reason. Returns the manifest entry."""
    from wampipe.preprocess.stats import build_metadata, write_metadata

    path, excluded = out / STATISTICS, []
    if spec.metadata is not None:
        atomic_write_bytes(path, Path(spec.metadata).read_bytes())
    else:
        write_metadata(
            path,
            build_metadata(
                [source(spec)],
                get_embodiment(spec.embodiment),
                exclude={**{e: HELD_OUT for e in spec.held_out}, **{f["episode"]: f["reason"] for f in failures}},
                skipped=excluded,
            ),
        )
    return {"file": STATISTICS, "sha256": sha256_file(path), "excluded": excluded}
