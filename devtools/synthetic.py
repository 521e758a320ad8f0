"""Synthetic shard directories in the real format (docs/FORMAT.md), written with the project's own writer.

Random latents / CLIP / y / state / action of the exact shapes and dtypes of a recipe (configs/<name>.yaml, section
synthetic), a text table, a metadata.json computed from the generated state/action (official statistics format) and
a manifest. As in real data, an episode's first and last windows carry a higher anchor multiplicity (3 and 2) than
the rest (1). The trainer's tests and the GPU benchmarks use it where the real `python -m preprocess shards`
(encoders on real video) would be too slow or needs weights; `python -m preprocess check` accepts the result.
scripts/make_synthetic_shards.py is its command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from wampipe import configs
from wampipe.preprocess import write
from wampipe.preprocess.finalize import mix
from wampipe.preprocess.prompts import prompt_id
from wampipe.preprocess.stats import summarize
from wampipe.shardformat.embodiments import get_embodiment
from wampipe.shardformat.files import atomic_write_json, sha256_file
from wampipe.shardformat.keys import sample_key
from wampipe.shardformat.layout import ACTION, CLIP, LATENTS, MANIFEST, STATE, STATISTICS, Y
from wampipe.shardformat.manifest import build_manifest
from wampipe.shardformat.members import encode_sample
from wampipe.shardformat.text import write_text_table


@dataclass(frozen=True)
class SampleShapes:
    """Per-sample tensor shapes of one recipe (configs/<name>.yaml, section synthetic; docs/FORMAT.md table)."""

    dataset: str
    embodiment: str
    model: str
    latents: tuple[int, ...]
    clip: tuple[int, ...]
    state: tuple[int, int]
    action: tuple[int, int]
    text_dim: int
    max_text_tokens: int
    y: tuple[int, ...] | None = None


SHAPES = {
    name: configs.build(
        SampleShapes, configs.section(configs.recipe(name), "synthetic", name), f"configs/{name}.yaml: synthetic"
    )
    for name in configs.names()
}
# Sub-key widths of the embodiments' state/action keys (the real datasets' modality.json).
SUBKEY_DIMS = {
    "libero_sim": {"state": {"state": 8}, "action": {"actions": 7}},
    "oxe_droid": {
        "state": {"joint_position": 7, "gripper_position": 1},
        "action": {"joint_position": 7, "gripper_position": 1},
    },
}


def _statistics(values: np.ndarray, dims: dict[str, int]) -> dict[str, dict[str, list[float]]]:
    out, start = {}, 0
    for key, d in dims.items():
        out[key] = summarize(values[:, start : start + d].astype(np.float64))
        start += d
    return out


def make_synthetic_shards(
    out: Path,
    preset: str = "tiny",
    episodes: int = 6,
    windows_per_episode: int = 4,
    augment_variants: int = 0,
    samples_per_shard: int = 7,
    episodes_per_unit: int = 2,
    seed: int = 0,
    compress: str = "auto",
    workers: int = 1,
) -> dict:
    """Write a complete shard directory (`workers` processes write its shards); returns its manifest."""
    if preset not in SHAPES:
        raise SystemExit(f"unknown recipe {preset!r}; choose one of {sorted(SHAPES)}")
    shapes = SHAPES[preset]
    emb = get_embodiment(shapes.embodiment)
    dims = SUBKEY_DIMS[emb.tag]
    columns = emb.annotation_columns or ("annotation.human.action.task_description",)
    out = Path(out)
    if (out / MANIFEST).exists():
        raise SystemExit(f"{out} already holds a {MANIFEST}")
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    c = shapes.latents[0]
    prompts: dict[str, str] = {}
    all_state, all_action, indexes = [], [], []
    for unit, first in enumerate(range(0, episodes, episodes_per_unit)):
        samples, unit_prompts = [], {}
        for ep in range(first, min(first + episodes_per_unit, episodes)):
            # a learnable structure: latents share an episode-level per-channel offset
            offset = torch.randn(c, 1, 1, 1, generator=gen)
            ep_prompts = {col: f"synthetic task {ep} ({col.rsplit('.', 1)[-1]}, seed {seed})" for col in columns}
            unit_prompts.update({prompt_id(p): p for p in ep_prompts.values()})
            for w in range(windows_per_episode):
                state = rng.normal(0, 1, shapes.state).astype(np.float32) + ep * 0.1
                action = rng.normal(0, 0.5, shapes.action).astype(np.float32)
                all_state.append(state)
                all_action.append(action)
                multiplicity = 3 if w == 0 else 2 if w == windows_per_episode - 1 else 1
                for variant in range(max(1, augment_variants)):
                    key = sample_key(shapes.dataset, ep, w * 8, variant)
                    tensors = {
                        LATENTS: (offset + 0.5 * torch.randn(shapes.latents, generator=gen)).to(torch.bfloat16),
                        CLIP: torch.randn(shapes.clip, generator=gen).to(torch.bfloat16),
                        STATE: state,
                        ACTION: action,
                    }
                    if shapes.y is not None:
                        y = torch.zeros(shapes.y)
                        y[:4, 0] = 1
                        y[4:] = torch.randn(shapes.y[0] - 4, *shapes.y[1:], generator=gen)
                        tensors[Y] = y.to(torch.bfloat16)
                    meta = {
                        "dataset": shapes.dataset,
                        "embodiment": emb.tag,
                        "model": shapes.model,
                        "episode": ep,
                        "window_start": w * 8,
                        "anchor_multiplicity": multiplicity,
                        "variant": variant,
                        "augmentation": {"crop": None, "jitter": None},
                        "prompt_ids": {col: prompt_id(p) for col, p in ep_prompts.items()},
                    }
                    samples.append((key, encode_sample(key, tensors, meta, compress)))
        prompts.update(unit_prompts)
        unit_episodes = list(range(first, min(first + episodes_per_unit, episodes)))
        record = {
            "episodes": unit_episodes,
            "failures": [],
            "skipped": [],
            "prompts": unit_prompts,
            "encoded": unit_episodes,
        }
        indexes.append(write.write_unit(out, unit, samples, record))

    summaries = [write.summarize_unit(out, index["unit"]) for index in indexes]
    records, sample_index, member_bytes = mix(
        out, out, summaries, samples_per_shard, seed, (), None, shapes.dataset, workers
    )

    table = {}
    for pid in sorted(prompts):
        tokens = int(rng.integers(2, shapes.max_text_tokens + 1))
        table[pid] = torch.randn(tokens, shapes.text_dim, generator=gen).to(torch.bfloat16)
    text_table = write_text_table(out, prompts, table)

    state, action = np.concatenate(all_state), np.concatenate(all_action)
    modalities = {
        "video": {},
        **{
            kind: {
                k: {"absolute": True, "rotation_type": None, "shape": [d], "continuous": True}
                for k, d in dims[kind].items()
            }
            for kind in ("state", "action")
        },
    }
    metadata = {
        emb.tag: {
            "statistics": {"state": _statistics(state, dims["state"]), "action": _statistics(action, dims["action"])},
            "modalities": modalities,
            "embodiment_tag": emb.tag,
        }
    }
    atomic_write_json(out / STATISTICS, metadata)

    manifest = build_manifest(
        summaries,
        records,
        source={
            "root": "synthetic",
            "fingerprint": f"synthetic-{preset}-seed{seed}",
            "codebase_version": None,
            "episodes": episodes,
            "fps": None,
        },
        dataset=shapes.dataset,
        embodiment=emb.tag,
        model=shapes.model,
        modality_keys={"state": list(emb.state_keys), "action": list(emb.action_keys)},
        transform={"anchor_stride": 8, "augment_variants": augment_variants, "synthetic": preset},
        encoders={},
        samples_per_shard=samples_per_shard,
        seed=seed,
        compress=compress,
        text_table=text_table,
        statistics={"file": STATISTICS, "sha256": sha256_file(out / STATISTICS)},
        sample_index=sample_index,
        member_bytes=member_bytes,
    )
    manifest.write(out)
    return manifest.to_dict()
