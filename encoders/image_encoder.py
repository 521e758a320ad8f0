"""CLIP ViT-H/14 vision tower (transformers), features after block 31 of 32 for frame 0 -> [257, 1280].

Reference (docs/REFERENCE.md#6-frozen-encoder-outputs): frame 0 of the model-resolution canvas in [-1, 1]
-> bicubic 224x224 (align_corners=False, aspect squashed) -> x*0.5+0.5 -> CLIP mean/std -> ViT-H/14 output of the
31st block, no final LayerNorm or projection. The reference runs it under bf16 autocast; the default here is bf16
weights (same bf16 matmuls; LayerNorm affine in bf16 instead of fp32 -- within bf16 rounding).

Loads a Diffusers `image_encoder/` folder (transformers CLIPVisionModel[WithProjection]) and Wan's
`models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` (visual keys renamed, text tower ignored).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from wampipe.encoders.weights import (
    WeightsError,
    check_filled,
    check_keys,
    expect_kind,
    folder_config,
    on_meta,
    read_state_dict,
)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VIT_H_14 = dict(
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=16,
    patch_size=14,
    image_size=224,
    projection_dim=1024,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
)
HEAD_DIM = 80  # ViT-H/14: 1280 / 16; Wan's file does not record the head count
_WAN_TO_HF = [  # Wan open-clip visual name -> CLIPVisionModelWithProjection name (to_qkv handled apart)
    (r"^visual\.patch_embedding\.weight$", "vision_model.embeddings.patch_embedding.weight"),
    (r"^visual\.pre_norm\.(weight|bias)$", r"vision_model.pre_layrnorm.\1"),
    (r"^visual\.post_norm\.(weight|bias)$", r"vision_model.post_layernorm.\1"),
    (r"^visual\.transformer\.(\d+)\.norm1\.(weight|bias)$", r"vision_model.encoder.layers.\1.layer_norm1.\2"),
    (r"^visual\.transformer\.(\d+)\.norm2\.(weight|bias)$", r"vision_model.encoder.layers.\1.layer_norm2.\2"),
    (
        r"^visual\.transformer\.(\d+)\.attn\.proj\.(weight|bias)$",
        r"vision_model.encoder.layers.\1.self_attn.out_proj.\2",
    ),
    (r"^visual\.transformer\.(\d+)\.mlp\.0\.(weight|bias)$", r"vision_model.encoder.layers.\1.mlp.fc1.\2"),
    (r"^visual\.transformer\.(\d+)\.mlp\.2\.(weight|bias)$", r"vision_model.encoder.layers.\1.mlp.fc2.\2"),
]


def wan_clip_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wan `visual.*` tensors -> transformers names (q/k/v split from `to_qkv`, `head` transposed to the projection)."""
    out = {}
    for key, value in state.items():
        if key == "visual.cls_embedding":
            out["vision_model.embeddings.class_embedding"] = value.reshape(-1)
        elif key == "visual.pos_embedding":
            out["vision_model.embeddings.position_embedding.weight"] = value.reshape(value.shape[-2:])
        elif key == "visual.head":
            out["visual_projection.weight"] = value.t()
        elif m := re.match(r"^visual\.transformer\.(\d+)\.attn\.to_qkv\.(weight|bias)$", key):
            for name, part in zip("qkv", value.chunk(3, dim=0)):
                out[f"vision_model.encoder.layers.{m[1]}.self_attn.{name}_proj.{m[2]}"] = part
        else:
            for pattern, repl in _WAN_TO_HF:
                if re.match(pattern, key):
                    out[re.sub(pattern, repl, key)] = value
                    break
    return out


