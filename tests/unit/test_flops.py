"""FLOPs per sample vs the reference's table (docs/REFERENCE.md#11-sizes-and-flops) and vs torch's FlopCounterMode
on the tiny model."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from wampipe.train.dit.attention import count_allowed_pairs
from wampipe.train.dit.flops import dit_flops
from wampipe.train.dit.model import build_model, preset, random_batch

T = 1e12


@pytest.mark.parametrize(
    "name,shape,fwd,fwd_bwd,recompute,attn",
    [
        ("libero-5b", (9, 10, 20), 9.81, 29.4, 39.1, 0.100),
        ("droid-5b", (9, 11, 20), 10.11, 30.3, 40.3, 0.106),  # DROID 176x320: 11 latent rows, floored to 5 token rows
        ("droid-14b", (9, 44, 80), 463.1, 1389, 1846, 62.73),
    ],
)
def test_spec_table(name, shape, fwd, fwd_bwd, recompute, attn):
    f = dit_flops(preset(name), shape, per_token_time=True)  # the reference's count
    assert f.forward / T == pytest.approx(fwd, rel=2e-3)
    assert f.fwd_bwd / T == pytest.approx(fwd_bwd, rel=2e-3)
    assert f.train_step(recompute=True) / T == pytest.approx(recompute, rel=2e-3)
    assert f.backward == 2 * f.forward
    assert f.self_attention / T == pytest.approx(attn, rel=5e-3)


def test_5b_libero_breakdown():
    f = dit_flops(preset("libero-5b"), (9, 10, 20), per_token_time=True)
    assert f.token_linears / T == pytest.approx(8.404, abs=1e-3)
    assert f.context_kv / T == pytest.approx(0.871, abs=1e-3)
    assert f.cross_attention / T == pytest.approx(0.274, abs=1e-3)
    assert f.time_embedding / T == pytest.approx(0.129, abs=1e-3)
    # once per distinct timestep: the clean copy's, 9 noisy frames', 64 actions' and 4 states' of 968 tokens
    rows = dit_flops(preset("libero-5b"), (9, 10, 20))
    assert rows.time_embedding / f.time_embedding == pytest.approx((1 + 9 + 64 + 4) / 968)
    assert rows.blocks_forward == f.blocks_forward


def test_matches_flop_counter_on_tiny_model():
    """Linears, convs and bmm as torch counts them on the real forward (its CPU SDPA kernels are not
    counted, so the two attention terms are checked separately against the mask's pair count)."""
    torch.manual_seed(0)
    model = build_model("tiny")
    cfg = model.cfg
    shape = (9, 4, 6)
    b = random_batch(cfg, 1, shape)
    n_act = b.actions.shape[1]
    with FlopCounterMode(display=False) as counter:
        model(
            b.latents,
            torch.rand(1, 9) * 1000,
            b.latents,
            b.actions,
            torch.rand(1, n_act) * 1000,
            b.state,
            b.text,
            b.clip,
        )
    f = dit_flops(cfg, shape)
    assert counter.get_total_flops() == f.forward - f.self_attention - f.cross_attention
    layout = cfg.layout(9, 2 * 3)
    assert f.self_attention == 4 * count_allowed_pairs(layout) * cfg.dim * cfg.num_layers
    assert f.cross_attention == 4 * layout.seq_len * (cfg.text_len + cfg.image_len) * cfg.dim * cfg.num_layers
