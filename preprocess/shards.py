"""Build WebDataset shards from a LeRobot dataset: windows, canvas, frozen-encoder outputs, raw state/action.

    python -m preprocess shards --dataset droid --src /data/droid_lerobot --vae Wan2.2_VAE.pth \\
        --text-encoder models_t5_umt5-xxl-enc-bf16.pth --tokenizer google/umt5-xxl --image-encoder clip.pth

With no --src it writes the sample dataset and tiny checkpoints first, so it runs on a fresh machine. Work is cut
into units of whole episodes (each video decoded once); units spill their samples under OUT/work/, and the
finalize stage mixes all samples into shards of --samples-per-shard with one seeded permutation, encodes each
unique prompt once, writes the statistics and finally manifest.json. Re-running skips finished units and shards;
two runs with the same inputs give byte-identical shards. See docs/FORMAT.md for the format.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from preprocess.embodiments import Embodiment, get_embodiment
from preprocess.errors import DatasetError
from preprocess.lerobot import LeRobotDataset
from preprocess.members import encode_sample
from preprocess.prompts import prompt_id, window_prompts
from preprocess.state_action import columns_for, slice_keys, window_state_action
from preprocess.views import episode_canvas, episode_model_video, eval_params, sample_video
from preprocess.windows import episode_windows
from preprocess import write

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class DatasetPreset:
    embodiment: str
    model: str  # model recipe of the embodiment (sizes, VAE variant)
    sample_layout: str  # scripts/make_sample_dataset.py --layout used when no --src is given


DATASETS = {
    "droid": DatasetPreset("oxe_droid", "5b", "droid"),
    "libero": DatasetPreset("libero_sim", "5b", "libero"),
    "franka_pnp": DatasetPreset("franka_pnp", "5b", "libero-v3"),
}
# Which Wan VAE a model recipe uses, and whether it needs the 14B first-frame input y.
VAE_OF_MODEL = {"5b": "wan2.2", "5b-wan22": "wan2.2", "14b": "wan2.1"}


@dataclass
class Args:
    dataset: Literal["droid", "libero", "franka_pnp"] = "droid"
    """Dataset preset: picks the embodiment (oxe_droid, libero_sim, franka_pnp) and the sample layout."""
    src: Path | None = None
    """LeRobot dataset root. Default: generate the sample dataset and tiny checkpoints under build/ and use them."""
    out: Path | None = None
    """Output shard directory (default shards/<dataset>)."""
    model: str | None = None
    """Model recipe: 5b (Wan2.2 VAE, 160/176x320), 5b-wan22 (DROID 160x320) or 14b (Wan2.1 VAE 352x640, adds y).
    Default: the dataset preset's."""
    vae: Path | None = None
    """Wan VAE weights: Wan2.1_VAE.pth / Wan2.2_VAE.pth or a Diffusers vae/ folder (docs/WEIGHTS.md)."""
    text_encoder: Path | None = None
    """umT5-xxl encoder: models_t5_umt5-xxl-enc-bf16.pth or a Diffusers text_encoder/ folder."""
    tokenizer: Path | None = None
    """umT5 tokenizer folder (Diffusers tokenizer/ or google/umt5-xxl files)."""
    image_encoder: Path | None = None
    """CLIP ViT-H/14: models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth or a Diffusers image_encoder/ folder."""
    device: str = "cpu"
    """Where the encoders run: cpu or cuda (cuda:N)."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Encoder compute dtype. auto: bfloat16 on CUDA (as the reference), float32 on CPU (CPU bf16 conv3d is ~18x
    slower). Outputs are stored as bf16 either way, as the reference feeds the DiT."""
    batch_size: int = 4
    """Windows per encoder batch."""
    workers: int = 1
    """Local executor: units processed in parallel (each worker decodes, transforms and encodes its units)."""
    threads_per_worker: int | None = None
    """Torch threads per unit (default: CPU cores / workers). Float reductions depend on it, so byte-identical
    reruns need the same value; it is recorded in the manifest."""
    executor: Literal["local", "ray"] = "local"
    """local: a process pool on this machine; ray: one Ray task per unit (pip install 'wampipe[ray]')."""
    ray_address: str | None = None
    """Ray cluster address (default: start or join a local instance)."""
    unit_index: int | None = None
    """Array jobs: process only units u with u % num_units == unit_index (then run once with --stage finalize)."""
    num_units: int | None = None
    """Array jobs: how many jobs split the units."""
    stage: Literal["all", "units", "finalize"] = "all"
    """all: units then finalize; units: only spill units; finalize: mix finished units into shards + manifest."""
    episodes_per_unit: int = 8
    """Episodes per work unit (a unit is the granularity of resume and parallelism)."""
    anchor_stride: int = 1
    """Keep every n-th distinct window of an episode (1 = all)."""
    augment_variants: int = 0
    """0: the deterministic eval transform (center crop). K > 0: K randomly augmented variants per window."""
    samples_per_shard: int = 256
    """Samples per output shard (the last shard holds the rest)."""
    compress: Literal["auto", "none", "all"] = "auto"
    """Per-member zstd: auto keeps it where it saves >= 10 %."""
    seed: int = 0
    """Seed of the shard permutation and of the augmentation draws."""
    decode_backend: Literal["torchcodec", "pyav"] = "torchcodec"
    """Frame decoder."""
    max_episodes: int | None = None
    """Use only the first N episodes (quick trials)."""
    fail_fast: bool = False
    """Stop at the first bad episode instead of skipping it (skips are recorded with their reason)."""
    metadata: Path | None = None
    """Use this metadata.json (e.g. a checkpoint's experiment_cfg/metadata.json) instead of computing statistics."""


