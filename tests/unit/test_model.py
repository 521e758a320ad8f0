"""The DiT training forward: shapes, causality, odd latent height, gradients, flex = dense."""

from dataclasses import replace
from typing import cast

import pytest
import torch

from wampipe.train.dit.attention import make_attention_mask
from wampipe.train.dit.model import (
    Block,
    build_model,
    per_token,
    preset,
    random_batch,
    rope_tables,
    sinusoidal_embedding,
    text_key_log_weight,
)
from wampipe.train.dit.text import compact_text, compact_text_rows, pad_text
from wampipe.train.dit.loss import FlowMatchScheduler, action_ids, sample_timestep_ids


def _run(model, batch, t_frames=None, t_actions=None, noisy=None, noisy_actions=None):
    cfg = model.cfg
    B, nf = batch.latents.shape[0], batch.latents.shape[2]
    g = torch.Generator().manual_seed(5)
    ids = sample_timestep_ids(B, nf, cfg.num_frame_per_block, g, num_timesteps=1000)
    sch = FlowMatchScheduler()
    t_frames = sch.timesteps[ids].float() if t_frames is None else t_frames
    t_actions = (
        sch.timesteps[action_ids(ids, cfg.num_frame_per_block, cfg.num_action_per_block)].float()
        if t_actions is None
        else t_actions
    )
    noisy = torch.randn(batch.latents.shape, generator=g) if noisy is None else noisy
    noisy_actions = torch.randn(batch.actions.shape, generator=g) if noisy_actions is None else noisy_actions
    return model(
        noisy,
        t_frames,
        batch.latents,
        noisy_actions,
        t_actions,
        batch.state,
        batch.text,
        batch.clip,
        batch.y,
        batch.text_lengths,
    )


def _nonzero_head(model):
    with torch.no_grad():  # the reference zero-inits the output head; give it weights so outputs move
        model.head.head.weight.normal_(0, 0.02)
    return model


def test_forward_shapes_tiny():
    torch.manual_seed(0)
    model = build_model("tiny")
    batch = random_batch(model.cfg, 2, (9, 4, 6), generator=torch.Generator().manual_seed(0))
    video, action = _run(model, batch)
    assert video.shape == (2, 4, 9, 4, 6)
    assert action.shape == (2, 16, model.cfg.action_dim)
    assert torch.isfinite(video).all() and torch.isfinite(action).all()


def test_odd_latent_height_is_floored_like_the_reference():
    # 5B DROID: 11 latent rows; the (1,2,2) patch conv floors to 5 token rows, the last row is never seen
    torch.manual_seed(0)
    model = _nonzero_head(build_model("tiny"))
    batch = random_batch(model.cfg, 1, (9, 5, 4), generator=torch.Generator().manual_seed(0))
    video, _ = _run(model, batch, noisy=torch.randn(1, 4, 9, 5, 4))
    assert video.shape == (1, 4, 9, 4, 4)
    noisy = torch.randn(1, 4, 9, 5, 4)
    a = _run(model, batch, noisy=noisy)[0]
    noisy[..., 4, :] += 10.0  # the dropped row has no influence
    b = _run(model, batch, noisy=noisy)[0]
    torch.testing.assert_close(a, b)


def test_i2v_tiny_uses_y():
    torch.manual_seed(0)
    model = _nonzero_head(build_model("tiny", model_type="i2v", in_dim=4 + 8))
    batch = random_batch(model.cfg, 1, (9, 4, 4), generator=torch.Generator().manual_seed(0))
    assert batch.y is not None and batch.y.shape == (1, 8, 9, 4, 4)
    a = _run(model, batch)[0]
    batch.y[:, 4:] += 1.0
    b = _run(model, batch)[0]
    assert not torch.allclose(a, b)
    batch.y = None
    with pytest.raises(ValueError, match="needs y"):
        _run(model, batch)


