"""GPU check of the DreamZero DiT (random init, no files needed): FlexAttention vs dense-mask SDPA
agreement at the tiny and 5B token layouts, compact text (FlexAttention key weights) vs 512-row text, then a
timed 5B-shaped forward/backward in bf16.

    python scripts/check_model_gpu.py                      # everything, micro-batch 2
    python scripts/check_model_gpu.py --batch 8 --recompute --compile

Prints a few human lines and, last, one JSON line with the timing (samples/s, TFLOP/s per GPU, MFU).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import cast

import torch

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from wampipe.train.dit.attention import dense_mask, flex_block_mask, masked_attention
from wampipe.train.dit.flops import dit_flops
from wampipe.train.dit.loss import FlowMatchScheduler, flow_matching_loss
from wampipe.train.dit.model import build_model, preset, random_batch
from wampipe.train.dit.text import compact_text


@dataclass
class Args:
    batch: int = 2
    """Micro-batch for the 5B timing (no recompute: ~12 GB activations per sample on top of 22 GB
    bf16 params + grads; with --recompute 8 fits)."""
    steps: int = 10
    """Timed fwd+bwd steps (after warm-up)."""
    warmup: int = 3
    """Untimed steps (compile, autotune)."""
    recompute: bool = False
    """Per-block activation checkpointing (applied here, outside the model)."""
    compile: bool = False
    """torch.compile each block."""
    layers: int = 30
    """Blocks of the 5B model to build (30 = full model)."""
    preset: str = "libero-5b"
    """Model preset for the timing (tiny: a CPU smoke run of this script)."""
    latent: tuple[int, int, int] = (9, 10, 20)
    """Latent (F, h, w) for the timing; 5B LIBERO = 9x10x20 → 968 tokens."""
    device: str = "cuda"
    """cuda; cpu only smoke-tests the script (dense path, no flex backward on CPU)."""
    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU for MFU (H100/H200 SXM: 989)."""
    skip_agreement: bool = False
    """Only time."""


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


def check_attention(dev) -> dict:
    """Flex vs dense on the raw attention op at the tiny and 5B layouts (bf16 and fp32)."""
    out = {}
    for name, cfg_name, frame_seqlen, heads, hd in [("tiny", "tiny", 4, 2, 32), ("5b", "libero-5b", 50, 24, 128)]:
        layout = preset(cfg_name).layout(9, frame_seqlen)
        bm, dm = flex_block_mask(layout, dev), dense_mask(layout, dev)
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v = (
                torch.randn(2, heads, layout.seq_len, hd, device=dev, generator=g, dtype=dtype) for _ in range(3)
            )
            out[f"attn_{name}_{str(dtype)[6:]}"] = max_rel_err(
                masked_attention(q, k, v, bm), masked_attention(q, k, v, dm)
            )
        print(f"{name}: {bm}".splitlines()[0])
    return out