@dataclass(frozen=True)
class Job:
    """Everything a unit needs, picklable for worker processes and Ray."""

    src: str
    out: str
    dataset: str
    embodiment: str
    model: str
    vae: str
    image_encoder: str
    device: str
    dtype: str
    batch_size: int
    anchor_stride: int
    augment_variants: int
    compress: str
    seed: int
    decode_backend: str
    fail_fast: bool
    threads: int


# ---------------------------------------------------------------- one unit


def _sample_key(dataset: str, episode: int, start: int, variant: int) -> str:
    return f"{dataset}-e{episode:06d}-s{start:05d}-v{variant}"


def _variant_seed(*parts: int) -> int:
    """One augmentation draw per (seed, episode, window, variant), independent of unit cuts and workers."""
    return int.from_bytes(hashlib.sha256("-".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


class Encoders:
    """The unit-side frozen encoders (VAE, CLIP) on the job's device."""

    def __init__(self, job: Job):
        from preprocess.image_encoder import load_image_encoder
        from preprocess.vae import load_vae

        dtype = getattr(torch, job.dtype)
        self.vae = load_vae(job.vae, variant=VAE_OF_MODEL[job.model], device=job.device, dtype=dtype)
        self.clip = load_image_encoder(job.image_encoder, device=job.device, dtype=dtype)
        self.needs_y = VAE_OF_MODEL[job.model] == "wan2.1"

    def __call__(self, videos_bcthw: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"latents": self.vae.encode(videos_bcthw), "clip": self.clip.encode(videos_bcthw[:, :, 0])}
        if self.needs_y:
            out["y"] = self.vae.encode_first_frame(videos_bcthw[:, :, 0], videos_bcthw.shape[2])
        return {k: v.to(torch.bfloat16).cpu() for k, v in out.items()}


def _episode_samples(job: Job, ds: LeRobotDataset, emb: Embodiment, index: int):
    """(key, video [3,T,h,w], tensors, meta) for every window x variant of one episode; raises DatasetError."""
    state_cols = columns_for(ds.modality.state, emb.state_keys)
    action_cols = columns_for(ds.modality.action, emb.action_keys)
    episode = ds.episode(index, columns=list(dict.fromkeys(state_cols + action_cols)))
    windows = episode_windows(episode.length, emb.window, job.anchor_stride)
    if not windows:
        return
    states = slice_keys(episode, ds.modality.state, emb.state_keys)
    actions = slice_keys(episode, ds.modality.action, emb.action_keys)
    needed = np.unique(np.concatenate([w.video_rows for w in windows]))
    position = np.full(episode.length, -1, np.int64)
    position[needed] = np.arange(len(needed))
    frames = np.stack([episode.cameras[c].read(needed, backend=job.decode_backend) for c in emb.cameras])
    height, width = frames.shape[2:4]
    model_video = None
    if not job.augment_variants:  # one deterministic, per-frame transform: apply it to each frame once per episode
        params = eval_params(height, width)
        model_video = episode_model_video(episode_canvas(frames, emb, job.model, params), emb.preset(job.model).target_hw)
    for window in windows:
        state, action = window_state_action(states, actions, window, emb)
        prompts = window_prompts(episode, window.start, emb)
        rows = position[window.video_rows]
        for variant in range(max(1, job.augment_variants)):
            if model_video is not None:
                video = model_video[:, rows]
            else:
                generator = torch.Generator().manual_seed(_variant_seed(job.seed, index, window.start, variant))
                video, _, params = sample_video(list(frames[:, rows]), emb, job.model, generator=generator)
            meta = {
                "dataset": job.dataset, "embodiment": emb.tag, "episode": index, "window_start": window.start,
                "anchor_multiplicity": window.weight, "variant": variant, "augmentation": params,
                "prompt_ids": {c: prompt_id(p) for c, p in prompts.items()}, "model": job.model,
            }
            yield _sample_key(job.dataset, index, window.start, variant), video, {"state": state, "action": action}, meta, prompts


def process_unit(job: Job, unit: int, episodes: list[int]) -> dict:
    """Decode, transform and encode the unit's episodes; spill its samples. Returns the unit's JSON record."""
    torch.set_num_threads(job.threads)  # fixed: conv reductions (and so the stored bits) depend on it
    ds, emb = LeRobotDataset(job.src), get_embodiment(job.embodiment)
    encoders = Encoders(job)
    failures, skipped, prompts, done = [], [], {}, []

    def samples():
        pending = []
        for index in episodes:
            try:
                produced = list(_episode_samples(job, ds, emb, index))
            except DatasetError as err:
                if job.fail_fast:
                    raise
                failures.append({"episode": index, "reason": str(err)})
                continue
            if not produced:
                skipped.append({"episode": index, "reason": f"shorter than one window ({ds.episode_info(index).length} "
                                                           f"rows, a full window needs {emb.window.extent + 1})"})
                continue
            done.append(index)
            for item in produced:
                prompts.update({prompt_id(p): p for p in item[4].values()})
                pending.append(item)
                if len(pending) == job.batch_size:
                    yield from _encode(encoders, pending, job.compress)
                    pending = []
        if pending:
            yield from _encode(encoders, pending, job.compress)

    record = {"episodes": episodes, "failures": failures, "skipped": skipped, "prompts": prompts, "encoded": done}
    return write.write_unit(Path(job.out), unit, samples(), record)


def _encode(encoders: Encoders, pending: list, compress: str):
    with torch.inference_mode():
        outputs = encoders(torch.stack([item[1] for item in pending]))
    for i, (key, _, tensors, meta, _) in enumerate(pending):
        sample = {**tensors, **{k: v[i] for k, v in outputs.items()}}
        yield key, encode_sample(key, sample, meta, compress)


# ---------------------------------------------------------------- plan, executors, finalize


def plan_units(ds: LeRobotDataset, episodes_per_unit: int, max_episodes: int | None) -> list[list[int]]:
    """Deterministic work units: the dataset's episodes in index order, cut into groups."""
    episodes = sorted(ds.episode_indices)[:max_episodes]
    return [episodes[i : i + episodes_per_unit] for i in range(0, len(episodes), episodes_per_unit)]


def run_units(job: Job, units: list[list[int]], args: Args) -> None:
    todo = [u for u in range(len(units)) if not write.unit_done(Path(job.out), u)]
    if args.num_units is not None:
        todo = [u for u in todo if u % args.num_units == args.unit_index]
    bar = tqdm(total=len(todo), desc="units", unit="unit")
    if not todo:
        bar.close()
        return
    start, samples = time.perf_counter(), 0

    def progress(record: dict) -> None:
        nonlocal samples
        samples += record["count"]
        bar.update(1)
        bar.set_postfix(samples=samples, per_s=f"{samples / (time.perf_counter() - start):.2f}")

    if args.executor == "ray":
        import ray

        ray.init(address=args.ray_address, ignore_reinit_error=True, log_to_driver=False)
        gpus = 1 if job.device.startswith("cuda") else 0
        task = ray.remote(num_gpus=gpus, num_cpus=job.threads)(process_unit)
        refs = [task.remote(job, u, units[u]) for u in todo]
        while refs:
            ready, refs = ray.wait(refs, num_returns=1)
            progress(ray.get(ready[0]))
    elif args.workers <= 1:
        for u in todo:
            progress(process_unit(job, u, units[u]))
    else:
        with ProcessPoolExecutor(args.workers, mp_context=_spawn()) as pool:
            futures = [pool.submit(process_unit, job, u, units[u]) for u in todo]
            for future in as_completed(futures):
                progress(future.result())
    bar.close()


def _spawn():
    import multiprocessing

    return multiprocessing.get_context("spawn")  # torch and decoders are not fork-safe


def fingerprint(root: Path) -> str:
    """Hash of the source's metadata files plus the names and sizes of all its data and video files."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        digest.update(f"{rel}\0{path.stat().st_size}\0".encode())
        if rel.startswith("meta/"):
            digest.update(path.read_bytes())
    return digest.hexdigest()


def weights_identity(path: Path) -> dict:
    """Path and sha256 of a weight file, or of a folder (hash over its files' names and hashes)."""
    if path.is_file():
        return {"path": str(path), "sha256": write.sha256_file(path)}
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{f.relative_to(path).as_posix()}\0{write.sha256_file(f)}\0".encode())
    return {"path": str(path), "sha256": digest.hexdigest()}


def encode_text_table(out: Path, prompts: dict[str, str], args: Args) -> dict:
    """umT5 output per unique prompt, trimmed to its token count, written as the shard directory's text table."""
    from preprocess.text_encoder import load_text_encoder

    ids = sorted(prompts)
    encoder = load_text_encoder(args.text_encoder, args.tokenizer, device=args.device, dtype=getattr(torch, args.dtype))
    with torch.inference_mode():
        embeddings = encoder.encode([prompts[i] for i in ids])
    return write.write_text_table(out, prompts, dict(zip(ids, embeddings)))


def finalize(job: Job, units: list[list[int]], args: Args) -> dict:
    out = Path(job.out)
    missing = [u for u in range(len(units)) if not write.unit_done(out, u)]
    if missing:
        raise SystemExit(f"cannot finalize {out}: units {missing[:10]}{'...' if len(missing) > 10 else ''} are not done")
    indexes = [json.loads(write.unit_paths(out, u)[1].read_text()) for u in range(len(units))]
    plan = write.plan_shards(indexes, args.samples_per_shard, args.seed)
    records = []
    for shard, refs in enumerate(tqdm(plan, desc="shards", unit="shard")):
        done = write.shard_done(out, shard)
        if done is None or done["keys"] != [r.key for r in refs]:
            done = write.write_shard(out, shard, refs)
        records.append({k: done[k] for k in ("shard", "count", "bytes", "sha256")})
    for stale in sorted(out.glob("shard-*.tar"))[len(plan):]:  # a previous run with other settings
        stale.unlink()
        stale.with_suffix(".json").unlink(missing_ok=True)

    prompts = {pid: text for idx in indexes for pid, text in idx["prompts"].items()}
    text_table = encode_text_table(out, prompts, args)
    stats_path = out / "metadata.json"
    if args.metadata is not None:
        write.atomic_write_bytes(stats_path, args.metadata.read_bytes())
    else:
        from preprocess.stats import build_metadata

        write.atomic_write_json(stats_path, build_metadata([Path(job.src)], get_embodiment(job.embodiment)))

    failures = [f for idx in indexes for f in idx["failures"]]
    skipped = [s for idx in indexes for s in idx["skipped"]]
    member_bytes: dict[str, dict] = {}
    for idx in indexes:
        for members in idx["index"].values():
            for name, _, size in members:
                kind = name.split(".", 1)[1]
                entry = member_bytes.setdefault(kind, {"count": 0, "bytes": 0})
                entry["count"] += 1
                entry["bytes"] += size
    ds = LeRobotDataset(job.src)
    manifest = {
        "format": "wampipe-shards/1",
        "source": {"root": job.src, "fingerprint": fingerprint(Path(job.src)), "codebase_version": ds.version,
                   "episodes": sum(len(u) for u in units), "fps": ds.fps},
        "dataset": job.dataset, "embodiment": job.embodiment, "model": job.model,
        "transform": {"anchor_stride": job.anchor_stride, "augment_variants": job.augment_variants,
                      "view_hw": list(get_embodiment(job.embodiment).view_size(job.model)),
                      "target_hw": list(get_embodiment(job.embodiment).preset(job.model).target_hw),
                      "vae_variant": VAE_OF_MODEL[job.model], "decode_backend": job.decode_backend,
                      "threads_per_worker": job.threads},
        "encoders": {"vae": weights_identity(Path(job.vae)), "image_encoder": weights_identity(Path(job.image_encoder)),
                     "text_encoder": weights_identity(Path(args.text_encoder)),
                     "tokenizer": weights_identity(Path(args.tokenizer)), "dtype": job.dtype},
        "samples_per_shard": args.samples_per_shard, "seed": args.seed, "compress": job.compress,
        "shards": records,
        "text_table": text_table,
        "statistics": {"file": "metadata.json", "sha256": write.sha256_file(stats_path)},
        "member_bytes": member_bytes,
        "failures": failures, "skipped": skipped,
        "totals": {"samples": sum(r["count"] for r in records), "bytes": sum(r["bytes"] for r in records),
                   "shards": len(records), "episodes_encoded": sum(len(i["encoded"]) for i in indexes),
                   "episodes_failed": len(failures), "episodes_skipped": len(skipped)},
    }
    write.atomic_write_json(out / write.MANIFEST, manifest)
    return manifest


def prepare_defaults(args: Args) -> Args:
    """No --src: write the sample dataset and tiny checkpoints under build/ (once) and point the run at them."""
    preset = DATASETS[args.dataset]
    if args.out is None:
        args.out = ROOT / "shards" / args.dataset
    if args.model is None:
        args.model = preset.model
    if args.src is None:
        build = ROOT / "build"
        args.src = build / "sample" / preset.sample_layout
        if not (args.src / "meta" / "info.json").is_file():
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_sample_dataset.py"), "--layout",
                            preset.sample_layout, "--out", str(args.src), "--episodes", "6", "--seed", "0"], check=True)
        tiny = build / "tiny_checkpoints"
        if not (tiny / "DONE").is_file():
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_checkpoints.py"), "--out", str(tiny)],
                           check=True)
            (tiny / "DONE").write_text("")
        for name, default in tiny_checkpoint_paths(tiny, VAE_OF_MODEL[args.model]).items():
            if getattr(args, name) is None:
                setattr(args, name, default)
    missing = [f"--{n.replace('_', '-')}" for n in ("vae", "text_encoder", "tokenizer", "image_encoder") if getattr(args, n) is None]
    if missing:
        raise SystemExit(f"with --src, also give the encoder weights: {' '.join(missing)} (see docs/WEIGHTS.md)")
    return args


