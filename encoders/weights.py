"""Strict weight loading shared by the frozen encoders: read a checkpoint, recognize what it holds, check every key;
and the sha256 of weight files and folders that a build records and a reader checks (`weights_sha256`).

Real checkpoints come as Wan `.pth` files (a plain state dict, sometimes wrapped in `state_dict`/`model_state`),
single `.safetensors` files, or Hugging Face folders with a sharded `*.safetensors.index.json`. Every loader here
names the file it read and the exact keys that are missing, unexpected or mis-shaped, so a wrong download fails
loudly at start-up instead of producing subtly wrong shards.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Collection, TypeVar

import torch

from wampipe.errors import WampipeError
from wampipe.shardformat.files import sha256_file

M = TypeVar("M", bound=torch.nn.Module)

# Probe keys that identify a checkpoint's kind. Order matters: the first match wins.
KINDS: list[tuple[str, str, tuple[str, ...]]] = [
    # (kind, human name, keys that must all be present)
    (
        "wan2.2-vae",
        "Wan2.2 VAE38 (48 latent channels, 16x), original layout",
        ("encoder.downsamples.0.downsamples.0.residual.0.gamma", "conv1.weight"),
    ),
    (
        "wan2.1-vae",
        "Wan2.1 VAE (16 latent channels, 8x), original layout",
        ("encoder.downsamples.0.residual.0.gamma", "conv1.weight"),
    ),
    ("diffusers-vae", "Diffusers AutoencoderKLWan", ("encoder.conv_in.weight", "quant_conv.weight")),
    (
        "wan-umt5",
        "umT5 encoder, Wan layout (models_t5_umt5-xxl-enc-bf16.pth)",
        ("token_embedding.weight", "blocks.0.attn.q.weight"),
    ),
    ("hf-umt5", "umT5 encoder, transformers layout", ("encoder.block.0.layer.0.SelfAttention.q.weight",)),
    ("wan-clip", "open-clip xlm-roberta ViT-H/14, Wan layout", ("visual.patch_embedding.weight",)),
    ("hf-clip-vision", "CLIP vision model, transformers layout", ("vision_model.embeddings.patch_embedding.weight",)),
    ("wan-dit", "Wan diffusion transformer (DiT)", ("head.modulation",)),
]
KIND_NAMES = {kind: name for kind, name, _ in KINDS}


class WeightsError(WampipeError):
    """A weight file (or folder) cannot be used: the one type for the frozen encoders' weights and the trainer's (a
    DiT checkpoint, --model.init-from, an export's base folder; train/dit/weights.py). `WeightsError(path, reason)`
    reads `<file>: <reason>`; `WeightsError(message)` is a line that names the file itself (as `configs.read` raises
    it)."""

    def __init__(self, path: str | Path, reason: str | None = None):
        self.path = Path(path) if reason is not None else None
        self.reason = reason
        super().__init__(str(path) if reason is None else f"{Path(path)}: {reason}")

    def __reduce__(self):  # rebuilt from its parts when raised in a worker process
        return WeightsError, (self.args[0],) if self.reason is None else (self.path, self.reason)


def recognize(state: dict[str, torch.Tensor]) -> str | None:
    """The kind of checkpoint (a key of `KIND_NAMES`), found by probe keys, with or without a `model.`-style prefix."""
    for kind, _, probes in KINDS:
        if all(p in state for p in probes):
            return kind
    for kind, _, probes in KINDS:  # e.g. a DiffSynth/DreamZero export that prefixes every key
        if all(any(k.endswith("." + p) for k in state) for p in probes):
            return kind
    return None


def _unwrap(state: dict, path: Path) -> dict[str, torch.Tensor]:
    for wrapper in ("state_dict", "model_state", "model", "module"):
        if set(state) == {wrapper} and isinstance(state[wrapper], dict):
            state = state[wrapper]
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise WeightsError(path, f"not a state dict: entries {bad[:5]} are not tensors")
    return state


def folder_config(folder: Path, field: str, accepted: tuple[str, ...], what: str) -> dict:
    """config.json of a Diffusers/transformers model folder, whose `field` must be one of `accepted`."""
    config_file = folder / "config.json"
    if not config_file.exists():
        raise WeightsError(folder, f"{what} needs config.json")
    config = json.loads(config_file.read_text())
    if config.get(field) not in accepted:
        raise WeightsError(config_file, f"{field} is {config.get(field)!r}, not {' or '.join(map(repr, accepted))}")
    return config


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a `.pth`/`.pt`/`.bin`, `.safetensors`, `*.index.json` (sharded) file, or of a model folder."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        candidates = (
            sorted(path.glob("*.safetensors.index.json"))
            or sorted(path.glob("*.safetensors"))
            or sorted(path.glob("*.bin"))
            or sorted(path.glob("*.pth"))
        )
        if len(candidates) != 1:
            found = [c.name for c in candidates] or "no weight file"
            raise WeightsError(path, f"expected exactly one weight file or one index in the folder, found {found}")
        return read_state_dict(candidates[0])
    if not path.exists():
        raise WeightsError(path, "file does not exist")
    try:
        if path.name.endswith(".index.json"):
            weight_map = json.loads(path.read_text())["weight_map"]
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                part = load_file(str(path.parent / shard))
                if set(part) != {k for k, v in weight_map.items() if v == shard}:
                    raise WeightsError(path.parent / shard, "keys differ from the index's weight_map")
                state.update(part)
            return state
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return _unwrap(torch.load(path, map_location="cpu", weights_only=True, mmap=True), path)
    except WeightsError:
        raise
    except Exception as err:  # corrupt or foreign file: name it
        raise WeightsError(path, f"cannot read weights ({type(err).__name__}: {err})") from err


def check_keys(
    path: str | Path,
    state: dict[str, torch.Tensor],
    expected: dict[str, torch.Size],
    optional: Collection[str] = frozenset(),
) -> None:
    """Raise `WeightsError` naming every missing, unexpected and mis-shaped key. `optional` keys may be absent
    (e.g. a tied embedding saved under a second name)."""
    missing = sorted(set(expected) - set(state) - set(optional))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(
        f"{k} {tuple(state[k].shape)} != {tuple(expected[k])}"
        for k in set(state) & set(expected)
        if tuple(state[k].shape) != tuple(expected[k])
    )
    problems = []
    for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", shapes)):
        if keys:
            shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise WeightsError(path, "; ".join(problems))


def expect_kind(path: str | Path, state: dict[str, torch.Tensor], wanted: tuple[str, ...], role: str) -> str:
    """The recognized kind if it is one of `wanted`; otherwise an error saying what the file is instead."""
    kind = recognize(state)
    if kind in wanted:
        return kind
    what = (
        KIND_NAMES.get(kind, "not a checkpoint this project knows") if kind else "not a checkpoint this project knows"
    )
    want = " or ".join(KIND_NAMES[w] for w in wanted)
    raise WeightsError(path, f"this file is a {what}, but the {role} needs a {want}")


def on_meta(build: Callable[[], M]) -> M:
    """`build()` on the meta device: no memory and no random draws for weights the file replaces (`load_strict` and
    `assign_loaded` put the file's tensors in their place). Drawing them took longer than reading the file: 6 of the
    5B VAE's 8.7 s of loading on two CPU cores, and an encoder process loads while the farm's workers take the
    cores."""
    with torch.device("meta"):
        return build()


def assign_loaded(module: torch.nn.Module, path: str | Path, state: dict[str, torch.Tensor]) -> None:
    """The tensors of `state` become the module's (built `on_meta`, or anywhere), every key checked (`strict`)."""
    module.load_state_dict(state, strict=True, assign=True)
    check_filled(module, path)


def check_filled(module: torch.nn.Module, path: str | Path) -> None:
    """An error naming the tensors still on the meta device (a buffer the module computes itself, which the file
    does not hold, must be made by the caller first)."""
    left = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise WeightsError(path, f"not filled from the file: {', '.join(left[:4])}")


def load_strict(
    module: torch.nn.Module, path: str | Path, state: dict[str, torch.Tensor], aliases: dict[str, str] | None = None
) -> None:
    """Check `state` against the module's own keys, then put it in (`strict=True`, `assign_loaded`). `aliases` maps
    a key that may be absent to the key holding the same (tied) tensor, e.g. `encoder.embed_tokens.weight` ->
    `shared.weight`."""
    aliases = aliases or {}
    expected = {k: v.shape for k, v in module.state_dict().items()}
    check_keys(path, state, expected, set(aliases))
    filled = {a: state[src] for a, src in aliases.items() if a not in state and a in expected}
    assign_loaded(module, path, {**state, **filled})


def weights_sha256(*paths: Path, threads: int = 8) -> list[str]:
    """sha256 of each weight file, or of each folder (a hash over its files' names and hashes). Every file of every
    path is hashed in a pool of `threads` (hashlib works outside the GIL): a folder of many GB takes what its largest
    file takes, not the sum."""
    files = {path: [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) for path in paths}
    every = sorted({f for fs in files.values() for f in fs})
    with ThreadPoolExecutor(max(1, min(threads, len(every)))) as pool:
        hashed = dict(zip(every, pool.map(sha256_file, every)))
    out = []
    for path in paths:
        if path.is_file():
            out.append(hashed[path])
            continue
        digest = hashlib.sha256()
        for f in files[path]:
            digest.update(f"{f.relative_to(path).as_posix()}\0{hashed[f]}\0".encode())
        out.append(digest.hexdigest())
    return out
