"""How far apart the Wan VAE encoder's stored latents fall: the eager encoder against itself in other batch sizes (and,
comparing the files of two runs, on another GPU model), and the compiled encoder against the eager one. The evidence
behind `preprocess shards --vae-compile`'s default.

    python scripts/check_vae_variation.py --device cuda --save h100.pt          # one GPU: batch sizes, compile
    python scripts/check_vae_variation.py --compare h100.pt h200.pt             # two GPU models, from saved latents
    python scripts/check_vae_variation.py --device cpu --quick                  # smoke run of this script

Every run builds the same VAE (random init at the released widths, seeded on the host, so two machines hold the same
weights) and encodes the same clips: half uniform noise (the hardest case for rounding), half smooth moving gradients
(closer to camera frames). Latents are compared as stored, in bf16: `ulps` counts the representable bf16 values
between two numbers (0 = same bits, 1 = neighbours), `rel_rms` is the RMS of the difference over the RMS of the
latents. One JSON line per recipe.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from scripts.bench_vae import SHAPES, build_vae
from wampipe.encoders.vae import compile_options


@torch.library.custom_op("check_vae_variation::silu", mutates_args=())
def eager_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU as eager runs it (its CUDA kernel), opaque to the compiler."""
    return torch.nn.functional.silu(x)


@eager_silu.register_fake
def _(x):
    return torch.empty_like(x)


def _keep_eager_silu(encoder: torch.nn.Module) -> None:
    for m in encoder.modules():
        if type(m) is torch.nn.SiLU:
            m.forward = lambda input: eager_silu(input)  # its argument named as in SiLU.forward, which it replaces


def _keep_eager_avg_down(encoder: torch.nn.Module) -> None:
    """Wan2.2's average-pooling shortcuts (a reshape and a mean) run eagerly, between compiled graphs."""
    for m in encoder.modules():
        if type(m).__name__ == "AvgDown3D":
            m.forward = torch.compiler.disable(m.forward)


CASTS = {"emulate_precision_casts": True}
# torch.compile settings to compare with the eager encoder: (inductor options, whether the RMS norms' normalize is
# fused too, parts of the encoder left to their eager kernels). inductor's own; eager's bf16 roundings kept
# (`emulate_precision_casts`); also eager's memory layout for the convolutions; the product's options
# (encoders.vae.compile_options: the roundings kept, deterministic kernel choice) with the norms fused, and that with
# SiLU eager; the product (the norms normalize through eager's kernels); that with eager's conv layout, and with
# Wan2.2's average-pooling shortcuts eager (where the rest of the Wan2.2 difference might come from)
COMPILED = {"inductor": (lambda: {}, True, ()), "casts": (lambda: CASTS, True, ()),
            "casts-eager-layout": (lambda: {**CASTS, "layout_optimization": False}, True, ()),
            "product-fused-norms": (compile_options, True, ()),
            "product-fused-norms-eager-silu": (compile_options, True, (_keep_eager_silu,)),
            "product": (compile_options, False, ()),
            "product-eager-layout": (lambda: {**compile_options(), "layout_optimization": False}, False, ()),
            "product-eager-avg-down": (compile_options, False, (_keep_eager_avg_down,))}


def ordered_bf16(x: torch.Tensor) -> torch.Tensor:
    """bf16 bits as integers that count up with the value (-0 and +0 both 0), so a difference is a distance in ulps."""
    bits = x.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFF))