def tiny_checkpoint_paths(tiny: Path, vae_variant: str) -> dict[str, Path]:
    """Where scripts/make_tiny_checkpoints.py puts each encoder (original-format files)."""
    return {
        "vae": tiny / vae_variant / ("Wan2.2_VAE.pth" if vae_variant == "wan2.2" else "Wan2.1_VAE.pth"),
        "text_encoder": tiny / "umt5" / "models_t5_umt5-xxl-enc-bf16.pth",
        "tokenizer": tiny / "umt5" / "tokenizer",
        "image_encoder": tiny / "clip" / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth",
    }


def run(args: Args) -> None:
    args = prepare_defaults(args)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if (args.unit_index is None) != (args.num_units is None):
        raise SystemExit("--unit-index and --num-units go together")
    if args.num_units is not None and not 0 <= args.unit_index < args.num_units:
        raise SystemExit(f"--unit-index must be in [0, {args.num_units})")
    preset = DATASETS[args.dataset]
    emb = get_embodiment(preset.embodiment)
    emb.preset(args.model)  # a clear error for a recipe the embodiment does not define
    ds = LeRobotDataset(args.src)
    units = plan_units(ds, args.episodes_per_unit, args.max_episodes)
    args.out.mkdir(parents=True, exist_ok=True)
    job = Job(str(args.src), str(args.out), args.dataset, emb.tag, args.model, str(args.vae), str(args.image_encoder),
              args.device, args.dtype, args.batch_size, args.anchor_stride, args.augment_variants, args.compress,
              args.seed, args.decode_backend, args.fail_fast,
              args.threads_per_worker or max(1, (os.cpu_count() or 1) // max(1, args.workers)))
    print(f"{args.src}: {len(ds)} episodes -> {len(units)} units -> {args.out}")
    if args.stage in ("all", "units"):
        run_units(job, units, args)
    if args.stage == "units" or (args.num_units is not None and args.stage != "finalize"):
        print("units done; run again with --stage finalize once every unit is finished")
        return
    manifest = finalize(job, units, args)
    t = manifest["totals"]
    print(f"done: {t['samples']} samples in {t['shards']} shards ({t['bytes'] / 2**20:.1f} MiB); episodes: "
          f"{t['episodes_encoded']} encoded, {t['episodes_skipped']} shorter than a window, {t['episodes_failed']} failed")
    for failure in manifest["failures"]:
        print(f"  FAILED episode {failure['episode']}: {failure['reason']}")