def test_block_causality():
    """Noisy block i and action chunk i see clean blocks < i and their own block only (REFERENCE.md, Attention mask)."""
    torch.manual_seed(0)
    model = _nonzero_head(build_model("tiny"))
    batch = random_batch(model.cfg, 1, (9, 4, 4), generator=torch.Generator().manual_seed(0))
    noisy = torch.randn(1, 4, 9, 4, 4)
    noisy_actions = torch.randn(1, 16, model.cfg.action_dim)
    v0, a0 = _run(model, batch, noisy=noisy, noisy_actions=noisy_actions)
    # change the noisy frames of block 1 (latent frames 3, 4): only block 1 moves
    n2 = noisy.clone()
    n2[:, :, 3:5] += 1.0
    v1, a1 = _run(model, batch, noisy=n2, noisy_actions=noisy_actions)
    changed = (v1 - v0).abs().amax(dim=(0, 1, 3, 4)) > 1e-6
    assert changed.tolist() == [False, False, False, True, True, False, False, False, False]
    moved = (a1 - a0).abs().amax(dim=(0, 2)) > 1e-6
    assert moved.tolist() == [False] * 4 + [True] * 4 + [False] * 8
    # change clean frame 3 (block 1): noisy blocks 2, 3 and their actions move; 0, 1 and frame 0 do not
    batch.latents[:, :, 3] += 1.0
    v2, a2 = _run(model, batch, noisy=noisy, noisy_actions=noisy_actions)
    changed = (v2 - v0).abs().amax(dim=(0, 1, 3, 4)) > 1e-6
    assert changed.tolist() == [False] * 5 + [True] * 4
    moved = (a2 - a0).abs().amax(dim=(0, 2)) > 1e-6
    assert moved.tolist() == [False] * 8 + [True] * 8


