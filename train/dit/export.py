"""Final weights out of a sharded model: an eval-ready DreamZero checkpoint folder, or the plain DiT.

`export_official(model, out, base, shards)` writes a folder that DreamZero's inference server and RLinf load:

    out/config.json                        the base's; what the official constructors read set to the trained DiT
                                           and the shards' window (`eval_config`), full-weights flags
    out/model-0000i-of-0000N.safetensors   the base's shard files and index (or its one model.safetensors): every
    out/model.safetensors.index.json       `action_head.model.*` tensor is the trained one in the base's dtype,
                                           every other tensor (frozen encoders) is byte-identical to the base
    out/experiment_cfg/conf.yaml           the base's
    out/experiment_cfg/metadata.json       the shards' statistics (the normalization the run trained with); for a
                                           mixture, every set's embodiment in the one file

`base` is the official checkpoint folder the run started from. For a run started from a Wan base it may hold only
an official `config.json` and `experiment_cfg/conf.yaml`: the weights are then the DiT alone, and both loaders
build the frozen encoders from the `*_pretrained_path` files the config names (which they read in any case).
Both loaders call `load_state_dict(strict=False)`, so a wrong name would load silently and leave the base's DiT:
`check_base` refuses unless the DiT keys and shapes equal the base's exactly (the trainer calls it at start-up).

`export_weights(model, out)` writes the plain DiT keys (`model.safetensors`, or shards + index).

A LoRA model (train/dit/lora.py) exports through both as merged plain weights (W + scale B@A, folded per layer while
gathering); `export_lora_only` writes its trained tensors under PEFT names instead, for the official `load_lora`.

Both are collective: parameters are all-gathered one at a time and rank 0 writes one file at a time, so no rank
holds more than one output file. The folder is built under a hidden name and renamed when complete: `out` is
always either the previous complete export or the new one. A previous `out` holding a file no export writes
(EXPORT_FILES), and any error writing the new one (a full disk), stop every rank with one line instead; nothing of the
previous export is lost.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError

from wampipe import configs
from wampipe.errors import RunError
from wampipe.shardformat.files import free_space
from wampipe.train.config import CheckpointConfig, LoRAConfig
from wampipe.train.dit.lora import PEFT_PREFIX, lora_only_tensors, merged_tensors
from wampipe.train.dit.weights import (
    DREAMZERO_PREFIX,
    WeightsError,
    allowed_absent,
    model_tensors,
    shard_file_names,
    shard_groups,
    write_index,
)

# every name an export folder can hold: replacing a folder with any other file in it is refused, not done
EXPORT_FILES = (
    "model.safetensors",
    "model-?????-of-?????.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "experiment_cfg",
    "experiment_cfg/conf.yaml",
    "experiment_cfg/metadata.json",
)


def foreign_files(out: Path) -> list[str]:
    """What folder `out` holds that no export writes (EXPORT_FILES), which replacing it would delete."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        return [out.name]
    found = (p.relative_to(out).as_posix() for p in out.rglob("*")) if out.is_dir() else ()
    return sorted(rel for rel in found if not any(fnmatch(rel, pattern) for pattern in EXPORT_FILES))


log = logging.getLogger(__name__)

# DiTConfig fields that are also constructor arguments of the official CausalWanModel (diffusion_model_cfg): every
# width it builds a tensor from, so an absent one is not silently the official default (action_dim 32, max_state_dim
# 64, hidden_size 1024, text_dim 4096) while the trained tensors have another
DIT_FIELDS = (
    "model_type",
    "dim",
    "in_dim",
    "ffn_dim",
    "out_dim",
    "freq_dim",
    "eps",
    "num_heads",
    "num_layers",
    "frame_seqlen",
    "max_chunk_size",
    "num_frame_per_block",
    "num_action_per_block",
    "num_state_per_block",
    "text_len",
    "text_dim",
    "action_dim",
    "max_state_dim",
    "hidden_size",
)
# action-head config fields fixed by the DiT -> the DiTConfig field they equal
HEAD_FIELDS = {
    "action_dim": "action_dim",
    "max_action_dim": "action_dim",
    "max_state_dim": "max_state_dim",
    "num_frame_per_block": "num_frame_per_block",
}
# the official CausalWanModel projects CLIP features from this width whatever its config says
OFFICIAL_CLIP_DIM = 1280
# the DiT comes from the checkpoint, fully fine-tuned (no PEFT wrapping, no base Wan weights read first)
FULL_WEIGHTS = {"skip_component_loading": True, "defer_lora_injection": False, "train_architecture": "full"}
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