def distance(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How far the bf16 tensors `a` and `b` (same shape) are apart, element by element."""
    ulps = (ordered_bf16(a) - ordered_bf16(b)).abs().flatten().float()
    a, b = a.float(), b.float()
    rms = a.pow(2).mean().sqrt().item()
    return {"frac_differ": round(ulps.gt(0).float().mean().item(), 5),
            "frac_over_1_ulp": round(ulps.gt(1).float().mean().item(), 5),
            # near zero one step of the value is many ulps: the tail of the count, not its max, says how far
            "p99_ulps": float(ulps.kthvalue(max(1, int(0.99 * ulps.numel()))).values),
            "max_abs_over_rms": float((a - b).abs().max()) / rms if rms else 0.0,
            "rel_rms": (a - b).pow(2).mean().sqrt().item() / rms if rms else 0.0}


def distances(a: torch.Tensor, b: torch.Tensor) -> dict:
    """`distance` over the noise clips (the first half) and over the smooth ones."""
    half = len(a) - len(a) // 2
    return {"noise": distance(a[:half], b[:half]), "smooth": distance(a[half:], b[half:])}


def clips(n: int, t: int, h: int, w: int) -> torch.Tensor:
    """`n` clips in [-1, 1]: the first half uniform noise, the rest smooth gradients drifting over time."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.rand(n - n // 2, 3, t, h, w, generator=gen) * 2 - 1
    ys, xs = torch.linspace(0, 1, h).view(1, 1, h, 1), torch.linspace(0, 1, w).view(1, 1, 1, w)
    time = torch.linspace(0, 1, t).view(1, t, 1, 1)
    smooth = []
    for _ in range(n // 2):
        f, p = torch.rand(3, 3, generator=gen) * 6 + 1, torch.rand(3, generator=gen) * 2 * math.pi
        smooth.append(torch.stack([torch.sin(f[c, 0] * xs + f[c, 1] * ys + f[c, 2] * time + p[c])[0]
                                   for c in range(3)]))
    return torch.cat([noise, torch.stack(smooth)]) if smooth else noise


def measure(recipe: str, args) -> tuple[dict, dict]:
    variant, t, h, w = SHAPES[recipe]
    if args.quick:
        t, h, w = 9, 32, 64
    torch.manual_seed(0)
    vae = build_vae(variant, "cpu", args.quick)  # the same weights on every machine ...
    cuda = args.device.startswith("cuda")
    batch, base = args.batch_sizes[0], f"eager_b{args.batch_sizes[0]}"  # the baseline of every comparison
    dtype = torch.bfloat16 if cuda else torch.float32
    # ... then on the device in the encoder's dtype. diffusers' .to is typed through functools.wraps of the unbound
    # Module.to, so pyright misses its `self`
    vae.model.to(device=args.device, dtype=dtype)  # pyright: ignore[reportCallIssue]
    vae.device, vae.dtype = torch.device(args.device), dtype
    vae.mean, vae.inv_std = vae.mean.to(vae.device, dtype), vae.inv_std.to(vae.device, dtype)
    x = clips(args.clips, t, h, w)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(name: str, run) -> torch.Tensor:
        out = run()  # compiles (or warms cuDNN) first
        sync()
        start = time.perf_counter()
        for _ in range(args.time_reps):
            run()
        sync()
        speed[name] = round(args.time_reps * len(x) / (time.perf_counter() - start), 3)
        out = out.cpu()
        if base in latents:  # a line per setting as it ends (compiling takes minutes)
            print(json.dumps({"recipe": recipe, "setting": name, "clips_per_s": speed[name],
                              "vs_eager": distances(out, latents[base])}), flush=True)
        return out

    speed: dict[str, float] = {}
    latents: dict[str, torch.Tensor] = {}
    for b in args.batch_sizes:
        latents[f"eager_b{b}"] = timed(f"eager_b{b}", lambda b=b: vae.encode(x, batch_size=b))
    again = vae.encode(x, batch_size=batch).cpu()
    same_bits = {}
    if cuda:  # the eager encoder replayed as a CUDA graph: expected the same bits
        vae.padded_batch = batch
        vae.capture(t, h, w)
        graphed = timed(f"eager_graph_b{batch}", lambda: vae.encode(x))
        same_bits["eager_graph"] = bool(torch.equal(graphed, latents[base]))
        vae.graphs.clear()
    if not args.quick or args.compile:
        eager_encoder = vae.model.encoder
        for name in args.compiled:
            torch._dynamo.reset()
            for m in eager_encoder.modules():  # back to the modules' own forwards
                m.__dict__.pop("forward", None)
            vae.model.encoder = eager_encoder
            options, fuse_norms, keep_eager = COMPILED[name]
            for keep in keep_eager:
                keep(eager_encoder)
            vae.compile(batch, options(), fuse_norms=fuse_norms)
            latents[f"compiled_{name}_b{batch}"] = timed(f"compiled_{name}_b{batch}", lambda: vae.encode(x))
        if args.compiled and cuda:  # the last setting replayed as a CUDA graph: the same bits, faster?
            last = f"compiled_{args.compiled[-1]}"
            vae.capture(t, h, w)
            graphed = timed(f"{last}_graph_b{batch}", lambda: vae.encode(x))
            same_bits["compiled_graph"] = bool(torch.equal(graphed, latents[f"{last}_b{batch}"]))
    out = {"recipe": recipe, "variant": variant, "clip": [t, h, w], "clips": args.clips,
           "device": torch.cuda.get_device_name() if cuda else args.device,
           "torch": torch.__version__, "eager_rerun_same_bits": bool(torch.equal(again, latents[base])),
           "clips_per_s": speed, "graph_same_bits_as_without": same_bits}
    for name, value in latents.items():
        if name != base:
            out[f"{name}_vs_{base}"] = distances(value, latents[base])
    # every pair of eager batch sizes: the spread the eager encoder itself has, not only against the baseline
    eager = [f"eager_b{b}" for b in args.batch_sizes]
    out["eager_pairs_rel_rms"] = {f"{a}_vs_{b}": {half: round(d["rel_rms"], 6) for half, d in
                                                  distances(latents[a], latents[b]).items()}
                                  for i, a in enumerate(eager) for b in eager[i + 1:]}
    keep = torch.tensor([*range(args.save_clips // 2), *range(len(x) - args.save_clips // 2, len(x))])
    return out, {name: value[keep] for name, value in latents.items()}


def compare(files: list[Path]) -> list[dict]:
    """Each saved tensor of the second run against the same tensor of the first (two GPU models)."""
    first, second = (torch.load(f, weights_only=True) for f in files)
    rows = []
    for recipe in sorted(first.keys() & second.keys()):
        a, b = first[recipe], second[recipe]
        rows.append({"recipe": recipe, "devices": [a["device"], b["device"]],
                     **{name: distances(a["latents"][name], b["latents"][name])
                        for name in sorted(a["latents"].keys() & b["latents"].keys())}})
    return rows


@dataclass
class Args:
    recipes: tuple[Literal[tuple(SHAPES)], ...] = tuple(SHAPES)  # type: ignore[valid-type]
    """Clip shapes to measure (the recipe's VAE and clip)."""
    device: str = "cuda"
    """Where the encoder runs."""
    clips: int = 16
    """Clips encoded (half noise, half smooth)."""
    batch_sizes: tuple[int, ...] = (16, 1)
    """Eager batch sizes; the first is also the compiled one and the baseline of every comparison."""
    compiled: tuple[str, ...] = ("inductor", "product")
    """Compile settings to compare (COMPILED: inductor, casts, casts-eager-layout, product-fused-norms,
    product-fused-norms-eager-silu, product, product-eager-layout, product-eager-avg-down), each compiled for batches
    of the first batch size; on CUDA the last one is also replayed as a CUDA graph."""
    time_reps: int = 2
    """Timed encodes of all clips per setting (after one untimed), for clips/s."""
    save: Path | None = None
    """Write the latents of --save-clips clips (each batch size and the compiled encoder) here for --compare, one
    file per recipe (the recipe's name after the stem)."""
    save_clips: int = 4
    """Clips saved: half from the noise ones, half from the smooth ones."""
    compare: tuple[Path, ...] = ()
    """Two files of --save of one recipe (e.g. from an H100 and an H200): compare them and do nothing else."""
    quick: bool = False
    """Narrow VAE and small clips (smoke runs); no compile unless --compile."""
    compile: bool = False
    """With --quick: compile too."""


def main(argv: list[str] | None = None) -> list[dict]:
    args = cli(Args, args=argv, description=__doc__)
    if unknown := [name for name in args.compiled if name not in COMPILED]:
        raise SystemExit(f"--compiled: unknown setting {unknown[0]!r}; the settings: {', '.join(COMPILED)}")
    if args.compare:
        if len(args.compare) != 2:
            raise SystemExit("--compare takes two files of --save")
        rows = compare(list(args.compare))
    else:
        rows = []
        for recipe in args.recipes:
            row, latents = measure(recipe, args)
            rows.append(row)
            if args.save:
                torch.save({recipe: {"device": row["device"], "latents": latents}},
                           args.save.with_stem(f"{args.save.stem}-{recipe}"))
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
