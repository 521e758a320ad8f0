"""The Wan VAE encoder, the farm's bound: achieved TFLOP/s against the GPU's bf16 peak, where its time goes, and
whether the levers that keep the math change its speed. One JSON line.

    python scripts/bench_vae.py --device cuda                        # 5B LIBERO clip (Wan2.2), 14B DROID clip (Wan2.1)
    python scripts/bench_vae.py --device cpu --quick --iters 1       # smoke run of this script

For each clip shape: FLOPs of one encode counted by torch.utils.flop_counter (convolutions, attention, matmuls),
clips/s and TFLOP/s of the encoder as preprocessing runs it (`encoders.vae.WanVAE`, bf16, random init at the
released widths: speed does not depend on the weights), the top kernels by GPU time (torch.profiler), and each
lever's clips/s with its largest deviation from the baseline latents and whether two runs of it give the same bits:

- channels_last: weights and input in channels-last-3d memory order (other cuDNN kernels, same convolutions);
- cudnn_benchmark: cuDNN times its algorithms and keeps the fastest (the choice may differ between runs);
- compile: torch.compile of the encoder as `preprocess shards` compiles it (fuses the activation, norm-scaling and
  cache-copy kernels between convolutions; Wan2.2's norms too, in channels-last; Wan2.1's normalize on eager's kernel).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from wampipe.encoders.vae import VARIANTS, VaeInfo, WanVAE

SHAPES = {  # recipe -> (VAE variant, frames, height, width): the clips preprocessing encodes
    "libero-5b": ("wan2.2", 33, 160, 320),
    "droid-14b": ("wan2.1", 33, 352, 640),
}
LEVERS = ("channels_last", "cudnn_benchmark", "compile")


def build_vae(variant: str, device: str, quick: bool) -> WanVAE:
    # the module defining it, as encoders/vae.py imports it: `from diffusers import AutoencoderKLWan` loads the same
    # modules, but the package exports its names lazily, which pyright cannot see
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

    config: dict[str, Any] = dict(VARIANTS[variant])  # keyword arguments of AutoencoderKLWan, of mixed types
    if quick:
        config.update(base_dim=8, **({"decoder_base_dim": 8} if variant == "wan2.2" else {}))
    with torch.device(device):
        model = AutoencoderKLWan(**config)
    # offline encoding never decodes; None drops the submodule, which diffusers types as always present
    model.decoder = None  # pyright: ignore[reportAttributeAccessIssue]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return WanVAE(
        model, VaeInfo(variant, config["z_dim"], 16 if variant == "wan2.2" else 8, 4, "random"), device, dtype=dtype
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def seconds_per_call(fn, device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


def encode_flops(vae: WanVAE, x: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        vae.encode(x)
    return counter.get_total_flops()


def top_kernels(vae: WanVAE, x: torch.Tensor, n: int = 8) -> list[dict]:
    """The `n` CUDA kernels with the most GPU time in one encode, with their share of the total."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        vae.encode(x)
        sync(str(x.device))
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels) or 1
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [
        {"kernel": e.key[:90], "share": round(e.self_device_time_total / total, 3), "calls": e.count}
        for e in kernels[:n]
    ]


def set_lever(vae: WanVAE, lever: str | None, on: bool, batch_size: int) -> None:
    if lever == "channels_last":  # the 5-D conv weights only (Module.to would also try the 1-D norm gains)
        layout = torch.channels_last_3d if on else torch.contiguous_format
        for param in vae.model.parameters():
            if param.dim() == 5:
                param.data = param.data.contiguous(memory_format=layout)
    elif lever == "cudnn_benchmark":
        torch.backends.cudnn.benchmark = on
    elif lever == "compile":
        if on:
            vae.compile(batch_size)  # as `preprocess shards --vae-compile` runs it
        else:
            vae.model.encoder = getattr(vae.model.encoder, "_orig_mod", vae.model.encoder)
            vae.padded_batch = 0
            vae.set_memory_format(torch.contiguous_format)  # compiling Wan2.2 made it channels-last


def encode_with(vae: WanVAE, x: torch.Tensor, lever: str | None) -> torch.Tensor:
    if lever == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    return vae.encode(x)


def bench_shape(recipe: str, args) -> dict:
    variant, t, h, w = SHAPES[recipe]
    if args.quick:
        t, h, w = 9, 32, 64
    vae = build_vae(variant, args.device, args.quick)
    gen = torch.Generator(device=args.device).manual_seed(0)
    x = (torch.rand(args.batch, 3, t, h, w, device=args.device, generator=gen) * 2 - 1).to(vae.dtype)
    flops = encode_flops(vae, x)
    out = {
        "recipe": recipe,
        "variant": variant,
        "clip": [t, h, w],
        "batch": args.batch,
        "gflop_per_clip": round(flops / args.batch / 1e9, 1),
    }
    reference = vae.encode(x)
    for lever in (None, *args.levers):
        set_lever(vae, lever, True, args.batch)
        name = lever or "baseline"
        try:  # a compile warm-up needs more calls: the first chunk of a clip has other shapes than the rest
            sec = seconds_per_call(
                lambda: encode_with(vae, x, lever), args.device, args.warmup + 2 * (lever == "compile"), args.iters
            )
        except Exception as e:  # report a lever that does not run here and go on with the others
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            set_lever(vae, lever, False, args.batch)
            continue
        first, second = encode_with(vae, x, lever), encode_with(vae, x, lever)
        out[name] = {
            "clips_per_s": round(args.batch / sec, 2),
            "tflops": round(flops / sec / 1e12, 1),
            "max_abs_diff_vs_baseline": float((first.float() - reference.float()).abs().max()),
            "same_bits_twice": bool(torch.equal(first, second)),
        }
        if args.peak_tflops:
            out[name]["fraction_of_peak"] = round(flops / sec / 1e12 / args.peak_tflops, 3)
        set_lever(vae, lever, False, args.batch)
    if args.device.startswith("cuda"):
        out["top_kernels"] = top_kernels(vae, x)
    return out


@dataclass
class Args:
    device: str = "cuda"
    """Device of the VAE: cuda or cpu."""
    recipes: tuple[Literal[tuple(SHAPES)], ...] = tuple(SHAPES)  # type: ignore[valid-type]
    """Clip shapes to measure."""
    batch: int = 4
    """Clips per encode call."""
    levers: tuple[Literal[LEVERS], ...] = LEVERS  # type: ignore[valid-type]
    """Levers to time against the baseline (none: the baseline alone)."""
    peak_tflops: float = 0.0
    """Dense bf16 peak of the device, for the fraction of it reached (0: 989 on H100 and H200, else not
    reported)."""
    warmup: int = 1
    """Untimed calls before timing."""
    iters: int = 3
    """Timed calls."""
    quick: bool = False
    """Tiny widths and clips: a smoke run, not a benchmark."""


def main(argv: list[str] | None = None) -> list[dict]:
    args = cli(Args, args=argv, description=__doc__)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    if not args.peak_tflops and ("H100" in device_name or "H200" in device_name):
        args.peak_tflops = 989.0
    results = []
    for recipe in args.recipes:
        result = {"device": device_name, "torch": torch.__version__, "quick": args.quick, **bench_shape(recipe, args)}
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
