"""Load CausalWanModel weights from the official on-disk formats, into a plain or an FSDP2-sharded model.

Sources (`source=` of `load_weights`):
* 'dreamzero': a full DreamZero checkpoint; DiT keys under `action_head.model.` (encoders and other heads
  in the file are ignored). Strict: every model key must be present.
* 'wan': a Wan2.2-TI2V-5B / Wan2.1-I2V-14B base checkpoint (Wan's native key names) for a cold start.
  Keys DreamZero adds (action/state encoder + decoder; for ti2v also the CLIP branch `k_img`, `v_img`,
  `norm_k_img` and `img_emb`) may be absent: they are initialised as the reference initialises them
  and listed in the log and in the returned report. Anything else missing is an error.
* 'export': our own exports (`save_weights`, train/dit/export.py), plain model keys. Strict.
* 'auto': 'dreamzero' if any key starts with `action_head.model.`, else strict, falling back to 'wan'
  only when every missing key is one the base lacks.

Formats: `.safetensors`, `.pt` / `.pth` / `.bin` (torch.save; a dict, optionally nested under
'state_dict' / 'model' / 'module'), a sharded `*.index.json`, or a directory holding one of these.

Nothing is read whole: names and shapes come from the safetensors headers (or a memory-mapped torch.save file)
and are checked against the model first; then each parameter gets only the rows this rank holds. A parameter
sharded by FSDP2 (a DTensor, Shard(0) over a 1-D mesh) reads its own row range; a plain one reads all rows.
So a model built on the meta device, sharded and materialized, loads without any rank holding the full model.
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from wampipe.encoders.weights import WeightsError

if TYPE_CHECKING:
    from safetensors import safe_open

    from wampipe.train.dit.model import DiTConfig

log = logging.getLogger(__name__)

DREAMZERO_PREFIX = "action_head.model."
_NEW_IN_DREAMZERO = re.compile(r"^(action_encoder|state_encoder|action_decoder)\.")
_NEW_IN_TI2V = re.compile(r"^(img_emb\.|blocks\.\d+\.cross_attn\.(k_img|v_img|norm_k_img)\.)")
# module-name parts that activation checkpointing and torch.compile insert; the official names lack them
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass
class LoadReport:
    path: str
    source: str
    loaded: int = 0
    initialised: list[str] = field(default_factory=list)
    """Model keys absent from the file and initialised as the reference does (cold start)."""


def _torch_load(path: Path) -> dict:
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for wrapper in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and wrapper in obj and isinstance(obj[wrapper], dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict):
        raise WeightsError(f"{path}: expected a state dict, got {type(obj).__name__}")
    return obj


def _resolve(path: Path) -> list[Path]:
    """The weight files behind `path` (a file, an index or a directory)."""
    if path.is_dir():
        indexes = sorted(path.glob("*.index.json"))
        if len(indexes) == 1:
            return _resolve(indexes[0])
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".pt", ".pth", ".bin"))
        if len(indexes) > 1 or len(files) != 1:
            raise WeightsError(
                f"{path}: expected one weight file or one *.index.json, found {[p.name for p in indexes + files]}"
            )
        return files
    if not path.exists():
        raise WeightsError(f"{path}: no such file")
    if path.name.endswith(".index.json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path.parent / s).exists()]
        if missing:
            raise WeightsError(f"{path}: shards listed in the index are missing: {missing}")
        return [path.parent / s for s in shards]
    if path.suffix not in (".safetensors", ".pt", ".pth", ".bin", ".ckpt"):
        raise WeightsError(f"{path}: unknown weight format (want .safetensors, .pt, .pth, .bin or *.index.json)")
    return [path]


def _open(path: Path) -> safe_open | dict:
    """A safetensors handle (header read, data memory-mapped) or a memory-mapped torch.save dict."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        return safe_open(str(path), framework="pt")
    return _torch_load(path)


class Checkpoint:
    """The tensors behind a path, opened lazily: names and shapes from the headers, values copied out on request
    (whole, or a range of rows), one file mapped at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in _resolve(self.path):
            handle = _open(f)
            for key in handle.keys():
                if key in self.file_of:
                    raise WeightsError(f"{f}: key {key} appears in more than one shard")
                self.file_of[key] = f
                # a dict exactly where the file is no .safetensors (`_open`)
                self.shapes[key] = (
                    tuple(handle[key].shape) if isinstance(handle, dict) else tuple(handle.get_slice(key).get_shape())
                )
        self._current: tuple[Path, safe_open | dict] | None = None

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `key`, or its rows [start, stop)."""
        f = self.file_of[key]
        if self._current is None or self._current[0] != f:
            self._current = (f, _open(f))
        handle = self._current[1]
        if not isinstance(handle, dict):  # a .safetensors file
            return handle.get_tensor(key) if rows is None else handle.get_slice(key)[rows[0] : rows[1]]
        return handle[key] if rows is None else handle[key][rows[0] : rows[1]]

    def close(self) -> None:
        self._current = None


