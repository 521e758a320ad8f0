"""Load and export CausalWanModel weights in the official on-disk formats.

Sources (`source=` of `prepare_state_dict` / `load_weights`):
* 'dreamzero': a full DreamZero checkpoint; DiT keys under `action_head.model.` (encoders and other heads
  in the file are ignored). Strict: every model key must be present.
* 'wan': a Wan2.2-TI2V-5B / Wan2.1-I2V-14B base checkpoint (Wan's native key names) for a cold start.
  Keys DreamZero adds (action/state encoder + decoder; for ti2v also the CLIP branch `k_img`, `v_img`,
  `norm_k_img` and `img_emb`) may be absent: they are initialised as the reference initialises them
  and listed in the log and in the returned report. Anything else missing is an error.
* 'export': our own exports (`save_weights`), plain model keys. Strict.
* 'auto': 'dreamzero' if any key starts with `action_head.model.`, else strict, falling back to 'wan'
  only when every missing key is one the base lacks.

`prepare_state_dict` returns the checked, complete state dict without touching the model (for a model
on the meta device or sharded by FSDP2); `load_weights` copies it into an unsharded model.

Formats: `.safetensors`, `.pt` / `.pth` / `.bin` (torch.save; a dict, optionally nested under
'state_dict' / 'model' / 'module'), a sharded `*.index.json`, or a directory holding one of these.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from train.model import CausalWanModel

log = logging.getLogger(__name__)

DREAMZERO_PREFIX = "action_head.model."
_NEW_IN_DREAMZERO = re.compile(r"^(action_encoder|state_encoder|action_decoder)\.")
_NEW_IN_TI2V = re.compile(r"^(img_emb\.|blocks\.\d+\.cross_attn\.(k_img|v_img|norm_k_img)\.)")


class WeightsError(ValueError):
    """A checkpoint that does not fit the model; the message names the file and the keys."""


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


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    if path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
        return _torch_load(path)
    raise WeightsError(f"{path}: unknown weight format (want .safetensors, .pt, .pth, .bin or *.index.json)")


def _resolve(path: Path) -> list[Path]:
    """The weight files behind `path` (a file, an index or a directory)."""
    if path.is_dir():
        indexes = sorted(path.glob("*.index.json"))
        if len(indexes) == 1:
            return _resolve(indexes[0])
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".pt", ".pth", ".bin"))
        if len(indexes) > 1 or len(files) != 1:
            raise WeightsError(f"{path}: expected one weight file or one *.index.json, found "
                               f"{[p.name for p in indexes + files]}")
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
    return [path]


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, merged over shards."""
    out: dict[str, torch.Tensor] = {}
    for f in _resolve(Path(path)):
        for k, v in _read_file(f).items():
            if k in out:
                raise WeightsError(f"{f}: key {k} appears in more than one shard")
            out[k] = v
    return out


@torch.no_grad()
def reference_init(model: CausalWanModel, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Initialise `tensor` (the value of parameter `name`) as the reference initialises DreamZero's
    additions: xavier-uniform Linears with zero bias, norms 1 / 0, CategorySpecificLinear W ~ 0.02·N(0,1), b = 0."""
    owner_name, leaf = name.rsplit(".", 1)
    owner = model.get_submodule(owner_name)
    if isinstance(owner, nn.Linear) and leaf == "weight":
        return nn.init.xavier_uniform_(tensor)
    if leaf == "W":
        return tensor.normal_(0, 0.02)
    if leaf == "weight":  # RMSNorm / LayerNorm
        return tensor.fill_(1.0)
    return tensor.zero_()  # biases


def _allowed_absent(model: CausalWanModel, key: str) -> bool:
    if _NEW_IN_DREAMZERO.match(key):
        return True
    return model.cfg.model_type == "ti2v" and bool(_NEW_IN_TI2V.match(key))


def prepare_state_dict(model: CausalWanModel, path: str | Path, source: str = "auto"):
    """The complete state dict `model` should get from `path` (plain keys, absent modules of a Wan base
    filled with their reference init) and a report. Checks names and shapes against `model`, which may
    live on the meta device or be sharded (the trainer can hand the result to DCP's
    `set_model_state_dict(..., full_state_dict=True)`)."""
    if source not in ("auto", "dreamzero", "wan", "export"):
        raise ValueError(f"source must be auto, dreamzero, wan or export, got {source!r}")
    raw = read_state_dict(path)
    if source == "dreamzero" or (source == "auto" and any(k.startswith(DREAMZERO_PREFIX) for k in raw)):
        sd = {k[len(DREAMZERO_PREFIX):]: v for k, v in raw.items() if k.startswith(DREAMZERO_PREFIX)}
        source = "dreamzero"
    else:
        sd = raw
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    unexpected = sorted(set(sd) - set(expected))
    missing = sorted(set(expected) - set(sd))
    if unexpected:
        raise WeightsError(f"{path}: {len(unexpected)} keys the model does not have, e.g. {unexpected[:5]}")
    if source == "auto":
        source = "wan" if missing and all(_allowed_absent(model, k) for k in missing) else "export"
    if missing and source != "wan":
        raise WeightsError(f"{path} ({source}): {len(missing)} model keys missing, e.g. {missing[:5]}")
    if source == "wan":
        bad = [k for k in missing if not _allowed_absent(model, k)]
        if bad:
            raise WeightsError(f"{path} (Wan base): {len(bad)} keys missing that the base must have, e.g. {bad[:5]}")
    for k, v in sd.items():
        if tuple(v.shape) != expected[k]:
            raise WeightsError(f"{path}: {k} has shape {tuple(v.shape)}, model wants {expected[k]}")
    report = LoadReport(str(path), source, loaded=len(sd), initialised=missing)
    if missing:
        for k in missing:
            sd[k] = reference_init(model, k, torch.empty(expected[k]))
        groups = sorted({re.sub(r"\.\d+\.", ".*.", k).rsplit(".", 1)[0] for k in missing})
        n = sum(sd[k].numel() for k in missing)
        log.info("%s: cold start from a Wan base, %d tensors (%d params) absent and initialised as the "
                 "reference does: %s", path, len(missing), n, ", ".join(groups))
    log.info("%s: read %d tensors (%s)", path, len(sd) - len(missing), source)
    return sd, report


def load_weights(model: CausalWanModel, path: str | Path, source: str = "auto") -> LoadReport:
    """Copy a checkpoint into an unsharded `model` (tensors are cast to its dtype and device)."""
    sd, report = prepare_state_dict(model, path, source)
    model.load_state_dict(sd, strict=True)
    return report


def save_weights(model_or_sd: nn.Module | dict, out_dir: str | Path, max_shard_bytes: int = 5 << 30,
                 dtype: torch.dtype | None = None, metadata: dict | None = None) -> Path:
    """Export plain model keys as `model.safetensors` or shards + `model.safetensors.index.json`."""
    from safetensors.torch import save_file
    sd = model_or_sd.state_dict() if isinstance(model_or_sd, nn.Module) else model_or_sd
    sd = {k: (v.to(dtype) if dtype else v).detach().cpu().contiguous() for k, v in sd.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict] = [{}]
    size = 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
        return out / "model.safetensors"
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata=meta)
        weight_map.update({k: name for k in shard})
    index = out / "model.safetensors.index.json"
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return index