@dataclass
class Base:
    """An official checkpoint folder, checked against the model being trained."""

    root: Path
    config: dict
    files: list[tuple[str, list[str]]]
    """Weight files (name, keys) in the base's order; empty for a folder with the configuration only."""
    index: dict | None
    """The base's model.safetensors.index.json, when its weights are sharded."""
    dit_dtypes: dict[str, torch.dtype]
    """Model key -> the base's dtype of that tensor."""


def shard_statistics(shards: str | Path) -> tuple[Path, str]:
    """(statistics file, embodiment tag) of a shard directory (a path or URL: the file is then a local copy)."""
    from wampipe.shardformat.files import sha256_file
    from wampipe.shardformat.manifest import ShardFormatError, check_sha256
    from wampipe.shardformat.storage import ShardStore

    store = ShardStore(shards)
    manifest = store.manifest()
    name, tag = manifest.statistics["file"], manifest.embodiment
    path = store.local_root(name) / name
    try:  # copied into the export as the statistics the policy normalizes with: the sealed ones only
        check_sha256(path, sha256_file(path), manifest.statistics["sha256"])
    except ShardFormatError as err:
        raise WeightsError(str(err)) from None
    if tag not in json.loads(path.read_text()):
        raise WeightsError(f"{path}: no statistics for {tag!r}, the shards' embodiment")
    return path, tag


def mixture_statistics(shards: str | Path | list) -> dict:
    """metadata.json of the run's sets (one shard directory or a mixture's list): each set's embodiment entry under
    its tag, as the official file holds several embodiments. Two sets of one embodiment must agree on it."""
    merged, source = {}, {}
    for one in shards if isinstance(shards, (list, tuple)) else [shards]:
        path, tag = shard_statistics(one)
        entry = json.loads(path.read_text())[tag]
        if tag in merged and merged[tag] != entry:
            raise WeightsError(
                f"{one}: embodiment {tag} with other statistics than {source[tag]}: the eval-ready "
                f"metadata.json holds one entry per embodiment (merge their statistics when building, "
                f"python -m preprocess stats)"
            )
        merged[tag], source[tag] = entry, one
    return merged


def _read_config(root: Path) -> dict:
    """config.json of an official checkpoint folder, or an error naming what it lacks."""
    path = root / "config.json"
    if not path.is_file():
        raise WeightsError(f"{root}: no config.json (not a DreamZero checkpoint folder)")
    config = json.loads(path.read_text())
    if not isinstance(((config.get("action_head_cfg") or {}).get("config") or {}).get("diffusion_model_cfg"), dict):
        raise WeightsError(f"{path}: no action_head_cfg.config.diffusion_model_cfg (not a DreamZero config)")
    return config


def _check_conf(root: Path, tag: str) -> None:
    path = root / "experiment_cfg" / "conf.yaml"
    if not path.is_file():
        raise WeightsError(f"{root}: no experiment_cfg/conf.yaml (the official loader reads its transforms)")
    conf = configs.read(path, WeightsError)
    if conf.get("save_lora_only"):
        raise WeightsError(f"{path}: save_lora_only is true (a LoRA checkpoint; the export writes full weights)")
    for section in ("transforms", "modality_configs"):
        if tag not in (conf.get(section) or {}):
            raise WeightsError(f"{path}: no {section}.{tag} (the shards' embodiment); the official loader needs it")