def test_rope_clean_and_noisy_share_positions():
    cfg = preset("libero-5b")
    lay = cfg.layout(9)
    cos, sin = rope_tables(lay, (5, 10), cfg.head_dim, "cpu")
    assert cos.shape == (968, 64)
    torch.testing.assert_close(cos[:450], cos[450:900])
    # action j and state k: 1D rope over all 64 pairs, positions j and k
    assert torch.allclose(cos[900 + 3, 0], torch.cos(torch.tensor(3.0)))
    assert torch.allclose(cos[964 + 2, 0], torch.cos(torch.tensor(2.0)))


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = _nonzero_head(build_model("tiny"))
    batch = random_batch(model.cfg, 2, (9, 4, 4), generator=torch.Generator().manual_seed(0))
    video, action = _run(model, batch)
    (video.square().mean() + action.square().mean()).backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().max() == 0]
    assert dead == []


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_matches_dense_path_cpu():
    """Eager FlexAttention on CPU (no backward there) gives the dense-mask SDPA output."""
    torch.manual_seed(0)
    model = _nonzero_head(build_model("tiny"))
    batch = random_batch(model.cfg, 1, (9, 4, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = _run(model, batch)
        model.attention_backend = "flex"
        flex = _run(model, batch)
    assert [type(m).__name__ for m in model._masks.values()] == ["Tensor", "BlockMask"]
    torch.testing.assert_close(flex[0], dense[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(flex[1], dense[1], atol=1e-5, rtol=1e-4)


def test_time_rows_stand_for_the_reference_per_token_timesteps():
    """The model embeds one row per distinct timestep; expanded, they are the reference's per-token embedding."""
    cfg = preset("tiny")
    nf, fs, B = 5, 6, 2
    layout = cfg.layout(nf, fs)
    k = layout.num_blocks
    g = torch.Generator().manual_seed(0)
    t_frames = torch.randint(0, 1000, (B, nf), generator=g).double()
    t_actions = torch.randint(0, 1000, (B, k * cfg.num_action_per_block), generator=g).double()
    t_state = t_actions[:, :: cfg.num_action_per_block // cfg.num_state_per_block]
    # the reference: clean tokens t = 0, each noisy token its frame's t, then actions and states
    t_noisy = t_frames.repeat_interleave(fs, dim=1)
    t_tok = torch.cat([torch.zeros_like(t_noisy), t_noisy, t_actions, t_state], dim=1)
    emb = lambda t: sinusoidal_embedding(cfg.freq_dim, t)  # noqa: E731
    rows = (emb(torch.zeros(B, 1)), emb(t_frames), emb(torch.cat([t_actions, t_state], dim=1)))
    assert torch.equal(per_token(rows, layout.seq_len), emb(t_tok))


def test_block_modulated_by_rows_equals_per_token_modulation():
    """A block given the time projection's rows computes what it computes from the per-token tensor, and the rows'
    gradients are the per-token gradients summed over the tokens each row stands for (fp64)."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    nf, fs, B = 5, 6, 2
    layout = cfg.layout(nf, fs)
    L, n_reg = layout.seq_len, layout.register_len
    block = Block(cfg).double()
    x = torch.randn(B, L, cfg.dim, dtype=torch.float64)
    context = torch.randn(B, 40, cfg.dim, dtype=torch.float64)
    rope = rope_tables(layout, (2, 3), cfg.head_dim, "cpu", torch.float64)
    mask = make_attention_mask(layout, "cpu")
    rows = tuple(torch.randn(B, n, 6, cfg.dim, dtype=torch.float64, requires_grad=True) for n in (1, nf, n_reg))
    out = block(x, rows, context, rope, mask)
    grad = torch.randn_like(out)
    out.backward(grad)

    clean_row, noisy_rows, register_rows = (r.detach() for r in rows)
    tokens = per_token((clean_row, noisy_rows, register_rows), L).clone().requires_grad_()
    sh1, sc1, g1, sh2, sc2, g2 = (block.modulation.unsqueeze(0) + tokens).unbind(2)  # the reference's block
    y = x + block.self_attn(block.norm1(x) * (1 + sc1) + sh1, rope, mask) * g1
    y = y + block.cross_attn(block.norm3(y), context)
    y = y + block.ffn(block.norm2(y) * (1 + sc2) + sh2) * g2
    y.backward(grad)
    torch.testing.assert_close(out, y, rtol=0, atol=1e-12)
    per_tok = cast(torch.Tensor, tokens.grad)
    clean, noisy = per_tok[:, : nf * fs], per_tok[:, nf * fs : 2 * nf * fs]
    want = (clean.sum(1, keepdim=True), noisy.unflatten(1, (nf, fs)).sum(2), per_tok[:, 2 * nf * fs :])
    for row, expected in zip(rows, want):
        torch.testing.assert_close(row.grad, expected, rtol=1e-10, atol=1e-10)


def test_pad_text_modes():
    a, b = torch.ones(3, 8), torch.ones(5, 8) * 2
    per = pad_text([a, b], text_len=6)
    assert per.shape == (2, 6, 8)
    assert per[0, :3].eq(1).all() and per[0, 3:].eq(0).all() and per[1, :5].eq(2).all() and per[1, 5:].eq(0).all()
    quirk = pad_text([a, b], text_len=6, mode="batch_min")
    assert quirk[1, :3].eq(2).all() and quirk[1, 3:].eq(0).all()


def test_compact_text_rows_and_weights():
    assert [compact_text_rows(n) for n in (1, 63, 64, 110, 447, 448, 511, 512)] == [
        64,
        64,
        128,
        128,
        448,
        512,
        512,
        512,
    ]
    w = text_key_log_weight(torch.tensor([3, 8]), rows=8, text_len=16)
    assert w[0, :3].eq(0).all() and torch.allclose(w[0, 3:], torch.tensor(13 / 5).log())
    assert w[1].eq(0).all()  # a prompt as long as the batch: no zero rows to weight
    text, lengths = compact_text([torch.ones(3, 4), torch.ones(5, 4)], text_len=512)
    assert text.shape == (2, 64, 4) and lengths.tolist() == [3, 5] and text[0, 3:].eq(0).all()
    text, lengths = compact_text([torch.ones(3, 4), torch.ones(5, 4)], text_len=512, mode="batch_min")
    assert lengths.tolist() == [3, 3] and text[1, 3:].eq(0).all()
    text, _ = compact_text([torch.ones(3, 4)], text_len=512, rows=256)  # a dataset-wide width
    assert text.shape == (1, 256, 4)
    with pytest.raises(ValueError, match="cannot hold a 5-row prompt"):
        compact_text([torch.ones(5, 4)], text_len=512, rows=5)


@pytest.mark.parametrize("lengths", [(3, 7, 1), (16, 2, 15)])
def test_compact_text_gives_the_full_layouts_outputs_and_gradients(lengths):
    """Zero text rows collapsed into weighted keys: the same forward and the same gradients as 512-row padding (fp64;
    the model's fp32 islands, e.g. the sinusoid, limit the agreement to ~1e-7 of the largest gradient)."""
    torch.manual_seed(0)
    model = build_model("tiny").double()
    with torch.no_grad():
        model.head.head.weight.normal_(0, 0.1)  # the reference zero-inits the head; give the video loss a path
    cfg = model.cfg
    batch = random_batch(cfg, 3, (9, 4, 4), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    prompts = [torch.randn(n, cfg.text_dim, dtype=torch.float64) for n in lengths]
    t_frames = torch.rand(3, 9, dtype=torch.float64) * 1000
    t_actions = torch.rand(3, 4 * cfg.num_action_per_block, dtype=torch.float64) * 1000

    def run(text, text_lengths):
        model.zero_grad()
        video, action = model(
            batch.latents,
            t_frames,
            batch.latents,
            batch.actions,
            t_actions,
            batch.state,
            text,
            batch.clip,
            None,
            text_lengths,
        )
        (video.pow(2).sum() + action.pow(2).sum()).backward()
        grads = {k: cast(torch.Tensor, p.grad).clone() for k, p in model.named_parameters()}
        return video.detach(), action.detach(), grads

    text, text_lengths = compact_text(prompts, cfg.text_len, bucket=4)
    assert text.shape[1] == (8 if max(lengths) < 8 else 16)
    full = run(pad_text(prompts, cfg.text_len), None)
    compact = run(text, text_lengths)
    torch.testing.assert_close(compact[0], full[0], rtol=0, atol=1e-9)
    torch.testing.assert_close(compact[1], full[1], rtol=0, atol=1e-9)
    scale = max(g.abs().max() for g in full[2].values())
    for k, g in full[2].items():
        torch.testing.assert_close(compact[2][k], g, rtol=0, atol=1e-6 * float(scale), msg=k)
    assert full[2]["text_embedding.2.bias"].abs().max() > 1e-3 * scale  # the zero rows do carry gradient


def test_text_longer_than_text_len_is_rejected():
    model = build_model("tiny")
    batch = random_batch(model.cfg, 1, (9, 4, 4))
    text = torch.zeros(1, model.cfg.text_len + 1, model.cfg.text_dim)
    with pytest.raises(ValueError, match="context must be"):
        _run(model, replace(batch, text=text, text_lengths=torch.tensor([3])))


def test_bad_action_count_is_rejected():
    """4 blocks take any whole number of actions per block (a mixture's embodiments differ: DROID 24, LIBERO 16)."""
    model = build_model("tiny")
    batch = random_batch(model.cfg, 1, (9, 4, 4))
    with pytest.raises(ValueError, match="actions"):
        _run(model, batch, noisy_actions=torch.randn(1, 13, model.cfg.action_dim), t_actions=torch.zeros(1, 13))
    _, actions = _run(
        model, batch, noisy_actions=torch.randn(1, 12, model.cfg.action_dim), t_actions=torch.zeros(1, 12)
    )
    assert actions.shape == (1, 12, model.cfg.action_dim)


def test_bf16_autocast_and_bf16_params():
    """The two precisions the trainer uses: fp32 params under bf16 autocast, and bf16 params (FSDP2)."""
    torch.manual_seed(0)
    model = _nonzero_head(build_model("tiny"))
    batch = random_batch(model.cfg, 1, (9, 4, 4), dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        video, action = _run(model, batch, noisy=batch.latents.clone(), noisy_actions=batch.actions.clone())
    (video.float().square().mean() + action.float().square().mean()).backward()
    assert torch.isfinite(video.float()).all()
    model.to(torch.bfloat16)
    video, _ = _run(model, batch, noisy=batch.latents.clone(), noisy_actions=batch.actions.clone())
    assert video.dtype == torch.bfloat16 and torch.isfinite(video.float()).all()