def check_model(dev) -> dict:
    """Whole-model forward + grads through both paths: tiny in fp32, a 2-layer 5B in bf16 autocast."""
    out = {}
    for name, kw, shape, dtype in [
        ("tiny", {}, (9, 4, 4), torch.float32),
        ("5b", {"num_layers": 2}, (9, 10, 20), torch.bfloat16),
    ]:
        torch.manual_seed(0)
        cfg_name = "tiny" if name == "tiny" else "libero-5b"
        model = build_model(cfg_name, **kw).to(dev)
        with torch.no_grad():
            model.head.head.weight.normal_(0, 0.02)
        batch = random_batch(model.cfg, 2, shape, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
        lengths = batch.text.abs().sum(-1).ne(0).sum(1).tolist()
        text, text_lengths = compact_text([t[:n] for t, n in zip(batch.text, lengths)], model.cfg.text_len)
        compact = replace(batch, text=text, text_lengths=text_lengths.to(dev))
        results = {}
        for backend, inputs in (("dense", batch), ("flex", batch), ("compact", compact)):
            batch_run = inputs
            model.attention_backend = "dense" if backend == "dense" else "flex"  # compact text runs on flex
            model.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss, _ = flow_matching_loss(
                    model, batch_run, FlowMatchScheduler(), generator=torch.Generator(device=dev).manual_seed(1)
                )
            loss.backward()
            # every parameter takes part in the loss, so the backward gave each one a gradient
            grads = torch.cat([cast(torch.Tensor, p.grad).flatten().float() for p in model.parameters()])
            results[backend] = (loss.detach(), grads)
        out[f"model_{name}_loss"] = max_rel_err(results["flex"][0], results["dense"][0])
        out[f"model_{name}_grad"] = max_rel_err(results["flex"][1], results["dense"][1])
        out[f"compact_text_{name}_loss"] = max_rel_err(results["compact"][0], results["flex"][0])
        out[f"compact_text_{name}_grad"] = max_rel_err(results["compact"][1], results["flex"][1])
        del model
        torch.cuda.empty_cache()
    return out


def time_5b(args: Args, dev) -> dict:
    torch.manual_seed(0)
    with torch.device(dev):
        model = build_model(args.preset, num_layers=args.layers)
    model.to(torch.bfloat16)  # bf16 params as FSDP2's param dtype; no optimizer step is timed
    model.attention_backend = "flex" if dev.type == "cuda" else "dense"
    if args.recompute:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, blk in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(blk)
    if args.compile:  # as train/parallel.py: each block compiled whole (fullgraph)
        for i, blk in enumerate(model.blocks):
            # compiling a module gives an OptimizedModule, a Module, though torch annotates a plain callable
            model.blocks.register_module(str(i), cast(torch.nn.Module, torch.compile(blk, fullgraph=True)))
    batch = random_batch(model.cfg, args.batch, args.latent, device=dev, dtype=torch.bfloat16)
    sched = FlowMatchScheduler()

    def step():
        loss, _ = flow_matching_loss(model, batch, sched)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(args.warmup):
        step()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    layout = model.cfg.layout(args.latent[0], (args.latent[1] // 2) * (args.latent[2] // 2))
    per_sample = dit_flops(model.cfg, args.latent).train_step(args.recompute)
    sps = args.batch / dt
    tflops = per_sample * sps / 1e12
    return {
        "check": "dit_fwd_bwd",
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "layers": args.layers,
        "batch": args.batch,
        "recompute": args.recompute,
        "compile": args.compile,
        "seq_len": layout.seq_len,
        "context": model.cfg.text_len + model.cfg.image_len,
        "step_s": round(dt, 4),
        "samples_per_s": round(sps, 3),
        "tflop_per_sample": round(per_sample / 1e12, 3),
        "tflops_per_gpu": round(tflops, 1),
        "mfu": round(tflops / args.peak_tflops, 3),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }


def main(args: Args):
    dev = torch.device(args.device)
    assert dev.type != "cuda" or torch.cuda.is_available(), "needs a CUDA GPU (or --device cpu for a smoke run)"
    agreement, bad = {}, {}
    if not args.skip_agreement and dev.type == "cuda":
        agreement.update(check_attention(dev))
        agreement.update(check_model(dev))
        for k, v in agreement.items():
            print(
                f"{'compact vs 512-row text' if k.startswith('compact') else 'flex vs dense'} {k}: max rel err {v:.2e}"
            )

        def tol(key):  # fp32 runs (tiny model, fp32 attention) vs bf16 runs
            return 1e-4 if ("float32" in key or key.startswith(("model_tiny", "compact_text_tiny"))) else 3e-2

        bad = {k: v for k, v in agreement.items() if v > tol(k)}
        if bad:
            print(f"DISAGREE: {bad}")
    torch.backends.cuda.matmul.allow_tf32 = True  # after the fp32 agreement checks
    res = time_5b(args, dev)
    res["flex_vs_dense_max_rel_err"] = {k: float(f"{v:.2e}") for k, v in agreement.items()}
    res["flex_vs_dense_ok"] = bool(agreement) and not bad
    print(json.dumps(res))


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main(cli(Args, description=__doc__))
