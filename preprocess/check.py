"""Integrity check of a shard directory: exit 0 only when everything the manifest promises holds.

Checked: manifest <-> files (no shard missing, none extra), per-shard JSON, byte counts and sha256, sample counts,
every member decodes with its recorded shape and dtype and holds finite values, keys are unique, every prompt id
resolves in the text table, the statistics file is present and matches its hash. Every problem names the shard
and the sample.
"""

from __future__ import annotations

import json
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import tyro
from tqdm import tqdm

from preprocess.members import decode_members
from preprocess.write import MANIFEST, iter_tar_samples, sha256_file


@dataclass
class Args:
    root: tyro.conf.Positional[Path]
    """Shard directory (holds manifest.json)."""
    members: bool = True
    """Decode every member of every sample (slower, thorough); --no-members checks files and hashes only."""


def _finite(value) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value.float()).all())
    return not np.issubdtype(value.dtype, np.floating) or bool(np.isfinite(value).all())


def check_text_table(root: Path, manifest: dict, problems: list[str]) -> set[str]:
    from safetensors import safe_open

    entry = manifest.get("text_table")
    if not entry:
        problems.append(f"{MANIFEST}: no text_table entry")
        return set()
    table, prompts = root / entry["file"], root / entry["prompts"]
    for path in (table, prompts):
        if not path.is_file():
            problems.append(f"{path.relative_to(root)}: missing")
            return set()
    if sha256_file(table) != entry["sha256"]:
        problems.append(f"{entry['file']}: sha256 differs from the manifest")
    ids = set(json.loads(prompts.read_text()))
    try:
        with safe_open(table, framework="pt") as f:
            stored = set(f.keys())
            for pid in sorted(stored):
                emb = f.get_tensor(pid)
                if emb.ndim != 2 or not torch.isfinite(emb.float()).all():
                    problems.append(f"{entry['file']}: prompt {pid}: embedding is not a finite [tokens, dim] matrix")
    except Exception as err:  # safetensors raises several types for damaged files
        problems.append(f"{entry['file']}: unreadable: {err}")
        return set()
    if ids != stored:
        problems.append(f"{entry['file']}: prompt ids differ from {entry['prompts']} ({len(ids ^ stored)} differ)")
    return stored


def check(root: Path, decode: bool = True) -> list[str]:
    """All problems found, as messages naming the file and sample; empty when the directory is sound."""
    problems: list[str] = []
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing (an unfinished run, or not a shard directory)"]
    manifest = json.loads(manifest_path.read_text())

    stats = manifest.get("statistics")
    if not stats or not (root / stats["file"]).is_file():
        problems.append(f"{MANIFEST}: statistics file missing")
    elif sha256_file(root / stats["file"]) != stats["sha256"]:
        problems.append(f"{stats['file']}: sha256 differs from the manifest")
    prompt_ids = check_text_table(root, manifest, problems)

    listed = {s["shard"] for s in manifest["shards"]}
    for extra in sorted({p.name for p in root.glob("shard-*.tar")} - listed):
        problems.append(f"{extra}: not listed in {MANIFEST}")
    keys: dict[str, str] = {}
    total = 0
    for entry in tqdm(manifest["shards"], desc="check", unit="shard", disable=not sys.stderr.isatty()):
        name, path = entry["shard"], root / entry["shard"]
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        side = path.with_suffix(".json")
        if not side.is_file():
            problems.append(f"{side.name}: missing")
        elif {k: v for k, v in json.loads(side.read_text()).items() if k in entry} != entry:
            problems.append(f"{side.name}: disagrees with {MANIFEST}")
        if path.stat().st_size != entry["bytes"]:
            problems.append(f"{name}: {path.stat().st_size} bytes, the manifest says {entry['bytes']}")
        if sha256_file(path) != entry["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
        count = 0
        try:
            for key, members in iter_tar_samples(path):
                count += 1
                if key in keys:
                    problems.append(f"{name}: sample {key}: key also in {keys[key]}")
                keys[key] = name
                if not decode:
                    continue
                try:
                    meta, tensors = decode_members(members)
                except Exception as err:  # members.decode_members raises ValueError; numpy/zstd their own
                    problems.append(f"{name}: sample {key}: {err}")
                    continue
                for tname, value in tensors.items():
                    if not _finite(value):
                        problems.append(f"{name}: sample {key}: {tname} holds NaN or inf")
                for column, pid in meta.get("prompt_ids", {}).items():
                    if pid not in prompt_ids:
                        problems.append(f"{name}: sample {key}: prompt id {pid} ({column}) not in the text table")
        except (tarfile.TarError, OSError, EOFError) as err:
            problems.append(f"{name}: truncated or unreadable tar after {count} samples: {err}")
        if count != entry["count"]:
            problems.append(f"{name}: {count} samples, the manifest says {entry['count']}")
        total += count
    if total != manifest["totals"]["samples"]:
        problems.append(f"{MANIFEST}: totals.samples is {manifest['totals']['samples']}, the shards hold {total}")
    return problems


def run(args: Args) -> None:
    problems = check(args.root, decode=args.members)
    if problems:
        print(f"FAILED: {len(problems)} problem(s) in {args.root}")
        for p in problems:
            print(f"  {p}")
        raise SystemExit(1)
    manifest = json.loads((args.root / MANIFEST).read_text())
    print(f"OK: {args.root}: {manifest['totals']['samples']} samples in {len(manifest['shards'])} shards")
