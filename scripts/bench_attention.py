"""Self-attention kernels for DreamZero's block-causal mask, fwd+bwd alone, at the real 5B and 14B token layouts.

    python scripts/bench_attention.py                    # both layouts, every variant, on CUDA
    python scripts/bench_attention.py --layouts 5b --iters 5

Variants: FlexAttention with the mask expression (docs/REFERENCE.md#8-attention-mask) as mask_mod, FlexAttention
reading a precomputed dense mask (what the trainer uses), FlexAttention with 64x64 tiles, and SDPA with the dense bool
mask (PyTorch picks the kernel). Each is checked against bf16 SDPA with the dense mask (max abs error of the output)
and timed; effective TFLOP/s counts only the allowed pairs (4·pairs·D per head, x3.5 for fwd+bwd as FlashAttention
counts it). Prints one JSON line per variant, then a summary line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from wampipe.train.dit.attention import count_allowed_pairs, dense_mask, flex_block_mask
from wampipe.train.dit.model import preset

# (model preset, latent frames, tokens per frame, micro-batch): 5B LIBERO 9x10x20, 14B DROID 9x44x80
Layout = Literal["5b", "14b"]
LAYOUTS: dict[Layout, tuple[str, int, int, int]] = {"5b": ("libero-5b", 9, 50, 8), "14b": ("droid-14b", 9, 880, 1)}


def timed(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def variants(layout, device):
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    out = {}
    for name, kw in (
        ("flex_attrs_128", {"lookup": False}),
        ("flex_lookup_128", {"lookup": True}),
        ("flex_lookup_64", {"lookup": True, "block_size": 64}),
    ):
        try:
            bm = flex_block_mask(layout, device, **kw)
        except Exception as e:  # noqa: BLE001 - report a variant this torch cannot build
            out[name] = f"unavailable: {type(e).__name__}: {e}"[:300]
            continue
        out[name] = (lambda q, k, v, bm=bm: flex(q, k, v, block_mask=bm), bm)
    dense = dense_mask(layout, device)
    out["sdpa_dense_mask"] = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), None)
    return out, dense


def bench_layout(key: Layout, args) -> list[dict]:
    name, frames, frame_seqlen, batch = LAYOUTS[key]
    cfg = preset(name)
    layout = cfg.layout(frames, frame_seqlen)
    L, H, D = layout.seq_len, cfg.num_heads, cfg.head_dim
    device = torch.device("cuda")
    g = torch.Generator(device).manual_seed(0)
    q, k, v = (
        torch.randn(batch, H, L, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3)
    )
    grad = torch.randn(batch, H, L, D, device=device, dtype=torch.bfloat16, generator=g)
    pairs = count_allowed_pairs(layout)
    flop = 3.5 * 4 * pairs * D * H * batch  # fwd (4·pairs·D) + bwd (2.5x fwd)
    table, dense = variants(layout, device)
    with torch.no_grad():  # bf16 SDPA with the dense mask (an fp32 reference would materialise 14B's scores)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    rows = []
    for vname, entry in table.items():
        row = {
            "layout": key,
            "variant": vname,
            "seq_len": L,
            "heads": H,
            "batch": batch,
            "allowed_pairs_pct": round(100 * pairs / L**2, 1),
        }
        if isinstance(entry, str):
            rows.append(row | {"error": entry})
            continue
        fn, bm = entry
        try:
            err = (fn(q, k, v).float() - ref.float()).abs().max().item()

            def step():
                fn(q, k, v).backward(grad)
                q.grad = k.grad = v.grad = None

            sec = timed(step, args.iters, args.warmup)
            row |= {
                "ms_fwd_bwd": round(1e3 * sec, 3),
                "eff_tflops": round(flop / sec / 1e12, 1),
                "max_abs_err_vs_sdpa": float(f"{err:.3g}"),
            }
            if bm is not None:
                row["tiles_computed_pct"] = round(100 * (1 - bm.sparsity() / 100), 1)
        except Exception as e:  # noqa: BLE001 - a kernel that fails here is a finding, not a crash
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


@dataclass
class Args:
    layouts: tuple[Layout, ...] = tuple(LAYOUTS)
    """Token layouts to measure: 5b (LIBERO 9x10x20) and 14b (DROID 9x44x80)."""
    iters: int = 10
    """Timed fwd+bwd calls."""
    warmup: int = 3
    """Untimed calls before timing (compile, autotune)."""


def main(argv: list[str] | None = None) -> None:
    args = cli(Args, args=argv, description=__doc__)
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA GPU (FlexAttention has no CPU backward)")
    rows = [r for key in args.layouts for r in bench_layout(key, args)]
    print(
        json.dumps(
            {"bench": "attention", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": len(rows)}
        ),
        flush=True,
    )


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main()
