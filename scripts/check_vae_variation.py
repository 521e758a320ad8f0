"""How far apart the Wan VAE encoder's stored latents fall: the eager encoder against itself in other batch sizes (and,
comparing the files of two runs, on another GPU model), and the compiled encoder against the eager one. The evidence
behind `preprocess shards --vae-compile`'s default.

    python scripts/check_vae_variation.py --device cuda --save h100.pt          # one GPU: batch sizes, compile
    python scripts/check_vae_variation.py --compare h100.pt h200.pt             # two GPU models, from saved latents
    python scripts/check_vae_variation.py --device cpu --quick                  # smoke run of this script
    python scripts/check_vae_variation.py --device cuda --batch-sizes 16 1 2 4 8 --warm-jobs 8 \
        --compiled product product-cl fused-norms-cl                             # settings, compiled in parallel first

Every run builds the same VAE (random init at the released widths, seeded on the host, so two machines hold the same
weights) and encodes the same clips: half uniform noise (the hardest case for rounding), half smooth moving gradients
(closer to camera frames). Latents are compared as stored, in bf16: `ulps` counts the representable bf16 values
between two numbers (0 = same bits, 1 = neighbours), `rel_rms` is the RMS of the difference over the RMS of the
latents. One JSON line per setting as it ends, one per recipe (each setting's clips/s, as a CUDA graph too, and its
distance over the eager encoder's widest batch-size spread), then a short table.
"""

from __future__ import annotations

import json
import math
import sys
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from scripts.bench_vae import SHAPES, build_vae
from wampipe.encoders.vae import compile_options, normalize_eagerly


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


def _eager_norms(norms: slice = slice(None), in_eager_order: bool = False):
    """Leave the selected RMS norms' normalize (in module order) to eager's kernels, the others fused."""
    return lambda encoder: normalize_eagerly(encoder, in_eager_order=in_eager_order, norms=norms)


@dataclass(frozen=True)
class Setting:
    """One way to run the encoder: inductor options, whether the RMS norms' normalize is fused too (else eager's
    kernels), channels-last weights and inputs, parts left to their eager kernels (applied before compiling, so they
    hold with the norms fused too), cuDNN's benchmark mode (timed algorithm choice: speed only, the choice may differ
    between runs), and whether it is compiled at all."""

    options: Callable[[], dict] = compile_options
    fuse_norms: bool = False
    channels_last: bool = False
    keep_eager: tuple[Callable[[torch.nn.Module], None], ...] = ()
    cudnn_benchmark: bool = False
    compiled: bool = True


CASTS = {"emulate_precision_casts": True}
FIRST_NORMS, LATE_NORMS = slice(0, 4), slice(8, None)  # the 4 at full resolution; those from the third stage on
# settings to compare with the eager encoder at the first batch size. inductor's own; eager's bf16 roundings kept
# (`emulate_precision_casts`); also eager's memory layout for the convolutions; the product's options
# (encoders.vae.compile_options: the roundings kept, deterministic kernel choice) with the norms fused, and that with
# SiLU eager; the product's options with the norms normalizing through eager's kernels (`product`, the 14B's shipped
# setting; the 5B ships `fused-norms-cl`); that with eager's conv layout, and with
# Wan2.2's average-pooling shortcuts eager. Channels-last (`-cl`): eager itself in that layout (what the layout alone
# changes); the product; the product with its norms summed in eager's channels-first order; the norms fused; fused
# but the first four norms (full resolution) or those from the third stage on eager; fused with cuDNN's benchmark
COMPILED = {
    "inductor": Setting(lambda: {}, True),
    "casts": Setting(lambda: CASTS, True),
    "casts-eager-layout": Setting(lambda: {**CASTS, "layout_optimization": False}, True),
    "product-fused-norms": Setting(fuse_norms=True),
    "product-fused-norms-eager-silu": Setting(fuse_norms=True, keep_eager=(_keep_eager_silu,)),
    "product": Setting(),
    "product-eager-layout": Setting(lambda: {**compile_options(), "layout_optimization": False}),
    "product-eager-avg-down": Setting(keep_eager=(_keep_eager_avg_down,)),
    "eager-cl": Setting(channels_last=True, compiled=False),
    "product-cl": Setting(channels_last=True),
    "product-cl-norms-in-eager-order": Setting(
        fuse_norms=True, channels_last=True, keep_eager=(_eager_norms(in_eager_order=True),)
    ),
    "fused-norms-cl": Setting(fuse_norms=True, channels_last=True),
    "fused-norms-cl-eager-first-norms": Setting(
        fuse_norms=True, channels_last=True, keep_eager=(_eager_norms(FIRST_NORMS),)
    ),
    "fused-norms-cl-eager-late-norms": Setting(
        fuse_norms=True, channels_last=True, keep_eager=(_eager_norms(LATE_NORMS),)
    ),
    "fused-norms-cl-cudnn-benchmark": Setting(fuse_norms=True, channels_last=True, cudnn_benchmark=True),
}


