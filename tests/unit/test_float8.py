"""Float8 training (--parallel.float8, torchao): which linears convert, names and numerics kept, FSDP2's float8
all-gather on two real gloo ranks, the one-line refusals, and scripts/check_fp8_parity.py's plumbing.

torch's CPU build runs float8 matmuls (`aten._scaled_mm`), so everything but the speed is exercised here."""

from __future__ import annotations

import sys
from typing import cast

import pytest
import torch
import torch.nn as nn
from torchao.float8.float8_linear import Float8Linear  # torchao: a dev dependency (pyproject.toml)

from tests.helpers import tiny_model
from wampipe.errors import UsageError
from wampipe.train.dit.loss import FlowMatchScheduler, flow_matching_loss
from wampipe.train.dit.model import Block, build_model, random_batch
from wampipe.train.parallel import apply_ac, apply_float8, auto_float8_missing, check_float8

OFFICIAL = set(build_model("tiny").state_dict())
# per block: self-attention q k v o, cross-attention q k v o + k_img v_img, the two FFN linears
PER_BLOCK = 12


def _loss_and_grads(model):
    batch = random_batch(model.cfg, 2, (9, 4, 4), generator=torch.Generator().manual_seed(1))
    loss, _ = flow_matching_loss(model, batch, FlowMatchScheduler(), generator=torch.Generator().manual_seed(2))
    loss.backward()
    return loss.detach(), {
        k.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for k, p in model.named_parameters()
    }


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_only_the_blocks_linears_convert_and_the_names_stay(mode):
    model = tiny_model()
    assert apply_float8(model, mode) == PER_BLOCK * model.cfg.num_layers
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert all(n.startswith("blocks.") for n in converted)
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear]  # embeddings, head, action/state encoders
    assert plain and not any(n.startswith("blocks.") for n in plain)
    assert set(model.state_dict()) == OFFICIAL  # checkpoints and exports keep the official names
    # widths that are not multiples of 16 stay in bf16: an FFN of 72
    odd = tiny_model(ffn_dim=72)
    assert apply_float8(odd, mode) == (PER_BLOCK - 2) * odd.cfg.num_layers
    assert not any(isinstance(m, Float8Linear) for m in cast(Block, odd.blocks[0]).ffn)
    assert apply_float8(tiny_model(), "none") == 0


def test_float8_linears_chooses_which_of_a_blocks_linears_convert():
    def converted(linears):
        model = tiny_model()
        n = apply_float8(model, "tensorwise", linears)
        names = {k.split(".", 2)[2] for k, m in model.named_modules() if isinstance(m, Float8Linear)}
        assert n == len(names) * model.cfg.num_layers  # the same linears in every block
        return names

    every = converted("all")
    assert len(every) == PER_BLOCK
    # tokens: not the cross-attention's projections of the text and image rows
    context = {"cross_attn.k", "cross_attn.v", "cross_attn.k_img", "cross_attn.v_img"}
    assert converted("tokens") == every - context
    assert converted("ffn") == {"ffn.0", "ffn.2"}
    with pytest.raises(ValueError, match="float8 linears must be all, tokens or ffn, got 'attn'"):
        apply_float8(tiny_model(), "tensorwise", "attn")


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_float8_trains_close_to_bf16_and_selective_recompute_keeps_its_gradients(mode):
    ref_loss, ref_grads = _loss_and_grads(tiny_model())
    model = tiny_model()
    apply_float8(model, mode)
    loss, grads = _loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss, rtol=5e-3, atol=0)  # float8 rounding, not another computation
    flat, ref_flat = (torch.cat([g[k].flatten() for k in sorted(g)]) for g in (grads, ref_grads))
    assert torch.isfinite(flat).all() and torch.cosine_similarity(flat, ref_flat, dim=0) > 0.99
    # selective recompute saves the float8 matmul outputs and re-runs the rest: the same gradients, bit for bit
    recomputed = tiny_model()
    apply_float8(recomputed, mode)
    apply_ac(recomputed, "selective")
    loss_ac, grads_ac = _loss_and_grads(recomputed)
    assert torch.equal(loss_ac, loss) and all(torch.equal(grads_ac[k], g) for k, g in grads.items())


def test_refusals_name_the_flag_in_one_line(monkeypatch):
    check_float8("none", None)
    check_float8("tensorwise", (9, 0))  # H100: runs
    with pytest.raises(
        UsageError,
        match=r"^--parallel.float8 tensorwise needs a CUDA GPU of compute capability >= "
        r"8.9 \(float8 matmuls\), found no CUDA device$",
    ):
        check_float8("tensorwise", None)
    with pytest.raises(UsageError, match=r"^--parallel.float8 rowwise needs .* found compute capability 8.0$"):
        check_float8("rowwise", (8, 0))  # A100
    monkeypatch.setitem(sys.modules, "torchao", None)  # torchao not installed
    with pytest.raises(UsageError, match=r"^--parallel.float8 rowwise needs torchao: pip install 'wampipe\[fp8\]'$"):
        check_float8("rowwise", (9, 0))


def test_auto_asks_torchao_only_on_a_cuda_device(monkeypatch):
    """On a CPU, auto's reason comes without importing torchao (whose import there warns on stderr about its CUDA
    kernels); on a GPU it names the missing extra; where float8 is not asked for nothing is consulted."""
    monkeypatch.setitem(sys.modules, "torchao", None)  # importing it would raise: the CPU answer never does
    monkeypatch.delitem(sys.modules, "torchao.float8", raising=False)
    assert auto_float8_missing("auto", None) == (
        "needs a CUDA GPU of compute capability >= 8.9 (float8 matmuls), found no CUDA device"
    )
    assert auto_float8_missing("auto", (9, 0)) == "needs torchao: pip install 'wampipe[fp8]'"
    assert auto_float8_missing("tensorwise", (9, 0)) is None and auto_float8_missing("none", None) is None