def hf_clip_to_wan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `wan_clip_to_hf`, used to write Wan-layout files and to name expected Wan keys in errors."""
    out = {}
    for key, value in state.items():
        if key == "vision_model.embeddings.class_embedding":
            out["visual.cls_embedding"] = value.reshape(1, 1, -1)
        elif key == "vision_model.embeddings.position_embedding.weight":
            out["visual.pos_embedding"] = value.unsqueeze(0)
        elif key == "visual_projection.weight":
            out["visual.head"] = value.t()
        elif m := re.match(r"^vision_model\.encoder\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)$", key):
            parts = [state[key.replace("q_proj", f"{n}_proj")] for n in "qkv"]
            out[f"visual.transformer.{m[1]}.attn.to_qkv.{m[2]}"] = torch.cat(parts, dim=0)
        elif re.search(r"\.self_attn\.[kv]_proj\.", key) or key.endswith("position_ids"):
            continue
        else:
            for pattern, repl in _WAN_TO_HF:
                hf_pattern = (
                    "^" + re.escape(repl).replace(r"\\1", r"(\d+|weight|bias)").replace(r"\\2", r"(weight|bias)") + "$"
                )
                if m := re.match(hf_pattern, key):
                    wan = pattern.strip("^$")
                    for group in m.groups():
                        wan = re.sub(r"\(\\d\+\)|\(weight\|bias\)", group, wan, count=1)
                    out[wan.replace("\\.", ".")] = value
                    break
    return out


class ImageEncoder:
    """Frozen CLIP vision tower. `encode(frames_bchw in [-1, 1])` -> [B, 257, 1280] features of block 31."""

    def __init__(self, model, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16):
        vision = model.vision_model
        vision.encoder.layers = vision.encoder.layers[:-1]  # the last block's output is never used
        self.model = vision.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.dtype = dtype
        self.image_size = model.config.image_size
        # [tokens, width] of the features: the class token and one per patch
        self.feature_shape = ((self.image_size // model.config.patch_size) ** 2 + 1, model.config.hidden_size)
        self.mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
        self.std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)

    def preprocess(self, frames_bchw: torch.Tensor) -> torch.Tensor:
        """[-1, 1] frames (any size) -> normalized 224x224 pixels, float32."""
        x = F.interpolate(frames_bchw.float(), size=(self.image_size,) * 2, mode="bicubic", align_corners=False)
        return (x * 0.5 + 0.5 - self.mean.to(x.device)) / self.std.to(x.device)

    @torch.no_grad()
    def encode(self, frames_bchw: torch.Tensor, batch_size: int = 0) -> torch.Tensor:
        step = batch_size or frames_bchw.shape[0]
        return torch.cat(
            [
                self.encode_pixels(self.preprocess(frames_bchw[i : i + step]))
                for i in range(0, frames_bchw.shape[0], step)
            ]
        )

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Features of already preprocessed pixels (`preprocess`), on any device. The trainer reproduces the stored
        features with it, so it always runs torch's default kernels: deterministic mode (--parallel.deterministic)
        picks other CUDA kernels, whose features differ in the last bits."""
        with default_algorithms():
            return self.model(pixel_values=pixels.to(device=self.device, dtype=self.dtype)).last_hidden_state


@contextmanager
def default_algorithms():
    """torch's deterministic mode off for the block (the default kernels are deterministic for this forward too)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _config_from_wan_state(state: dict[str, torch.Tensor]):
    from transformers import CLIPVisionConfig

    dim, _, patch, _ = state["visual.patch_embedding.weight"].shape
    grid = int(round((state["visual.pos_embedding"].shape[1] - 1) ** 0.5))
    layers = len({k.split(".")[2] for k in state if k.startswith("visual.transformer.")})
    return CLIPVisionConfig(
        **{
            **VIT_H_14,
            "hidden_size": dim,
            "patch_size": patch,
            "image_size": grid * patch,
            "num_hidden_layers": layers,
            "num_attention_heads": max(1, dim // HEAD_DIM),
            "intermediate_size": state["visual.transformer.0.mlp.0.weight"].shape[0],
            "projection_dim": state["visual.head"].shape[1],
        }
    )


def load_image_encoder(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
) -> ImageEncoder:
    """Load a Diffusers `image_encoder/` folder or Wan's open-clip `.pth`, strictly. On the meta device the file is
    read and checked all the same but no weight is materialized: `preprocess` and `feature_shape` still work."""
    return ImageEncoder(_load_model(Path(path)), device, dtype)


def _load_model(path: Path):
    """The transformers CLIP vision model of `path`, every key and shape checked."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    if path.is_dir():
        config_dict = folder_config(path, "model_type", ("clip_vision_model", "clip"), "an image_encoder/ folder")
        config = CLIPVisionConfig.from_dict(config_dict.get("vision_config", config_dict))
        state = read_state_dict(path)
        expect_kind(path, state, ("hf-clip-vision",), "image encoder")
        model = on_meta(lambda: CLIPVisionModelWithProjection(config))
        expected = {k: v.shape for k, v in model.state_dict().items() if not k.endswith("position_ids")}
        if "CLIPVisionModelWithProjection" not in config_dict.get("architectures", []):
            expected.pop("visual_projection.weight")  # a plain CLIPVisionModel folder has no projection (unused)
        check_keys(path, state, expected)
    else:
        state = read_state_dict(path)
        expect_kind(path, state, ("wan-clip", "hf-clip-vision"), "image encoder")
        if "visual.patch_embedding.weight" not in state:
            raise WeightsError(path, "a transformers-layout CLIP file needs its config.json: pass the folder")
        extra = sorted(k for k in state if not k.startswith(("visual.", "textual.")) and k != "log_scale")
        visual = {k: v for k, v in state.items() if k.startswith("visual.")}
        model = on_meta(lambda: CLIPVisionModelWithProjection(_config_from_wan_state(state)))
        expected_wan = {k: v.shape for k, v in hf_clip_to_wan(model.state_dict()).items()}
        check_keys(path, {**visual, **{k: state[k] for k in extra}}, expected_wan)
        state = wan_clip_to_hf(visual)
    model.load_state_dict(state, strict=False, assign=True)  # completeness and shapes were checked above
    embeddings = model.vision_model.embeddings  # the one buffer the file does not hold
    ids = torch.arange(embeddings.num_positions, device="cpu")  # on the host even under a meta-device check
    embeddings.register_buffer("position_ids", ids.expand((1, -1)), persistent=False)
    check_filled(model.vision_model, path)  # the projection is not kept: a plain CLIPVisionModel folder lacks it
    return model
