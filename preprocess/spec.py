"""The build spec: every value a build is made with, each field marked with the first stage whose bytes it decides.

From the marks come what OUT/inputs.json records (`inputs`: every field with a stage, preprocess.outdir), the part
each unit records (`unit_inputs`: all but the finalize-only ones) and the manifest's fields that state the spec
(`manifest_fields`): a field given a stage is an input, with no second list to edit. The spec is built from the CLI
arguments in one place (`from_args`) and is picklable for worker processes and Ray.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from wampipe.preprocess.shards import Args

# Stages: UNIT decides the units' bytes (and so every later one's), FINALIZE only the shards, text table and
# statistics.
UNIT, FINALIZE = "unit", "finalize"
ENCODERS = ("vae", "image_encoder", "text_encoder", "tokenizer")
# which Wan VAE a model recipe uses; the 14B's (wan2.1) also needs the first-frame input y
VAE_OF_MODEL = {"5b": "wan2.2", "5b-wan22": "wan2.2", "14b": "wan2.1"}


def arg(
    stage: str | Callable[[dict], str] | None = None,
    record: Callable[[BuildSpec, str], Any] | None = None,
    manifest: str | None = None,
    **default,
) -> Any:
    """A spec field. `stage`: the first stage whose bytes it decides, or the function of the recorded inputs that
    tells it; None: it decides no byte. `record`: what the inputs hold for it, given the spec and the field's name
    (default: its value). `manifest`: the manifest block that states it ("" the top level)."""
    return field(metadata={"stage": stage, "record": record, "manifest": manifest}, **default)


def _digest(spec: BuildSpec, name: str) -> str | None:
    """A path is recorded as its sha256 (the source as its fingerprint): the file, not where it lies."""
    return spec.digests[name]


def _when_on(spec: BuildSpec, name: str) -> Any:
    """A selection setting is recorded only while its filter is on (None otherwise), so a build without filters
    records what builds made before filters existed did, and resumes them."""
    value = getattr(spec, name)
    depends = {"keep_ranges_key": spec.keep_ranges, "reward_field": spec.drop_failed}
    if name in depends and not depends[name]:
        return None
    return None if value in (False, "off", ()) else value


def _device_type(spec: BuildSpec, name: str) -> str:
    """The device is recorded as its type: which card of it does not change the bytes."""
    import torch

    return torch.device(spec.device).type


def _vae_kernels(spec: BuildSpec, name: str) -> bool | str:
    """The compiled VAE is recorded by the name of its kernels where they are not the first compiled encoder's
    (true): their latents' bits differ, so units encoded by either never resume into one build."""
    from wampipe.encoders.vae import compiled_kernels

    if not spec.vae_compile:
        return False
    return compiled_kernels(VAE_OF_MODEL[spec.model]) or True