def official_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def model_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, nn.Module]]:
    """Official name -> (parameter or persistent buffer, its owner module), wrapper prefixes stripped."""
    out = {}
    for mod_name, mod in model.named_modules():
        local: dict[str, torch.Tensor] = dict(mod.named_parameters(recurse=False))
        local.update((n, b) for n, b in mod.named_buffers(recurse=False) if n not in mod._non_persistent_buffers_set)
        for leaf, t in local.items():
            if leaf in ("lora_A", "lora_B"):  # LoRA adapters (train/dit/lora.py): no tensors of the official layout
                continue
            out[official_name(f"{mod_name}.{leaf}" if mod_name else leaf)] = (t, mod)
    return out


def local_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """The global rows [start, stop) this rank holds of `t`; None = all of it (plain or replicated)."""
    if not isinstance(t, DTensor) or all(isinstance(p, Replicate) for p in t.placements):
        return None
    if t.device_mesh.ndim != 1 or t.placements[0] != Shard(0):
        raise WeightsError(
            f"cannot load into placement {t.placements} on a {t.device_mesh.ndim}-D mesh "
            "(only FSDP's Shard(0) over one mesh dimension)"
        )
    n, world, rank = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    chunk = -(-n // world)  # torch.chunk, as FSDP2 shards
    start = min(rank * chunk, n)
    stop = min(start + chunk, n)
    if t.to_local().shape[0] != stop - start:
        raise WeightsError(
            f"local shard of {tuple(t.shape)} has {t.to_local().shape[0]} rows, expected "
            f"{stop - start} (rank {rank} of {world})"
        )
    return start, stop


@torch.no_grad()
def reference_init(owner: nn.Module, leaf: str, tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Initialise `tensor` (parameter `leaf` of `owner`) as the reference initialises DreamZero's additions:
    xavier-uniform Linears with zero bias, norms 1 / 0, CategorySpecificLinear W ~ 0.02·N(0,1), b = 0."""
    if isinstance(owner, nn.Linear) and leaf == "weight":
        return nn.init.xavier_uniform_(tensor, generator=generator)
    if leaf == "W":
        return tensor.normal_(0, 0.02, generator=generator)
    if leaf == "weight":  # RMSNorm / LayerNorm
        return tensor.fill_(1.0)
    return tensor.zero_()  # biases


def allowed_absent(model: nn.Module, key: str) -> bool:
    if _NEW_IN_DREAMZERO.match(key):
        return True
    cfg = cast("DiTConfig", model.cfg)  # the trainer's models (train/dit/model.py CausalWanModel) carry their config
    return cfg.model_type == "ti2v" and bool(_NEW_IN_TI2V.match(key))


def _key_error(path, source: str, missing: list[str], unexpected: list[str]) -> WeightsError:
    parts = []
    if missing:
        parts.append(f"{len(missing)} model keys missing, e.g. {missing[:5]}")
    if unexpected:
        parts.append(f"{len(unexpected)} keys the model does not have, e.g. {unexpected[:5]}")
        if any("base_layer" in k or "lora_" in k or k.startswith("base_model.") for k in unexpected):
            parts.append("PEFT/LoRA names: merge the LoRA into the base weights first")
    return WeightsError(f"{path} ({source}): " + "; ".join(parts))


def match_keys(model: nn.Module, ckpt: Checkpoint, source: str = "auto") -> tuple[dict[str, str], list[str], str]:
    """(model key -> checkpoint key, model keys to initialise, resolved source), after checking names and shapes."""
    if source not in ("auto", "dreamzero", "wan", "export"):
        raise ValueError(f"source must be auto, dreamzero, wan or export, got {source!r}")
    if source == "dreamzero" or (source == "auto" and any(k.startswith(DREAMZERO_PREFIX) for k in ckpt.shapes)):
        names = {k[len(DREAMZERO_PREFIX) :]: k for k in ckpt.shapes if k.startswith(DREAMZERO_PREFIX)}
        source = "dreamzero"
    else:
        names = {k: k for k in ckpt.shapes}
    expected = {k: tuple(t.shape) for k, (t, _) in model_tensors(model).items()}
    unexpected = sorted(set(names) - set(expected))
    missing = sorted(set(expected) - set(names))
    if source == "auto":
        source = "wan" if missing and all(allowed_absent(model, k) for k in missing) else "export"
    required = [k for k in missing if source != "wan" or not allowed_absent(model, k)]
    if required or unexpected:
        raise _key_error(ckpt.path, "Wan base" if source == "wan" else source, required, unexpected)
    for k, raw in names.items():
        if ckpt.shapes[raw] != expected[k]:
            raise WeightsError(f"{ckpt.path}: {raw} has shape {ckpt.shapes[raw]}, model wants {expected[k]}")
    return names, missing, source


def fill_rows(t: torch.Tensor, read) -> None:
    """Copy this rank's rows of `t` from `read(rows)` (a CPU tensor of the file's dtype)."""
    rows = local_rows(t)
    local = t.to_local() if isinstance(t, DTensor) else t
    if rows is None:
        local.copy_(read(None))
    elif rows[1] > rows[0]:
        local.copy_(read(rows))


@torch.no_grad()
def load_weights(model: nn.Module, path: str | Path, source: str = "auto", seed: int = 0) -> LoadReport:
    """Copy a checkpoint into `model`, plain or sharded by FSDP2 (each rank reads only its own rows); values are
    cast to the parameters' dtype and device. Keys absent from a Wan base get the reference init from a generator
    seeded by (`seed`, key), so every rank and every layout draws the same values."""
    ckpt = Checkpoint(path)
    names, missing, source = match_keys(model, ckpt, source)
    tensors = model_tensors(model)
    try:
        for key in sorted(names, key=lambda k: (str(ckpt.file_of[names[k]]), k)):  # one file mapped at a time
            fill_rows(tensors[key][0], lambda rows, raw=names[key]: ckpt.read(raw, rows))
    finally:
        ckpt.close()
    for key in missing:
        t, owner = tensors[key]
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (1 << 63))
        full = reference_init(owner, key.rsplit(".", 1)[1], torch.empty(t.shape), gen)
        fill_rows(t, lambda rows, full=full: full if rows is None else full[rows[0] : rows[1]])
    if missing:
        groups = sorted({re.sub(r"\.\d+\.", ".*.", k).rsplit(".", 1)[0] for k in missing})
        n = sum(tensors[k][0].numel() for k in missing)
        log.info(
            "%s: cold start from a Wan base, %d tensors (%d params) absent and initialised as the reference does: %s",
            path,
            len(missing),
            n,
            ", ".join(groups),
        )
    log.info("%s: read %d tensors (%s)", path, len(names), source)
    return LoadReport(str(path), source, loaded=len(names), initialised=missing)


def shard_groups(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Keys (in order) cut into consecutive groups of at most `max_shard_bytes` (a larger tensor stands alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for k, nbytes in sizes.items():
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    return groups


def shard_file_names(n: int) -> list[str]:
    """transformers' names: `model.safetensors`, or `model-0000i-of-0000n.safetensors` + an index."""
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_index(out: Path, weight_map: dict[str, str], total_size: int, metadata: dict | None = None) -> Path:
    index = out / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"metadata": {**(metadata or {}), "total_size": total_size}, "weight_map": weight_map}, indent=1)
        + "\n"
    )
    return index


def save_weights(
    model_or_sd: nn.Module | dict,
    out_dir: str | Path,
    max_shard_bytes: int = 5 << 30,
    dtype: torch.dtype | None = None,
    metadata: dict | None = None,
) -> Path:
    """Write an unsharded model's (or a state dict's) keys as `model.safetensors` or shards + index."""
    from safetensors.torch import save_file

    sd = model_or_sd.state_dict() if isinstance(model_or_sd, nn.Module) else model_or_sd
    sd = {k: (v.to(dtype) if dtype else v).detach().cpu().contiguous() for k, v in sd.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = shard_groups({k: v.numel() * v.element_size() for k, v in sd.items()}, max_shard_bytes)
    names = shard_file_names(len(groups))
    meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    for name, keys in zip(names, groups):
        save_file({k: sd[k] for k in keys}, str(out / name), metadata=meta)
    if len(groups) == 1:
        return out / names[0]
    return write_index(
        out,
        {k: name for name, keys in zip(names, groups) for k in keys},
        sum(v.numel() * v.element_size() for v in sd.values()),
    )