def _weight_files(root: Path) -> tuple[list[tuple[str, list[str]]], dict | None, dict[str, tuple], dict[str, str]]:
    """(files, index, shapes, dtypes) of the base's safetensors weights, the index checked against the headers."""
    from safetensors import safe_open

    index_path, single = root / "model.safetensors.index.json", root / "model.safetensors"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    if index is not None:
        names = sorted(set(index["weight_map"].values()))
    elif single.is_file():
        names = [single.name]
    else:
        stray = sorted(p.name for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        if stray:
            raise WeightsError(
                f"{root}: weights {stray[:5]} but neither model.safetensors nor its index (not the official layout)"
            )
        return [], None, {}, {}
    files, shapes, dtypes = [], {}, {}
    for name in names:
        if not (root / name).is_file():
            raise WeightsError(f"{index_path}: lists {name}, which is missing")
        handle = safe_open(str(root / name), framework="pt")
        keys = list(handle.keys())
        if index is not None and sorted(keys) != sorted(k for k, f in index["weight_map"].items() if f == name):
            raise WeightsError(f"{index_path}: weight_map disagrees with the keys stored in {name}")
        for k in keys:
            sl = handle.get_slice(k)
            shapes[k], dtypes[k] = tuple(sl.get_shape()), sl.get_dtype()
        files.append((name, keys))
    return files, index, shapes, dtypes


def check_base(base: str | Path, model: nn.Module, tag: str | list[str]) -> Base:
    """Check an official checkpoint folder against `model` and the shards' embodiment `tag` (a mixture: each of its
    tags); header reads only."""
    root = Path(base)
    config = _read_config(root)
    for one in [tag] if isinstance(tag, str) else tag:
        _check_conf(root, one)
    files, index, shapes, dtypes = _weight_files(root)
    expected = {k: tuple(t.shape) for k, (t, _) in model_tensors(model).items()}
    dit_dtypes = {}
    if files:
        peft = [k for k in shapes if "base_layer" in k or "lora_" in k or ".base_model." in k]
        if peft:
            raise WeightsError(
                f"{root}: {len(peft)} PEFT/LoRA keys, e.g. {peft[:3]}: merge the LoRA into the base first"
            )
        dit = {k[len(DREAMZERO_PREFIX) :]: k for k in shapes if k.startswith(DREAMZERO_PREFIX)}
        missing, unexpected = sorted(set(expected) - set(dit)), sorted(set(dit) - set(expected))
        if missing or unexpected:
            raise WeightsError(
                f"{root}: the base's {DREAMZERO_PREFIX}* keys differ from the model's: "
                f"{len(missing)} model keys absent from the base, e.g. {missing[:5]}; "
                f"{len(unexpected)} base keys the model does not have, e.g. {unexpected[:5]}"
            )
        for k, raw in dit.items():
            if shapes[raw] != expected[k]:
                raise WeightsError(f"{root}: {raw} has shape {shapes[raw]} in the base, the model's is {expected[k]}")
            if dtypes[raw] not in _DTYPES:
                raise WeightsError(f"{root}: {raw} has dtype {dtypes[raw]}, not a floating point type")
            dit_dtypes[k] = _DTYPES[dtypes[raw]]
    targets = _targets(config)
    odd = [t for t in targets if not t.startswith("groot.")]
    if odd:
        log.warning(
            "%s/config.json: _target_ %s outside groot.*: the official loader must be able to import it", root, odd[:3]
        )
    return Base(root, config, files, index, dit_dtypes)


def _targets(obj) -> list[str]:
    if isinstance(obj, dict):
        own = [obj["_target_"]] if isinstance(obj.get("_target_"), str) else []
        return own + [t for v in obj.values() for t in _targets(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in _targets(v)]
    return []


def diffusion_model_fields(cfg) -> dict:
    """diffusion_model_cfg entries for the DiT `cfg`. Only 'i2v' concatenates the first-frame latent y to the
    latents; the official default (true) would concatenate it for 'ti2v' too and widen the patch conv."""
    return {f: getattr(cfg, f) for f in DIT_FIELDS} | {"concat_first_frame_latent": cfg.model_type == "i2v"}


def window_fields(tags: list[str]) -> dict:
    """Action-head fields set by the embodiments' window (video frames into the VAE, actions per chunk) on which
    every tag agrees; a field they disagree on is left as the base has it (the official head has one value)."""
    from wampipe.shardformat.embodiments import get_embodiment

    windows = [get_embodiment(tag).window for tag in tags]
    fields = {"num_frames": {w.num_frames for w in windows}, "action_horizon": {w.action_horizon for w in windows}}
    return {k: v.pop() for k, v in fields.items() if len(v) == 1}


def eval_config(config: dict, cfg, tags: Sequence[str] = ()) -> dict:
    """`config` (a base's config.json) describing the trained DiT `cfg` and the embodiments `tags` it trained on
    (`window_fields`), weights loaded in full from the folder."""
    out = json.loads(json.dumps(config))
    head = out["action_head_cfg"]["config"]
    head["diffusion_model_cfg"].update(diffusion_model_fields(cfg))
    head.update({k: getattr(cfg, f) for k, f in HEAD_FIELDS.items()})
    head.update(window_fields(list(tags)) | FULL_WEIGHTS)
    out.update({k: head[k] for k in ("action_dim", "action_horizon") if k in head})
    if cfg.model_type != "t2v" and cfg.image_dim != OFFICIAL_CLIP_DIM:
        log.warning(
            "DiT image_dim %d: the official CausalWanModel projects CLIP features from %d, so the official "
            "loader stops at img_emb.* of this model (docs/EVALUATION.md)",
            cfg.image_dim,
            OFFICIAL_CLIP_DIM,
        )
    return out


def _gather(tensors: dict, keys: list[tuple[str, torch.dtype]], rank0: bool) -> dict[str, torch.Tensor]:
    """Collective: full CPU copies of `keys` (cast to their dtype) on rank 0, {} elsewhere."""
    out = {}
    for key, dtype in keys:
        t = tensors[key][0]
        full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor, or a LoRA layer's Folded merge
        if rank0:
            out[key] = full.detach().to(device="cpu", dtype=dtype).contiguous()
    return out


def _nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def _write_plain(
    tensors: dict, stage: "_Staging", prefix: str, dtype: torch.dtype, metadata: dict, max_shard_bytes: int
) -> None:
    """Collective: every model tensor as `prefix + key`, cut into transformers-named shard files (rank 0 writes)."""
    from safetensors.torch import save_file

    groups = shard_groups({k: t.numel() * dtype.itemsize for k, (t, _) in tensors.items()}, max_shard_bytes)
    names = shard_file_names(len(groups))
    weight_map, total = {}, 0
    for name, group in zip(names, groups):
        got = _gather(tensors, [(k, dtype) for k in group], stage.folder is not None)
        stage.write(
            lambda folder: save_file({prefix + k: v for k, v in got.items()}, str(folder / name), metadata=metadata)
        )
        weight_map.update({prefix + k: name for k in group})
        total += _nbytes(got)
    if len(groups) > 1:
        stage.write(lambda folder: write_index(folder, weight_map, total))


def _write_from_base(tensors: dict, stage: "_Staging", base: Base, metadata: dict) -> None:
    """Collective: the base's files with the DiT tensors replaced (rank 0 writes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    total = 0

    def replaced(folder: Path, name: str, keys: list[str], trained: dict) -> None:
        nonlocal total
        handle = safe_open(str(base.root / name), framework="pt")
        sd = {
            k: trained[k[len(DREAMZERO_PREFIX) :]] if k.startswith(DREAMZERO_PREFIX) else handle.get_tensor(k)
            for k in keys
        }
        save_file(sd, str(folder / name), metadata={**(handle.metadata() or {}), **metadata, "format": "pt"})
        total += _nbytes(sd)

    for name, keys in base.files:
        dit = [
            (k[len(DREAMZERO_PREFIX) :], base.dit_dtypes[k[len(DREAMZERO_PREFIX) :]])
            for k in keys
            if k.startswith(DREAMZERO_PREFIX)
        ]
        trained = _gather(tensors, dit, stage.folder is not None)
        stage.write(replaced, name, keys, trained)
    if (index := base.index) is not None:
        extra = {k: v for k, v in (index.get("metadata") or {}).items() if k != "total_size"}
        stage.write(lambda folder: write_index(folder, index["weight_map"], total, extra))


class _Staging:
    """Rank 0's new export folder, built under a hidden name beside `out` and swapped in when complete. The first
    error (a full disk, a previous folder holding files no export writes) ends rank 0's writing but not the
    collectives the other ranks are in; `finish` then stops every rank with one line, the previous export intact."""

    def __init__(self, out: Path):
        self.out, self.tmp, self.error = out, None, None
        if not _is_rank0():
            return
        foreign = foreign_files(out)
        if foreign:
            self.error = f"it holds {', '.join(foreign[:5])}, which no export writes: move them out of it"
            return
        self.tmp = out.with_name(f".{out.name}.tmp")
        self.write(_fresh_folder, folder=self.tmp)

    @property
    def folder(self) -> Path | None:
        """Where rank 0 writes; None on the other ranks and after an error."""
        return self.tmp if self.error is None else None

    def write(self, write, *args, folder: Path | None = None) -> None:
        """Rank 0: `write(folder, *args)`, its OS error kept as the export's error."""
        folder = folder or self.folder
        if folder is None or self.error is not None:
            return
        try:
            write(folder, *args)
        except (OSError, SafetensorError) as e:
            self.error = " ".join(str(e).split())

    def finish(self) -> Path:
        """Collective: swap the folder in, or stop every rank with rank 0's error."""
        self.write(_publish, self.out)
        if self.error is not None and self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        error = [self.error]
        if dist.is_initialized():
            dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise RunError(
                f"{self.out}: export failed ({error[0]}; {free_space(self.out.parent)}); the previous "
                f"export there is as it was"
            )
        return self.out


def _fresh_folder(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # left by an export that was killed
    tmp.mkdir(parents=True)


def _publish(tmp: Path, out: Path) -> None:
    """fsync every file, then swap the finished folder in for the previous export."""
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            os.chmod(p, 0o644)  # safetensors creates its files 0600; an eval server may run as another user
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@torch.no_grad()
def export_weights(
    model: nn.Module,
    out: str | Path,
    prefix: str = "",
    dtype: torch.dtype = torch.bfloat16,
    metadata: dict | None = None,
    max_shard_bytes: int = 5 << 30,
) -> Path:
    """Collective: the plain DiT (keys `prefix + name`) as `out/model.safetensors`, or shards + index."""
    stage = _Staging(Path(out))
    meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    _write_plain(merged_tensors(model), stage, prefix, dtype, meta, max_shard_bytes)
    return stage.finish()


@torch.no_grad()
def export_official(
    model: nn.Module,
    out: str | Path,
    base: str | Path,
    shards: str | Path | list[str],
    dtype: torch.dtype = torch.bfloat16,
    metadata: dict | None = None,
    max_shard_bytes: int = 5 << 30,
) -> Path:
    """Collective: the eval-ready folder (module docstring). `dtype` and `max_shard_bytes` apply only to a base
    without weights; otherwise the base's dtypes and files are kept."""
    out = Path(out)
    metadata_json = mixture_statistics(shards)
    layout = check_base(base, model, list(metadata_json))  # on every rank: all agree on the files, or all stop here
    stage = _Staging(out)
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    tensors = merged_tensors(model)
    if layout.files:
        _write_from_base(tensors, stage, layout, meta)
    else:
        _write_plain(tensors, stage, DREAMZERO_PREFIX, dtype, {"format": "pt", **meta}, max_shard_bytes)

    def eval_files(folder: Path) -> None:
        config = eval_config(layout.config, model.cfg, list(metadata_json))
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "experiment_cfg").mkdir()
        shutil.copyfile(layout.root / "experiment_cfg" / "conf.yaml", folder / "experiment_cfg" / "conf.yaml")
        _write_statistics(shards, metadata_json, folder / "experiment_cfg" / "metadata.json")

    stage.write(eval_files)
    stage.finish()
    if _is_rank0():
        log.info(
            "%s: eval-ready export (%s, base %s)",
            out,
            "DiT replaced in the base's weights"
            if layout.files
            else "DiT only; encoders from the config's *_pretrained_path files",
            layout.root,
        )
    return out


def _write_statistics(shards: str | Path | list[str], metadata_json: dict, out: Path) -> None:
    """One set's statistics file as it is; a mixture's embodiments in one file (`mixture_statistics`)."""
    if isinstance(shards, (list, tuple)) and len(shards) > 1:
        out.write_text(json.dumps(metadata_json, indent=2) + "\n")
    else:
        shutil.copyfile(shard_statistics(shards[0] if isinstance(shards, (list, tuple)) else shards)[0], out)


def lora_config(config: dict, model: nn.Module) -> dict:
    """`config` (a base's config.json) for a lora-only folder: the trained DiT's fields, wrapped by PEFT with the
    run's adapters at load time, the base DiT read from its `diffusion_model_pretrained_path` first."""
    out = eval_config(config, model.cfg)
    lora = cast(LoRAConfig, model.lora)  # set by apply_lora, as on every model with adapters
    out["action_head_cfg"]["config"].update(
        skip_component_loading=False,
        defer_lora_injection=False,
        train_architecture="lora",
        lora_rank=lora.rank,
        lora_alpha=lora.alpha,
        lora_target_modules=",".join(lora.suffixes()),
        init_lora_weights="kaiming",
    )
    return out


@torch.no_grad()
def export_lora_only(
    model: nn.Module,
    out: str | Path,
    base: str | Path | None = None,
    shards: str | Path | list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    metadata: dict | None = None,
) -> Path:
    """Collective: a LoRA run's trained tensors as an official save_lora_only checkpoint holds them, PEFT names
    (`PEFT_PREFIX` + name, adapters as `.lora_A.default.weight` / `.lora_B.default.weight`) in `out/model.safetensors`:
    the adapters, the action/state encoder and decoder, and the frozen tensors a Wan base lacks (for ti2v the CLIP
    branch, which the official loader would otherwise draw afresh). With `base`, also the base's config.json for
    `load_lora` (`lora_config`), its conf.yaml with save_lora_only: true and the shards' statistics."""
    out = Path(out)
    layout = metadata_json = None
    if base is not None:
        assert shards is not None, "an export with a base carries the shards' statistics: pass shards"
        metadata_json = mixture_statistics(shards)
        layout = check_base(base, model, list(metadata_json))
    stage = _Staging(out)
    absent = tuple(k for k in model_tensors(model) if allowed_absent(model, k))
    meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    _write_plain(lora_only_tensors(model, also=absent), stage, PEFT_PREFIX, dtype, meta, 5 << 30)

    def load_lora_files(folder: Path) -> None:
        import yaml

        # written only with a base (below), which sets all three
        assert layout is not None and metadata_json is not None and shards is not None

        (folder / "config.json").write_text(json.dumps(lora_config(layout.config, model), indent=2) + "\n")
        (folder / "experiment_cfg").mkdir()
        conf = configs.read(layout.root / "experiment_cfg" / "conf.yaml", WeightsError) | {"save_lora_only": True}
        (folder / "experiment_cfg" / "conf.yaml").write_text(yaml.safe_dump(conf, sort_keys=False))
        _write_statistics(shards, metadata_json, folder / "experiment_cfg" / "metadata.json")

    if layout is not None:
        stage.write(load_lora_files)
    return stage.finish()


def export_run(
    cfg: CheckpointConfig,
    model: nn.Module,
    out: Path | None = None,
    metadata: dict | None = None,
    shards: str | Path | list[str] | None = None,
) -> Path:
    """Collective: the final weights in `out` (default <dir>/export): with `cfg.export_base`, an eval-ready DreamZero
    checkpoint folder carrying the statistics of `shards`; else plain safetensors, official key names. A LoRA model
    exports merged weights, or with `cfg.export_lora` lora-only its trained tensors under PEFT names."""
    out = Path(out or Path(cfg.dir) / "export")
    dtype = getattr(torch, cfg.export_dtype)
    if cfg.export_lora == "lora-only":
        return export_lora_only(model, out, cfg.export_base, shards, dtype=dtype, metadata=metadata)
    if cfg.export_base is not None:
        assert shards is not None, "an export with a base carries the shards' statistics: pass shards"
        return export_official(model, out, cfg.export_base, shards, dtype=dtype, metadata=metadata)
    return export_weights(model, out, prefix=cfg.export_prefix, dtype=dtype, metadata=metadata)