@dataclass(frozen=True, kw_only=True)
class BuildSpec:
    """The arguments of preprocess.shards.Args of the same names (their help says what each does), resolved."""

    src: str = arg(UNIT, _digest)
    dataset: str = arg(UNIT, manifest="")
    embodiment: str = arg(manifest="")  # the dataset preset's
    model: str = arg(UNIT, manifest="")
    vae: str = arg(UNIT, _digest, "encoders")
    image_encoder: str = arg(UNIT, _digest, "encoders")
    text_encoder: str = arg(FINALIZE, _digest, "encoders")
    tokenizer: str = arg(FINALIZE, _digest, "encoders")
    metadata: str | None = arg(FINALIZE, _digest)  # a statistics file to copy instead of computing one
    device: str = arg(UNIT, _device_type)
    dtype: str = arg(UNIT, manifest="encoders")
    threads_per_worker: int = arg(UNIT, manifest="transform")
    batch_size: int = arg(UNIT)
    episodes_per_unit: int = arg(UNIT)
    max_episodes: int | None = arg(UNIT)
    anchor_stride: int = arg(UNIT, manifest="transform")
    augment_variants: int = arg(UNIT, manifest="transform")
    # without augmentation the seed only permutes the shards
    seed: int = arg(lambda inputs: UNIT if inputs.get("augment_variants") else FINALIZE, manifest="")
    compress: str = arg(UNIT, manifest="")
    decode_backend: str = arg(UNIT, manifest="transform")
    image_features: str = arg(UNIT, manifest="")
    vae_compile: bool = arg(UNIT, _vae_kernels)
    compile_cache: str = arg(default="")  # where compiled kernels are kept: a cached kernel is the kernel compiled
    samples_per_shard: int = arg(FINALIZE, manifest="")
    # which episodes and rows (preprocess.selection); episode lists as their shortest text (selection.show_ids)
    keep_ranges: str | None = arg(UNIT, lambda spec, name: spec.digests.get(name))
    keep_ranges_key: str = arg(UNIT, _when_on, default="{episode_index}")
    drop_failed: bool = arg(UNIT, _when_on, default=False)
    reward_field: str = arg(UNIT, _when_on, default="next.reward")
    require_language: str = arg(UNIT, _when_on, default="off")
    episodes: str | None = arg(UNIT, default=None)
    exclude_episodes: str | None = arg(UNIT, default=None)
    min_length: int | None = arg(UNIT, default=None)
    selection: str | None = arg(default=None)  # sha256 of OUT/work/selection.json, the selection these make
    val_episodes: str | None = arg(FINALIZE)  # as given (preprocess.validation.canonical)
    held_out: tuple[int, ...] = arg(default=())  # the episodes val_episodes picks: finalize puts them in OUT/val
    digests: dict = arg(default_factory=dict)  # sha256 of each path field recorded as one
    out: str = arg(default="")
    fail_fast: bool = arg(default=False)

    @classmethod
    def from_args(cls, args: Args, **derived) -> BuildSpec:
        """The spec of checked and completed `args` (preprocess.shards.run) and what the run `derived` from them
        (embodiment, held_out); hashes the source and every file recorded as its sha256."""
        from wampipe.encoders.weights import weights_sha256
        from wampipe.shardformat.files import sha256_file

        assert args.src is not None  # completed: prepare_defaults refused a run without --src
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        given["vae_compile"] = {"on": True, "off": False}[args.vae_compile]  # run() resolved auto for the device
        encoders = weights_sha256(*(Path(given[name]) for name in ENCODERS))
        digests = {
            "src": fingerprint(args.src),
            **dict(zip(ENCODERS, encoders)),
            **{
                name: None if getattr(args, name) is None else sha256_file(getattr(args, name))
                for name in ("metadata", "keep_ranges")
            },
        }
        return cls(**{k: str(v) if isinstance(v, Path) else v for k, v in given.items()}, **derived, digests=digests)

    def inputs(self) -> dict:
        """What the build is made from (OUT/inputs.json): every field with a stage, as recorded. Keys are argument
        names."""
        return {f.name: (f.metadata["record"] or getattr)(self, f.name) for f in fields(self) if f.metadata["stage"]}

    @classmethod
    def unit_inputs(cls, inputs: dict) -> dict:
        """The part of recorded `inputs` that changes a unit's bytes: all but the finalize-only ones."""
        stages = {f.name: f.metadata["stage"] for f in fields(cls)}
        finalize_only = {k for k, s in stages.items() if (s(inputs) if callable(s) else s) == FINALIZE}
        return {k: v for k, v in inputs.items() if k not in finalize_only}

    def manifest_fields(self) -> dict:
        """The manifest fields that state the spec: each field marked with a block in it, an encoder as its path and
        sha256."""
        stated: dict = {"transform": {}, "encoders": {}}
        for f in fields(self):
            block = f.metadata["manifest"]
            if block is not None:
                value = getattr(self, f.name)
                if f.metadata["record"] is _digest:
                    value = {"path": value, "sha256": self.digests[f.name]}
                (stated[block] if block else stated)[f.name] = value
        return stated


def fingerprint(root: Path) -> str:
    """Hash of the source's metadata files plus the names and sizes of all its data and video files."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        digest.update(f"{rel}\0{path.stat().st_size}\0".encode())
        if rel.startswith("meta/"):
            digest.update(path.read_bytes())
    return digest.hexdigest()
