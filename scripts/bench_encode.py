"""Frozen-encoder throughput with random-init full-size models (no weights needed); prints one JSON line.

    python scripts/bench_encode.py --device cuda            # GPU: VAE clips/s, umT5 prompts/s, CLIP frames/s
    python scripts/bench_encode.py --device cpu --threads 4 # CPU clips/s (divide by threads for per-core)

Shapes: VAE at the 5B LIBERO clip (33x160x320, Wan2.2) and the 14B DROID clip (33x352x640, Wan2.1, plus its
first-frame `y` encode); umT5 at a DROID-length prompt (~110 tokens); CLIP on 224x224 frames. bf16 throughout.
Record the result in docs/PERFORMANCE.md with the hardware and date.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from wampipe.encoders.image_encoder import VIT_H_14, ImageEncoder
from wampipe.encoders.text_encoder import UMT5_XXL, TextEncoder
from wampipe.encoders.vae import VARIANTS, VaeInfo, WanVAE


def timed(fn, device: str, warmup: int, iters: int) -> float:
    """Seconds per call."""
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def compute_dtype(args) -> torch.dtype:
    """As `preprocess shards --dtype auto`: bf16 on CUDA (the reference), float32 on CPU (bf16 conv3d is slow there)."""
    return torch.bfloat16 if args.device.startswith("cuda") else torch.float32


def bench_vae(variant: str, shape: tuple[int, int, int], batch: int, args) -> dict:
    # the module defining it, as encoders/vae.py imports it: `from diffusers import AutoencoderKLWan` loads the same
    # modules, but the package exports its names lazily, which pyright cannot see
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

    config: dict[str, Any] = dict(VARIANTS[variant])  # keyword arguments of AutoencoderKLWan, of mixed types
    if args.quick:
        config.update(base_dim=8, **({"decoder_base_dim": 8} if variant == "wan2.2" else {}))
    with torch.device(args.device):  # random init where the model runs: full-size models init slowly on a CPU
        model = AutoencoderKLWan(**config)
    vae = WanVAE(
        model,
        VaeInfo(variant, config["z_dim"], 16 if variant == "wan2.2" else 8, 4, "random"),
        args.device,
        dtype=compute_dtype(args),
    )
    # encoding never decodes; None drops the submodule (Module.__setattr__), which diffusers types as always present
    vae.model.decoder = None  # pyright: ignore[reportAttributeAccessIssue]
    t, h, w = shape
    x = torch.rand(batch, 3, t, h, w, device=args.device) * 2 - 1
    sec = timed(lambda: vae.encode(x), args.device, args.warmup, args.iters)
    out = {f"vae_{variant}_{t}x{h}x{w}_b{batch}_clips_per_s": batch / sec}
    if variant == "wan2.1":  # 14B also needs y = VAE([frame 0, zeros])
        sec_y = timed(lambda: vae.encode_first_frame(x[:, :, 0], t), args.device, args.warmup, args.iters)
        out[f"vae_{variant}_{t}x{h}x{w}_b{batch}_clips_per_s_with_y"] = batch / (sec + sec_y)
    return out


def bench_umt5(args) -> dict:
    from transformers import UMT5Config, UMT5EncoderModel

    cfg: dict[str, Any] = dict(
        UMT5_XXL, **({"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4} if args.quick else {})
    )
    with torch.device(args.device):
        model = UMT5EncoderModel(UMT5Config(**cfg))
    enc = TextEncoder(model, tokenizer=None, device=args.device, dtype=compute_dtype(args))
    ids = torch.randint(3, 1000, (args.text_batch, args.prompt_tokens), device=args.device)
    mask = torch.ones_like(ids)
    sec = timed(lambda: enc.model(input_ids=ids, attention_mask=mask), args.device, args.warmup, args.iters)
    return {f"umt5_{args.prompt_tokens}tok_b{args.text_batch}_prompts_per_s": args.text_batch / sec}


def bench_clip(args) -> dict:
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    cfg: dict[str, Any] = dict(
        VIT_H_14,
        **(
            {"hidden_size": 160, "intermediate_size": 320, "num_hidden_layers": 3, "num_attention_heads": 2}
            if args.quick
            else {}
        ),
    )
    with torch.device(args.device):
        model = CLIPVisionModelWithProjection(CLIPVisionConfig(**cfg))
    enc = ImageEncoder(model, args.device, dtype=compute_dtype(args))
    x = torch.rand(args.clip_batch, 3, 160, 320, device=args.device) * 2 - 1
    sec = timed(lambda: enc.encode(x), args.device, args.warmup, args.iters)
    return {f"clip_b{args.clip_batch}_frames_per_s": args.clip_batch / sec}


@dataclass
class Args:
    device: str = "cuda"
    """Device of the encoders: cuda or cpu."""
    threads: int = 0
    """CPU threads (0 = torch's default)."""
    vae_batch: int = 4
    """Clips per VAE call (on CPU: 1)."""
    text_batch: int = 16
    """Prompts per umT5 call."""
    prompt_tokens: int = 110
    """Tokens per prompt (DROID's template has about 110)."""
    clip_batch: int = 32
    """Frames per CLIP call."""
    warmup: int = 1
    """Untimed calls before timing."""
    iters: int = 3
    """Timed calls."""
    only: str = "vae,umt5,clip"
    """Encoders to measure, a comma list of vae, umt5 and clip."""
    quick: bool = False
    """Tiny widths: a smoke run of this script, not a benchmark."""


def main(argv: list[str] | None = None) -> None:
    args = cli(Args, args=argv, description=__doc__)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "quick": args.quick,
    }
    only = set(args.only.split(","))
    if "vae" in only:
        small = args.quick  # smoke run: tiny clips too
        result.update(bench_vae("wan2.2", (9, 32, 64) if small else (33, 160, 320), args.vae_batch, args))
        result.update(bench_vae("wan2.1", (9, 32, 64) if small else (33, 352, 640), args.vae_batch, args))
        if args.device == "cpu":
            for key in [k for k in result if k.startswith("vae_") and "clips_per_s" in k]:
                result[key.replace("clips_per_s", "clips_per_s_per_core")] = result[key] / torch.get_num_threads()
    if "umt5" in only:
        result.update(bench_umt5(args))
    if "clip" in only:
        result.update(bench_clip(args))
    print(json.dumps(result))


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
