"""Build WebDataset shards from a LeRobot dataset: windows, canvas, frozen-encoder outputs, raw state/action.

    python -m preprocess shards --config droid-5b --src /data/droid_lerobot --vae Wan2.2_VAE.pth \\
        --text-encoder models_t5_umt5-xxl-enc-bf16.pth --tokenizer google/umt5-xxl --image-encoder clip.pth

--config takes a recipe of configs/ (the trainer's --preset of the same name trains on the result) or a YAML file
of that layout; its preprocess section overrides the dataset preset's defaults and flags override it in turn.

--src and the four encoder flags are required (`make demo-data` writes a sample dataset and tiny checkpoints to try
it on; `make shards` with no SRC uses them). Work is cut into units of whole episodes (each video decoded once,
preprocess.pipeline); units run here, in a process pool or on Ray (preprocess.executors) and spill their samples
under OUT/work/; the finalize stage (preprocess.finalize) mixes all samples into shards of --samples-per-shard with
one seeded permutation, encodes each unique prompt once, writes the statistics and finally manifest.json.
Re-running skips finished units and shards; two runs with the same inputs give byte-identical shards. The flags that
decide the output bytes become one build spec (preprocess.spec), which every stage reads and which names the build's
inputs. One run holds OUT at a time, and a run with other inputs than those OUT was built from refuses to start
(preprocess.outdir). Bad arguments and unusable weights stop the run before any decoding. See docs/FORMAT.md for the
format.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from tqdm import tqdm

from wampipe.errors import UsageError
from wampipe import configs
from wampipe.configs.cli import check_at_least
from wampipe.preprocess import outdir, remote, write
from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.preprocess.selection import Filters, Selection, key_fields, parse_ids, select, show_ids, write_selection
from wampipe.preprocess.spec import ENCODERS, VAE_OF_MODEL, BuildSpec
from wampipe.preprocess.validation import HELD_OUT, canonical, held_out, parse as parse_held_out
from wampipe.shardformat.embodiments import get_embodiment
from wampipe.shardformat.files import sha256_file
from wampipe.shardformat.layout import VAL_DIR


@dataclass(frozen=True)
class DatasetPreset:
    embodiment: str  # tag of the embodiment schema (shardformat/embodiments)
    model: str  # size preset of the embodiment (canvas, VAE variant) when neither --model nor --config gives one
    sample_layout: str  # scripts/make_sample_dataset.py --layout of its sample data (make demo-data)
    # what --official-filters sets: the official selection of the dataset's raw form (fields of Args)
    official_filters: dict = field(default_factory=dict)


DATASETS = {
    name: configs.build(DatasetPreset, preset, f"configs/datasets.yaml: {name}")
    for name, preset in configs.read(configs.DATASETS_FILE).items()
}
if TYPE_CHECKING:  # the names are read from configs/datasets.yaml at import: a checker sees strings
    DatasetName = str
else:
    DatasetName = Literal[tuple(DATASETS)]  # type: ignore[valid-type]
# --batch-size's default. On a GPU, per VAE: the padded shape whose compiled latents are measured against eager's and
# float32 (docs/PERFORMANCE.md). The 5B's Wan2.2 encoder runs 32 at the same error as eager and keeps the GPU busier
# between batches; the 14B's Wan2.1 one keeps 16, the shape measured for it, where its clips/s have levelled off.
# On CPU a batch's clips run one after another anyway, and a small batch keeps a worker's memory low.
GPU_BATCH_SIZE = {"wan2.2": 32, "wan2.1": 16}
CPU_BATCH_SIZE = 4
# Arguments with a lower bound (None, where allowed, means "not given").
AT_LEAST = {
    "batch_size": 1,
    "workers": 0,
    "finalize_workers": 0,
    "threads_per_worker": 1,
    "num_units": 1,
    "unit_index": 0,
    "episodes_per_unit": 1,
    "anchor_stride": 1,
    "augment_variants": 0,
    "samples_per_shard": 1,
    "seed": 0,
    "max_episodes": 1,
    "min_length": 1,
}


@dataclass
class Args:
    config: str | None = None
    """Recipe name (configs/: tiny, libero-5b, droid-5b, droid-14b) or YAML file whose preprocess section sets the
    defaults of the flags below; given flags override it."""
    dataset: DatasetName = "droid"
    """Dataset preset (configs/datasets.yaml): picks the embodiment (oxe_droid, libero_sim, franka_pnp), its default
    --model and the sample layout."""
    src: Path | None = None
    """LeRobot dataset root (required; sample data to try it on: make demo-data)."""
    out: str | None = None
    """Output shard directory (default shards/<dataset> in the current directory), or a URL (s3://bucket/prefix):
    built in --staging-dir, then uploaded, manifest.json last (docs/FORMAT.md, Object storage)."""
    staging_dir: Path | None = None
    """With a URL --out: the local folder the build is made in and resumed from (default: one named after the URL
    in this user's private folder of the system temporary directory, wampipe-staging-<uid>)."""
    model: str | None = None
    """Size preset of the embodiment: 5b (Wan2.2 VAE, 160/176x320), 5b-wan22 (DROID 160x320) or 14b (Wan2.1 VAE
    352x640, adds y). Default: --config's, else the dataset preset's."""
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
    batch_size: int | None = None
    """Windows per encoder batch; with --vae-compile every call is padded to it. Default: on a GPU 32 for the 5B's
    VAE and 16 for the 14B's, on CPU 4. A build records it: resume one with the batch size it was begun with (its
    inputs.json)."""
    workers: int = 0
    """CPU workers: each decodes, windows and transforms whole units (and with --executor local also encodes them).
    0 = auto: with stream, every core but three per GPU encoder (one per CPU encoder); with local, 1."""
    finalize_workers: int = 0
    """Processes writing the output shards at finalize (each shard a task of its own; the bytes never depend on it).
    0 = auto: one per 32 shards, at most every core and 8 (the copies are bound by the disk). With --executor ray
    the shards are Ray tasks of the cluster, twice this many in flight."""
    threads_per_worker: int | None = None
    """Torch threads per unit (default: CPU cores / workers). Float reductions depend on it, so byte-identical
    reruns need the same value; it is recorded with the build's inputs."""
    executor: Literal["auto", "stream", "local", "ray"] = "auto"
    """stream: --workers CPU processes decode, window and transform while one process per device (every local GPU
    with --device cuda) holds the encoders for the whole run; local: a process pool whose workers each decode and
    encode their units; ray: the stream's stages on a Ray cluster, CPU tasks per unit feeding one encoder actor per
    GPU (pip install 'wampipe[ray]'). The same bytes either way. auto: stream with --device cuda, local on CPU
    (where the encoders, not decoding, bound the run, so they get every core)."""
    ray_address: str | None = None
    """Ray cluster address (default: start or join a local instance)."""
    unit_index: int | None = None
    """Array jobs: process only units u with u % num_units == unit_index (then run once with --stage finalize);
    with --stage finalize, write only the shards k with k % num_units == unit_index (then run --stage finalize once
    more without it for the sample index and the manifest)."""
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
    image_features: Literal["encoded", "pixels"] = "encoded"
    """Frame 0 for the DiT's image branch: encoded stores CLIP's features ([257, 1280] bf16, the `clip` member);
    pixels stores the preprocessed 224x224 input of the CLIP tower instead ([3, 224, 224] in --dtype, the
    `clip_pixels` member; CLIP does not run here) and the trainer runs CLIP (--model.image-encoder): fewer bytes per
    sample, the same features (docs/FORMAT.md)."""
    vae_compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the VAE encoder and, on a GPU, replay it as a CUDA graph: 1.9x the eager VAE's clips/s on an
    H200 for the 5B, 1.34x for the 14B (docs/PERFORMANCE.md), a minute or two of compiling per encoder process on a
    cold --compile-cache. The 14B's VAE gives eager's bits; the 5B's latents, whose norms are fused, err from a
    float32 encoder within the range the eager encoder's own batch sizes give. Within a build, a clip's bits depend
    neither on its batch nor on the executor. auto: on with --device cuda, off on CPU
    (where compiling costs more than it saves on short runs); off: the eager encoder."""
    compile_cache: Path | None = None
    """With the compiled VAE: where the compiler keeps what it built between runs, so a later run's encoders start in
    seconds instead of compiling for a minute or two. Default: $TORCHINDUCTOR_CACHE_DIR if set, else
    ~/.cache/wampipe/compile ($XDG_CACHE_HOME honoured), which a cluster's shared home carries to every node. Made
    readable by you only: the cache holds code the encoder processes load."""
    decode_backend: Literal["torchcodec", "pyav"] = "torchcodec"
    """Frame decoder."""
    max_episodes: int | None = None
    """Use only the first N episodes of the dataset (quick trials); the filters below then apply to those."""
    keep_ranges: Path | None = None
    """Keep only these rows of each episode: a JSON object from episode key to a list of [start, end) row ranges
    (openpi's droid_sample_ranges_v1_0_1.json for DROID's non-idle frames). A kept episode is cut to its ranges,
    concatenated in order, and windows are cut from the shortened episode, as DreamZero's DROID conversion does;
    an episode the file does not list, or lists with no range, is left out."""
    keep_ranges_key: str = "{episode_index}"
    """An episode's key in --keep-ranges: a format string over episode_index and the fields of its meta/episodes
    row or, failing that, its parquet columns at the first row (DROID: {recording_folderpath}--{file_path})."""
    drop_failed: bool = False
    """Leave out failed episodes: those whose --reward-field is zero at every row (a per-row reward column, as
    DreamZero's --filter-failed) or false (a per-episode success field of meta/episodes)."""
    reward_field: str = "next.reward"
    """The reward column (or per-episode success field) --drop-failed reads."""
    require_language: Literal["official", "any", "off"] = "off"
    """official: keep an episode only if one of its instructions (each annotation column at the first row) is
    longer than one character and new, seen in no earlier episode of the dataset, kept or not (DreamZero's DROID
    rule: an instruction counts once); any: keep it if it has an instruction other than "not provided"; off: all."""
    episodes: str | None = None
    """Use only these episodes: a comma list of ids and ranges (3,10-19) or a file of ids (separated by commas,
    spaces or newlines; # starts a comment)."""
    exclude_episodes: str | None = None
    """Leave these episodes out (the form of --episodes)."""
    min_length: int | None = None
    """Leave out episodes with fewer rows than this (after --keep-ranges)."""
    official_filters: bool = False
    """DreamZero's selection of raw DROID, the dataset preset's (configs/datasets.yaml; droid: --drop-failed,
    --require-language official, DROID's --keep-ranges-key); give --keep-ranges with openpi's file too. Flags
    given beside it override it. Not for DreamZero's converted DROID, which is already filtered."""
    fail_fast: bool = False
    """Stop at the first bad episode instead of skipping it (skips are recorded with their reason)."""
    metadata: Path | None = None
    """Use this metadata.json (e.g. a checkpoint's experiment_cfg/metadata.json) instead of computing statistics."""
    val_episodes: str | None = None
    """Hold whole episodes out of training, into the validation split OUT/val (a shard directory of its own; the
    trainer's validation loss reads it): a fraction in (0, 1) (each episode whose hash of dataset and episode id falls
    below it, whatever the order, executor or workers) or a comma list of episode ids. Statistics come from the
    training episodes only. Default: none."""
    overwrite: bool = False
    """When OUT holds a build made from other inputs, delete it (its units only where they differ) instead of
    refusing to start."""


def defaults(argv: list[str]) -> Args:
    """The defaults the flags of `argv` override: --config's preprocess section, if any."""
    name_or_file = configs.flag_value(argv, "--config")
    args = Args()
    if name_or_file is not None:
        path = configs.path_of(name_or_file)
        values = configs.section(configs.read(path), "preprocess", path)
        if not values:
            raise UsageError(f"{path}: no preprocess section")
        args = configs.apply(Args(config=name_or_file), values, f"{path}: preprocess")
    if args.official_filters or "--official-filters" in argv:  # the preset's choice, below the given flags
        dataset = configs.flag_value(argv, "--dataset") or args.dataset
        chosen = DATASETS[dataset].official_filters if dataset in DATASETS else {}
        if not chosen:
            raise UsageError(
                f"--official-filters: the {dataset} dataset preset names no official filters "
                f"(configs/datasets.yaml); give the filter flags themselves"
            )
        args = configs.apply(args, {**chosen, "official_filters": True}, f"configs/datasets.yaml: {dataset}")
    return args


def prepare_defaults(args: Args) -> Args:
    """Fill --out and --model from the dataset preset and the device's auto settings; refuse a run without --src or
    an encoder."""
    preset = DATASETS[args.dataset]
    if args.src is None:
        raise UsageError(
            "--src is required: the LeRobot dataset root (sample data and tiny encoders to try it on: "
            "make demo-data, or scripts/make_sample_dataset.py and scripts/make_tiny_checkpoints.py)"
        )
    if args.out is None:
        args.out = str(Path("shards") / args.dataset)  # beside the user, never inside an installed package
    model = args.model = preset.model if args.model is None else args.model
    cuda = args.device.startswith("cuda")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cuda else "float32"
    if args.vae_compile == "auto":
        args.vae_compile = "on" if cuda else "off"
    if args.batch_size is None:
        args.batch_size = GPU_BATCH_SIZE[VAE_OF_MODEL[model]] if cuda else CPU_BATCH_SIZE
    if args.executor == "auto":
        args.executor = "stream" if cuda else "local"
    if args.compile_cache is None:
        args.compile_cache = Path(
            os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "wampipe" / "compile"
        )
    missing = [f"--{n.replace('_', '-')}" for n in ENCODERS if getattr(args, n) is None]
    if missing:
        raise UsageError(f"also give the encoder weights: {' '.join(missing)} (see docs/WEIGHTS.md)")
    return args


def plan_units(episodes: list[int], episodes_per_unit: int) -> list[list[int]]:
    """Deterministic work units: the build's episodes in index order, cut into groups."""
    episodes = sorted(episodes)
    return [episodes[i : i + episodes_per_unit] for i in range(0, len(episodes), episodes_per_unit)]


def filters_of(args: Args) -> Filters:
    """The selection flags of checked `args` (check_arguments wrote the episode lists in their recorded form)."""
    return Filters(
        None if args.keep_ranges is None else str(args.keep_ranges),
        args.keep_ranges_key,
        args.drop_failed,
        args.reward_field,
        args.require_language,
        None if args.episodes is None else parse_ids(args.episodes, "--episodes"),
        () if args.exclude_episodes is None else parse_ids(args.exclude_episodes, "--exclude-episodes"),
        args.min_length,
    )


def choose_episodes(args: Args, ds: LeRobotDataset) -> tuple[list[int], LeRobotDataset, Selection | None]:
    """The build's episodes, the dataset as the build sees them and the selection that narrowed it (None without
    filters): the first --max-episodes of its episodes, then the filters."""
    considered = sorted(ds.episode_indices)[: args.max_episodes]
    filters = filters_of(args)
    if not filters.active:
        return considered, ds, None
    digest = None if args.keep_ranges is None else sha256_file(args.keep_ranges)
    chosen = select(ds, filters, considered, args.finalize_workers, {"keep_ranges": digest})
    counts = chosen.counts["episodes"]
    dropped = ", ".join(f"{n} {reason}" for reason, n in counts["dropped"].items())
    frames = chosen.counts["frames"]
    print(
        f"selection: {counts['kept']} of {counts['in']} episodes kept{f' (left out: {dropped})' if dropped else ''}"
        f", {frames['kept']} of {frames['in']} frames",
        flush=True,
    )
    for index, error in list(chosen.errors.items())[:10]:
        print(f"  UNREADABLE episode {index}: {error}")
    if not chosen.kept:
        raise UsageError(f"{args.src}: the filters keep no episode ({dropped})")
    return list(chosen.kept), LeRobotDataset(ds.root, chosen.kept), chosen


# ---------------------------------------------------------------- checks before any work


def check_arguments(args: Args) -> None:
    check_at_least(*((f"--{name.replace('_', '-')}", getattr(args, name), least) for name, least in AT_LEAST.items()))
    if (args.unit_index is None) != (args.num_units is None):
        raise UsageError("--unit-index and --num-units go together")
    if args.num_units is not None and args.unit_index is not None and args.unit_index >= args.num_units:
        raise UsageError(f"--unit-index must be in [0, {args.num_units})")
    if args.num_units is not None and args.overwrite:
        raise UsageError("--overwrite cannot be used by array jobs (they share OUT); run it once without --unit-index")
    if args.val_episodes is not None:
        args.val_episodes = canonical(args.val_episodes)
    for flag in ("episodes", "exclude_episodes"):  # recorded in one spelling: 3,4,5 and 3-5 are one input
        if getattr(args, flag) is not None:
            setattr(args, flag, show_ids(parse_ids(getattr(args, flag), f"--{flag.replace('_', '-')}")))
    if args.official_filters and args.keep_ranges is None:
        raise UsageError(
            "--official-filters: also give --keep-ranges, the non-idle ranges of the dataset's "
            "episodes (DROID: openpi's droid_sample_ranges_v1_0_1.json)"
        )
    if args.keep_ranges is not None:
        key_fields(args.keep_ranges_key)  # a malformed key stops the run here
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.device.startswith("cuda"):
        from wampipe.preprocess.stream import encoder_devices  # here: `--help` does without torch

        encoder_devices(args.device)  # the GPUs it names are visible


def check_held_out_windows(choice: str | None, held: tuple[int, ...], ds: LeRobotDataset, need: int) -> None:
    """A validation split must hold windows: every episode --val-episodes names, or at least one of a fraction's,
    is long enough for one (by meta/'s lengths, before any unit)."""
    lengths = {e: ds.length(e) for e in held}
    short = [(e, n) for e, n in lengths.items() if n < need]
    if choice is None or not short or (isinstance(parse_held_out(choice), float) and len(short) < len(held)):
        return
    shown = ", ".join(f"{e} ({n} rows)" for e, n in short[:5]) + (
        f" and {len(short) - 5} more" if len(short) > 5 else ""
    )
    raise UsageError(
        f"--val-episodes {choice}: episodes {shown} give no window (a window needs {need} rows); "
        f"hold out longer episodes"
    )


def check_metadata(path: Path, emb, ds: LeRobotDataset) -> None:
    """--metadata's statistics, before any unit: the embodiment's tag, and for every state and action sub-key its q01
    and q99, finite and as wide as the dataset's modality.json makes that sub-key (what the trainer will check)."""
    from wampipe.shardformat.stats import stat_vector  # here: it loads torch, which `--help` does without

    try:
        statistics = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"--metadata {path}: unreadable ({err})") from None
    if not isinstance(statistics, dict) or emb.tag not in statistics:
        held = sorted(statistics) if isinstance(statistics, dict) else type(statistics).__name__
        raise UsageError(f"--metadata {path}: no statistics for {emb.tag} (it holds {held})")
    for modality, keys, entries in (
        ("state", emb.state_keys, ds.modality.state),
        ("action", emb.action_keys, ds.modality.action),
    ):
        for key in keys:
            width = entries[key].end - entries[key].start if key in entries else None
            for stat in ("q01", "q99"):
                try:
                    values = stat_vector(statistics[emb.tag]["statistics"], modality, [key], stat)
                except (KeyError, TypeError, ValueError) as err:
                    reason = err.args[0] if isinstance(err, KeyError) and err.args else err  # KeyError quotes itself
                    raise UsageError(
                        f"--metadata {path}: {emb.tag}: {modality}.{key}.{stat} unusable ({reason})"
                    ) from None
                if (width is not None and values.size != width) or not np.isfinite(values).all():
                    raise UsageError(
                        f"--metadata {path}: {emb.tag}: {modality}.{key}.{stat} has {values.size} "
                        f"values{'' if np.isfinite(values).all() else ' (not all finite)'}, the "
                        f"dataset's {key} is {width} wide"
                    )


def check_weights(args: Args) -> None:
    """Load every encoder on the meta device: each file is read and checked key by key as for real, but no weight is
    materialized, so a missing or wrong file stops the run before any decoding (WeightsError)."""
    import torch  # here and below, not at the top: `--help` without loading torch

    from wampipe.encoders.image_encoder import load_image_encoder
    from wampipe.encoders.text_encoder import load_text_encoder
    from wampipe.encoders.vae import load_vae

    # prepare_defaults refused a run without these and filled --model
    assert args.vae is not None and args.image_encoder is not None and args.model is not None
    assert args.text_encoder is not None and args.tokenizer is not None
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
        load_vae(args.vae, variant=VAE_OF_MODEL[args.model], device="meta")
        load_image_encoder(args.image_encoder, device="meta")
        load_text_encoder(args.text_encoder, args.tokenizer, device="meta")


# ---------------------------------------------------------------- the run


# A GPU encoder process keeps three cores busy: the thread launching the encoders, the one preparing the next batch
# and, with the compiled VAE, the compiler at start. With one core each, 62 workers on 64 cores with 4 GPUs starved
# them: ready after 148 s instead of 60 s, steady 0.43 of the compiled bound instead of 0.66 with 50 workers.
CORES_PER_GPU_ENCODER = 3


def default_workers(args: Args) -> int:
    """--workers 0: the stream leaves cores to each encoder process and gives the rest to decoding."""
    if args.executor != "stream":
        return 1
    from wampipe.preprocess.stream import encoder_devices

    devices = encoder_devices(args.device)
    reserved = sum(CORES_PER_GPU_ENCODER if d.startswith("cuda") else 1 for d in devices)
    return max(1, (os.cpu_count() or 1) - reserved)


def build_units(spec: BuildSpec, units: list[list[int]], args: Args) -> None:
    from wampipe.preprocess.executors import run_units

    todo = {
        u: units[u]
        for u in range(len(units))
        if not write.unit_done(Path(spec.out), u) and (args.num_units is None or u % args.num_units == args.unit_index)
    }
    assert args.executor != "auto"  # prepare_defaults chose it
    bar = tqdm(total=len(todo), desc="units", unit="unit")
    start, samples = time.perf_counter(), 0
    try:
        for record in run_units(spec, todo, args.executor, args.workers, args.ray_address):
            samples += record["count"]
            bar.update(1)
            bar.set_postfix(samples=samples, per_s=f"{samples / (time.perf_counter() - start):.2f}")
    finally:
        bar.close()  # before an error's one line, so that line is the last one printed


def run(args: Args) -> None:
    from wampipe.preprocess.finalize import finalize

    check_arguments(args)
    args = prepare_defaults(args)
    # prepare_defaults refused a run without --src and filled --out and --model
    assert args.src is not None and args.out is not None and args.model is not None
    url = remote.remote_url(str(args.out))
    out = remote.staging_dir(url, args.staging_dir) if url else Path(args.out)
    args.out = str(out)  # the spec records the folder the build is made in, as a string
    if url:
        remote.check_access(url)  # a missing bucket or wrong credentials stop the run before any unit
    emb = get_embodiment(DATASETS[args.dataset].embodiment)
    emb.preset(args.model)  # a clear error for a recipe the embodiment does not define
    checking = time.perf_counter()
    if args.stage != "finalize":  # finalize encodes nothing: the spec's hashes still tie it to the same weights
        check_weights(args)
    checked = time.perf_counter() - checking
    ds = LeRobotDataset(args.src)
    if args.metadata is not None:
        check_metadata(args.metadata, emb, ds)
    episodes, ds, chosen = choose_episodes(args, ds)
    units = plan_units(episodes, args.episodes_per_unit)
    held = (
        ()
        if args.val_episodes is None
        else tuple(held_out(args.val_episodes, args.dataset, [e for unit in units for e in unit], args.src))
    )
    check_held_out_windows(args.val_episodes, held, ds, emb.window.extent + 1)
    array_job = args.num_units is not None  # one of several jobs sharing OUT: its units, or at finalize its shards
    out.mkdir(parents=True, exist_ok=True)
    with outdir.hold(out, shared=array_job):
        args.workers = args.workers or default_workers(args)
        args.threads_per_worker = args.threads_per_worker or max(1, (os.cpu_count() or 1) // args.workers)
        hashing = time.perf_counter()
        # pyright takes this file for preprocess.shards, a module apart from the wampipe.preprocess.shards (the
        # same file through wampipe/'s link) whose Args the spec names
        spec = BuildSpec.from_args(
            args,
            embodiment=emb.tag,
            held_out=held,  # pyright: ignore[reportArgumentType]
            selection=None if chosen is None else chosen.sha256,
        )
        weights = "not loaded (--stage finalize)" if args.stage == "finalize" else f"checked in {checked:.1f} s"
        print(f"start: encoder weights {weights}, inputs hashed in {time.perf_counter() - hashing:.1f} s", flush=True)
        if url:
            remote.prefetch_remote_state(url, out, args.overwrite)
        outdir.claim(out, spec.inputs(), args.overwrite)
        if url and remote.published(url, out):
            print(f"{url} already holds this build")
            return
        if not array_job:  # no other run writes here: what a killed run left half-written can go
            outdir.remove_temporaries(out)
        if chosen is not None:
            write_selection(out, chosen)
        print(f"{args.src}: {len(ds)} episodes -> {len(units)} units -> {out}")
        if args.stage in ("all", "units"):
            build_units(spec, units, args)
        if args.stage == "units" or (array_job and args.stage == "all"):
            print("units done; run again with --stage finalize once every unit is finished")
            return
        if array_job:
            assert args.unit_index is not None and args.num_units is not None  # check_arguments: they go together
            finalize(
                spec,
                units,
                args.finalize_workers,
                part=(args.unit_index, args.num_units),
                ray_address=args.ray_address,
                on_ray=args.executor == "ray",
            )
            print(
                f"shards k with k % {args.num_units} == {args.unit_index} done; run --stage finalize once without "
                f"--unit-index when every job is done (it keeps them and writes the sample index and manifest)"
            )
            return
        manifest = finalize(
            spec, units, args.finalize_workers, ray_address=args.ray_address, on_ray=args.executor == "ray"
        )
        if url:
            remote.publish(out, url, overwrite=args.overwrite)
    t = manifest["totals"]
    print(
        f"done: {t['samples']} samples in {t['shards']} shards ({t['bytes'] / 2**20:.1f} MiB); episodes: "
        f"{t['episodes_encoded']} encoded, {t['episodes_skipped']} shorter than a window, "
        f"{t['episodes_failed']} failed"
    )
    for failure in manifest["failures"]:
        print(f"  FAILED episode {failure['episode']}: {failure['reason']}")
    failed = {failure["episode"] for failure in manifest["failures"]}
    if manifest.get("validation"):
        print(f"  validation split {url or out}/{VAL_DIR}: episodes {manifest['validation']['episodes']} held out")
    for excluded in manifest["statistics"]["excluded"]:
        if excluded["episode"] not in failed and excluded["reason"] != HELD_OUT:
            print(f"  statistics leave out episode {excluded['episode']}: {excluded['reason']}")
