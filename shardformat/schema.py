"""The sample schema: the dtype and shape of every tensor member, the same for every sample of one build.

The producer records it in the manifest (`schema`) from the samples it wrote (`schema_of` per sample, one per unit,
`merge_schemas` over the units); every read checks a sample against it (`check_sample`, through
shardformat.shard.read_sample); the trainer takes the DiT's data-facing widths from it (`model_dims`), so nothing
is decoded to learn them.

    {"latents": {"dtype": "bfloat16", "shape": [48, 9, 11, 20]}, "clip": {...}, "state": {...}, "action": {...}}
"""

from __future__ import annotations

from wampipe.errors import WampipeError
from wampipe.shardformat.layout import ACTION, CLIP, IMAGE_MEMBER, LATENTS, STATE, Y

REQUIRED = (LATENTS, STATE, ACTION)  # besides the manifest's image member


class SchemaError(WampipeError, ValueError):
    """A schema, or a sample against one, that does not hold; the message names the member."""


def schema_of(tensors: dict) -> dict:
    """The schema of one sample from its meta.json `tensors` records ({name: {dtype, shape, zstd}})."""
    return {name: {"dtype": r["dtype"], "shape": list(r["shape"])} for name, r in sorted(tensors.items())}


def merge_schemas(schemas: list[dict]) -> dict:
    """The one schema of a build's samples (here, of its units); SchemaError where two differ."""
    merged = schemas[0] if schemas else {}
    for other in schemas[1:]:
        if other != merged:
            raise SchemaError(f"samples of one build differ in their tensors: {describe(merged)} vs {describe(other)}")
    return merged


def describe(schema: dict) -> str:
    return ", ".join(f"{name} {entry['dtype']} {entry['shape']}" for name, entry in sorted(schema.items()))


def validate(schema, image_features: str, samples: int) -> None:
    """SchemaError unless `schema` is {name: {dtype, shape}} with the members every sample holds: latents, state,
    action and frame 0 as `image_features` says (only that one). A build of no samples has an empty schema."""
    if not isinstance(schema, dict) or not all(
        isinstance(e, dict)
        and e.keys() == {"dtype", "shape"}
        and isinstance(e["dtype"], str)
        and isinstance(e["shape"], list)
        and all(type(n) is int and n >= 0 for n in e["shape"])
        for e in schema.values()
    ):
        raise SchemaError("schema is not {member: {dtype, shape}}")
    if not samples:
        return
    image = IMAGE_MEMBER[image_features]
    stored = sorted(m for m in IMAGE_MEMBER.values() if m in schema)
    if stored != [image]:
        raise SchemaError(f"schema holds {stored} for frame 0, image_features {image_features!r} needs [{image!r}]")
    missing = [m for m in REQUIRED if m not in schema]
    if missing:
        raise SchemaError(f"schema lacks {missing}, which every sample holds")
    ranks = {name: len(schema[name]["shape"]) for name in REQUIRED}
    if ranks != {LATENTS: 4, STATE: 2, ACTION: 2} or not schema[STATE]["shape"][0]:
        raise SchemaError(
            f"schema: latents are not [C, F, H, W], state [chunks > 0, dims] and action [rows, dims]: "
            f"{describe(schema)}"
        )


def check_sample(tensors: dict, schema: dict) -> None:
    """SchemaError naming the first member whose dtype or shape (meta.json's records, which the decoded arrays have
    matched) differs from the manifest's schema, or that one of them lacks."""
    found = schema_of(tensors)
    for name in sorted(found.keys() | schema.keys()):
        want, got = schema.get(name), found.get(name)
        if want != got:
            raise SchemaError(f"member {name}: {_entry(got)}, the manifest's schema says {_entry(want)}")


def _entry(entry: dict | None) -> str:
    return "absent" if entry is None else f"{entry['dtype']} {entry['shape']}"


def model_dims(schema: dict, patch_hw: tuple[int, int] = (2, 2)) -> dict:
    """The DiT fields a build's samples fix: model type (i2v when samples hold `y`), channels in (latents + y) and
    out, tokens per latent frame (the latent grid over the DiT's spatial patch `patch_hw`, Wan's 1x2x2 patch conv;
    an odd side floored), actions per block (one state row per chunk, one chunk per block) and, with CLIP features
    stored, their (tokens, width)."""
    shape = {name: entry["shape"] for name, entry in schema.items()}
    channels, _, h, w = shape[LATENTS]
    y = shape[Y][0] if Y in shape else 0
    dims = {
        "model_type": "i2v" if y else "ti2v",
        "in_dim": channels + y,
        "out_dim": channels,
        "frame_seqlen": (h // patch_hw[0]) * (w // patch_hw[1]),
        "num_action_per_block": shape[ACTION][0] // shape[STATE][0],
    }
    if CLIP in shape:
        dims |= {"image_len": shape[CLIP][0], "image_dim": shape[CLIP][-1]}
    return dims