def ordered_bf16(x: torch.Tensor) -> torch.Tensor:
    """bf16 bits as integers that count up with the value (-0 and +0 both 0), so a difference is a distance in ulps."""
    bits = x.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFF))


def distance(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How far the bf16 tensors `a` and `b` (same shape) are apart, element by element."""
    ulps = (ordered_bf16(a) - ordered_bf16(b)).abs().flatten().float()
    a, b = a.float(), b.float()
    rms = a.pow(2).mean().sqrt().item()
    return {
        "frac_differ": round(ulps.gt(0).float().mean().item(), 5),
        "frac_over_1_ulp": round(ulps.gt(1).float().mean().item(), 5),
        # near zero one step of the value is many ulps: the tail of the count, not its max, says how far
        "p99_ulps": float(ulps.kthvalue(max(1, int(0.99 * ulps.numel()))).values),
        "max_abs_over_rms": float((a - b).abs().max()) / rms if rms else 0.0,
        "rel_rms": (a - b).pow(2).mean().sqrt().item() / rms if rms else 0.0,
    }


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
        smooth.append(
            torch.stack([torch.sin(f[c, 0] * xs + f[c, 1] * ys + f[c, 2] * time + p[c])[0] for c in range(3)])
        )
    return torch.cat([noise, torch.stack(smooth)]) if smooth else noise


def build(recipe: str, args, dtype: torch.dtype | None = None):
    """The VAE of `recipe` (seeded random init, the same on every machine) on the device, and its clip shape; in
    `dtype` (default: bf16 on CUDA, float32 elsewhere)."""
    variant, t, h, w = SHAPES[recipe]
    if args.quick:
        t, h, w = 9, 32, 64
    torch.manual_seed(0)
    vae = build_vae(variant, "cpu", args.quick)  # the same weights on every machine ...
    dtype = dtype or (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    # ... then on the device in the encoder's dtype. diffusers' .to is typed through functools.wraps of the unbound
    # Module.to, so pyright misses its `self`
    vae.model.to(device=args.device, dtype=dtype)  # pyright: ignore[reportCallIssue]
    vae.device, vae.dtype = torch.device(args.device), dtype
    vae.mean, vae.inv_std = vae.mean.to(vae.device, dtype), vae.inv_std.to(vae.device, dtype)
    return vae, variant, (t, h, w)


def apply_setting(vae, eager_encoder: torch.nn.Module, name: str, batch: int) -> None:
    """Back to the eager encoder in the default layout, then the setting `name` for padded batches of `batch`."""
    torch._dynamo.reset()
    for m in eager_encoder.modules():  # back to the modules' own forwards
        m.__dict__.pop("forward", None)
    vae.model.encoder = eager_encoder
    vae.graphs.clear()
    vae.set_memory_format(torch.contiguous_format)
    setting = COMPILED[name]
    torch.backends.cudnn.benchmark = setting.cudnn_benchmark
    for keep in setting.keep_eager:
        keep(eager_encoder)
    if setting.compiled:
        vae.compile(batch, setting.options(), fuse_norms=setting.fuse_norms, channels_last=setting.channels_last)
    else:
        vae.set_memory_format(torch.channels_last_3d if setting.channels_last else torch.contiguous_format)
        vae.padded_batch = batch


def warm(recipe: str, args) -> None:
    """Compile each of --compiled for `recipe` into the compile cache (one padded batch of a black clip), measuring
    nothing: what --warm-jobs runs in each of its processes."""
    vae, _, (t, h, w) = build(recipe, args)
    eager_encoder = vae.model.encoder
    for name in args.compiled:
        apply_setting(vae, eager_encoder, name, args.batch_sizes[0])
        vae.encode(torch.zeros(1, 3, t, h, w))


def warm_in_parallel(args) -> None:
    """Compile every (recipe, compiled setting) in --warm-jobs processes at once, sharing the compile cache, so the
    measuring run after them loads each from the cache: compiling is mostly single-threaded, ~1 min a setting."""
    jobs = [(recipe, name) for recipe in args.recipes for name in args.compiled if COMPILED[name].compiled]
    threads = max(1, (os.cpu_count() or 1) // args.warm_jobs)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(threads)}

    def one(job: tuple[str, str]) -> str:
        recipe, name = job
        command = [
            sys.executable,
            __file__,
            "--warm-only",
            "--device",
            args.device,
            "--recipes",
            recipe,
            "--compiled",
            name,
            "--batch-sizes",
            str(args.batch_sizes[0]),
            *(["--quick"] if args.quick else []),
        ]
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"warming {recipe} {name} failed:\n{done.stderr[-3000:]}")
        return f"{recipe} {name}: {time.perf_counter() - start:.0f} s"

    with ThreadPoolExecutor(args.warm_jobs) as pool:
        for line in pool.map(one, jobs):
            print(f"warmed {line}", file=sys.stderr, flush=True)


def fp32_latents(recipe: str, args, x: torch.Tensor) -> torch.Tensor:
    """The clips `x` through a float32 copy of the same encoder, eager, with TF32 off: a reference two orders of
    magnitude closer to the exact latents than any bf16 run, so each bf16 run's distance from it is its own error."""
    vae, _, _ = build(recipe, args, torch.float32)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out = torch.cat([vae.encode(x[i : i + 1]).float().cpu() for i in range(len(x))])
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    del vae
    if x.is_cuda:
        torch.cuda.empty_cache()
    return out


def rel_error(latents: torch.Tensor, reference: torch.Tensor) -> dict:
    """`distances`' rel_rms of `latents` from the float32 `reference` (over the reference's RMS), noise / smooth."""
    return {half: round(d["rel_rms"], 6) for half, d in distances(reference, latents).items()}


def measure(recipe: str, args) -> tuple[dict, dict]:
    vae, variant, (t, h, w) = build(recipe, args)
    cuda = args.device.startswith("cuda")
    batch, base = args.batch_sizes[0], f"eager_b{args.batch_sizes[0]}"  # the baseline of every comparison
    # on the device before timing (the cast to bf16 rounds alike there and on the host)
    x = clips(args.clips, t, h, w).to(args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(name: str, run) -> torch.Tensor:
        out = run().clone()  # compiles (or warms cuDNN) first; a graph's output is overwritten by its next replay
        sync()
        start = time.perf_counter()
        last = out
        for _ in range(args.time_reps):
            last = run()
        sync()
        speed[name] = round(args.time_reps * len(x) / (time.perf_counter() - start), 3)
        rerun[name] = bool(torch.equal(last, out))
        return out.cpu()

    speed: dict[str, float] = {}
    rerun: dict[str, bool] = {}
    latents: dict[str, torch.Tensor] = {}
    for b in args.batch_sizes:
        latents[f"eager_b{b}"] = timed(f"eager_b{b}", lambda b=b: vae.encode(x, batch_size=b))
    again = vae.encode(x, batch_size=batch).cpu()
    eager = [f"eager_b{b}" for b in args.batch_sizes]
    # every pair of eager batch sizes: the spread the eager encoder itself has, not only against the baseline
    pairs = {
        f"{a}_vs_{b}": {half: d["rel_rms"] for half, d in distances(latents[a], latents[b]).items()}
        for i, a in enumerate(eager)
        for b in eager[i + 1 :]
    }
    spread = {half: max((p[half] for p in pairs.values()), default=0.0) for half in ("noise", "smooth")}
    # each eager batch size's own error against float32, and the largest: what "as faithful as eager" allows
    reference = fp32_latents(recipe, args, x) if args.fp32_reference else None
    errors = {name: rel_error(latents[name], reference) for name in eager} if reference is not None else {}
    eager_error = {half: max(e[half] for e in errors.values()) for half in ("noise", "smooth")} if errors else {}
    same_bits = {}
    if cuda:  # the eager encoder replayed as a CUDA graph: expected the same bits
        vae.padded_batch = batch
        vae.capture(t, h, w)
        graphed = timed(f"eager_graph_b{batch}", lambda: vae.encode(x))
        same_bits["eager_graph"] = bool(torch.equal(graphed, latents[base]))
        vae.graphs.clear()
        vae.padded_batch = 0
    settings = {}
    if not args.quick or args.compile:
        eager_encoder = vae.model.encoder
        for name in args.compiled:
            apply_setting(vae, eager_encoder, name, batch)
            key = f"compiled_{name}_b{batch}"
            latents[key] = timed(key, lambda: vae.encode(x))
            row = {"clips_per_s": speed[key], "rerun_same_bits": rerun[key]}
            if cuda:  # as the farm runs it: replayed as a CUDA graph (the same bits, faster)
                vae.capture(t, h, w)
                graphed = timed(f"{key}_graph", lambda: vae.encode(x))
                row.update(
                    graph_clips_per_s=speed[f"{key}_graph"],
                    graph_rerun_same_bits=rerun[f"{key}_graph"],
                    graph_same_bits_as_without=bool(torch.equal(graphed, latents[key])),
                )
                same_bits[f"compiled_{name}_graph"] = row["graph_same_bits_as_without"]
            d = distances(latents[key], latents[base])
            row.update(
                rel_rms_vs_eager={half: round(v["rel_rms"], 6) for half, v in d.items()},
                over_eager_spread={
                    half: round(d[half]["rel_rms"] / spread[half], 3) if spread[half] else None for half in d
                },
            )
            if reference is not None:
                errors[key] = rel_error(latents[key], reference)
                row.update(
                    error_vs_fp32=errors[key],
                    over_eager_error={
                        half: round(errors[key][half] / eager_error[half], 3) if eager_error[half] else None
                        for half in eager_error
                    },
                )
            settings[name] = row
            print(json.dumps({"recipe": recipe, "setting": name, **row}), flush=True)  # compiling takes minutes
        torch.backends.cudnn.benchmark = False
    out = {
        "recipe": recipe,
        "variant": variant,
        "clip": [t, h, w],
        "clips": args.clips,
        "device": torch.cuda.get_device_name() if cuda else args.device,
        "torch": torch.__version__,
        "eager_rerun_same_bits": bool(torch.equal(again, latents[base])),
        "clips_per_s": speed,
        "graph_same_bits_as_without": same_bits,
    }
    for name, value in latents.items():
        if name != base:
            out[f"{name}_vs_{base}"] = distances(value, latents[base])
    out["eager_pairs_rel_rms"] = {k: {half: round(v, 6) for half, v in p.items()} for k, p in pairs.items()}
    out["eager_spread_rel_rms"] = {half: round(v, 6) for half, v in spread.items()}
    out["error_vs_fp32"] = errors
    out["eager_error_vs_fp32"] = eager_error
    out["settings"] = settings  # each against eager at the first batch size, and over the eager spread
    keep = torch.tensor([*range(args.save_clips // 2), *range(len(x) - args.save_clips // 2, len(x))])
    return out, {name: value[keep] for name, value in latents.items()}


def compare(files: list[Path]) -> list[dict]:
    """Each saved tensor of the second run against the same tensor of the first (two GPU models)."""
    first, second = (torch.load(f, weights_only=True) for f in files)
    rows = []
    for recipe in sorted(first.keys() & second.keys()):
        a, b = first[recipe], second[recipe]
        rows.append(
            {
                "recipe": recipe,
                "devices": [a["device"], b["device"]],
                **{
                    name: distances(a["latents"][name], b["latents"][name])
                    for name in sorted(a["latents"].keys() & b["latents"].keys())
                },
            }
        )
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
    """Settings to compare (COMPILED: inductor, casts, casts-eager-layout, product-fused-norms,
    product-fused-norms-eager-silu, product, product-eager-layout, product-eager-avg-down, eager-cl, product-cl,
    product-cl-norms-in-eager-order, fused-norms-cl, fused-norms-cl-eager-first-norms,
    fused-norms-cl-eager-late-norms, fused-norms-cl-cudnn-benchmark), each for batches of the first batch size; on
    CUDA each is also replayed as a CUDA graph."""
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
    warm_jobs: int = 0
    """Compile the settings first in this many processes at once (sharing the compile cache), then measure them one
    by one from the cache (0: compile each as it is measured)."""
    fp32_reference: bool = True
    """Also encode the clips with a float32 copy of the encoder (eager, TF32 off) and give each bf16 run's
    error against it: a setting is as faithful as eager when its error is no larger than eager's largest over
    --batch-sizes (`over_eager_error` <= 1)."""
    warm_only: bool = False
    """Compile the settings into the compile cache and measure nothing (what each --warm-jobs process does)."""


def main(argv: list[str] | None = None) -> list[dict]:
    args = cli(Args, args=argv, description=__doc__)
    if unknown := [name for name in args.compiled if name not in COMPILED]:
        raise SystemExit(f"--compiled: unknown setting {unknown[0]!r}; the settings: {', '.join(COMPILED)}")
    if args.compare:
        if len(args.compare) != 2:
            raise SystemExit("--compare takes two files of --save")
        rows = compare(list(args.compare))
    elif args.warm_only:
        for recipe in args.recipes:
            warm(recipe, args)
        return []
    else:
        if args.warm_jobs and (not args.quick or args.compile):
            warm_in_parallel(args)
        rows = []
        for recipe in args.recipes:
            row, latents = measure(recipe, args)
            rows.append(row)
            if args.save:
                torch.save(
                    {recipe: {"device": row["device"], "latents": latents}},
                    args.save.with_stem(f"{args.save.stem}-{recipe}"),
                )
    for row in rows:
        print(json.dumps(row), flush=True)
    for row in rows:  # the short table last
        if row.get("settings"):
            spread = row["eager_spread_rel_rms"]
            print(
                f"{row['recipe']}: eager b{args.batch_sizes[0]} {row['clips_per_s'][f'eager_b{args.batch_sizes[0]}']}"
                f" clips/s; eager spread {100 * spread['noise']:.3f} % / {100 * spread['smooth']:.3f} %"
            )
            for name, s in row["settings"].items():
                print(
                    f"  {name:36} {s['clips_per_s']:8.2f} {s.get('graph_clips_per_s', 0):8.2f} clips/s  "
                    f"{100 * s['rel_rms_vs_eager']['noise']:.3f} % / {100 * s['rel_rms_vs_eager']['smooth']:.3f} %  "
                    f"{s['over_eager_spread']['noise']} / {s['over_eager_spread']['smooth']}x spread"
                    + (
                        f"  error {s['over_eager_error']['noise']} / {s['over_eager_error']['smooth']}x eager's"
                        if "over_eager_error" in s
                        else ""
                    )
                )
    return rows


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
