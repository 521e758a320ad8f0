"""Flow-matching schedule, timestep sampling and loss (docs/REFERENCE.md#9-flow-matching-loss-and-schedule)."""

import math

import torch

from wampipe.train.dit.loss import FlowMatchScheduler, LossConfig, action_ids, flow_matching_loss, sample_timestep_ids
from wampipe.train.dit.model import build_model, random_batch


def test_schedule_values():
    s = FlowMatchScheduler()
    assert s.sigmas.shape == (1000,)
    i = torch.arange(1000, dtype=torch.float64)
    si = 1 - i / 1000
    torch.testing.assert_close(s.sigmas.double(), 5 * si / (1 + 4 * si), atol=1e-6, rtol=1e-6)
    assert s.timesteps[0] == 1000 and abs(s.timesteps[-1].item() - 4.98) < 5e-3
    assert abs(s.weights.double().mean().item() - 1) < 1e-5
    assert s.weights[0] == 0  # σ = 1 carries no weight
    peak = s.weights.argmax()
    assert abs(s.weights.max().item() - 2.08) < 0.01 and abs(s.timesteps[peak].item() - 500) < 3
    assert abs(s.weights[-1].item() - 0.03) < 0.005  # σ ≈ 0.005


def test_timestep_ids_share_per_block_and_couple_actions():
    ids = sample_timestep_ids(64, 9, 2, torch.Generator().manual_seed(0), num_timesteps=1000)
    assert ids.shape == (64, 9) and ids.min() >= 0 and ids.max() <= 999
    assert torch.equal(ids[:, 2::2], ids[:, 1::2])
    assert (ids[:, 0] != ids[:, 1]).any()  # frame 0 keeps its own id
    assert (ids[:, 1] != ids[:, 3]).any()
    a = action_ids(ids, 2, 16)
    assert a.shape == (64, 64)
    for k in range(4):
        assert torch.equal(a[:, 16 * k : 16 * (k + 1)], ids[:, 1 + 2 * k, None].expand(64, 16))


def test_timestep_distribution():
    s = FlowMatchScheduler()
    ids = sample_timestep_ids(20000, 9, 2, torch.Generator().manual_seed(1), num_timesteps=1000)
    sig = s.sigmas[ids[:, ::2]]
    assert abs(sig.mean().item() - 0.748) < 0.005
    assert abs((sig > 0.5).double().mean().item() - 0.834) < 0.005


def _loss_by_hand(model, batch, sched, seed, ids, cfg):
    """The reference loss written out for one call with the same random stream as flow_matching_loss."""
    g = torch.Generator().manual_seed(seed)
    z, a = batch.latents, batch.actions
    aid = action_ids(ids, 2, model.cfg.num_action_per_block)
    sf, sa = sched.sigmas[ids].float(), sched.sigmas[aid].float()
    eps = torch.randn(z.shape, generator=g)
    eps_a = torch.randn(a.shape, generator=g)
    zt = (1 - sf[:, None, :, None, None]) * z + sf[:, None, :, None, None] * eps
    at = (1 - sa[..., None]) * a + sa[..., None] * eps_a
    v, av = model(
        zt, sched.timesteps[ids].float(), z, at, sched.timesteps[aid].float(), batch.state, batch.text, batch.clip
    )
    w = sched.weights.float()
    l_dyn = sum(
        w[ids[b, f]] * ((v[b, :, f] - (eps - z)[b, :, f]) ** 2).mean()
        for b in range(z.shape[0])
        for f in range(z.shape[2])
    ) / (z.shape[0] * z.shape[2])
    err = ((av - (eps_a - a)) ** 2) * batch.action_mask * batch.has_real_action[:, None, None]
    dims = 32 if cfg.action_loss_over_all_dims else batch.action_mask.sum(-1)
    l_act = (w[aid] * err.sum(-1) / dims).mean()
    return l_dyn, l_act


def test_loss_matches_spec_formula_and_quirk():
    torch.manual_seed(0)
    model = build_model("tiny", action_dim=32)
    with torch.no_grad():
        model.head.head.weight.normal_(0, 0.05)
    batch = random_batch(model.cfg, 2, (9, 4, 4), generator=torch.Generator().manual_seed(0), real_action_dims=7)
    sched = FlowMatchScheduler()
    ids = sample_timestep_ids(2, 9, 2, torch.Generator().manual_seed(3), num_timesteps=1000)
    with torch.no_grad():
        for cfg in (LossConfig(), LossConfig(action_loss_over_all_dims=False)):
            loss, terms = flow_matching_loss(model, batch, sched, cfg, torch.Generator().manual_seed(7), ids)
            l_dyn, l_act = _loss_by_hand(model, batch, sched, 7, ids, cfg)
            torch.testing.assert_close(terms["loss_dynamics"], torch.as_tensor(l_dyn).float(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(terms["loss_action"], torch.as_tensor(l_act).float(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(loss, terms["loss_dynamics"] + terms["loss_action"])
        quirk = flow_matching_loss(model, batch, sched, LossConfig(), torch.Generator().manual_seed(7), ids)[1]
        fixed = flow_matching_loss(
            model, batch, sched, LossConfig(action_loss_over_all_dims=False), torch.Generator().manual_seed(7), ids
        )[1]
        assert math.isclose(quirk["loss_action"].item() / fixed["loss_action"].item(), 7 / 32, rel_tol=1e-5)
        batch.has_real_action[0] = False  # per-sample multiplier (the official broadcast needs B == 1)
        half = flow_matching_loss(model, batch, sched, LossConfig(), torch.Generator().manual_seed(7), ids)[1]
        assert 0 < half["loss_action"] < quirk["loss_action"]


def test_odd_height_target_is_cropped():
    torch.manual_seed(0)
    model = build_model("tiny")
    batch = random_batch(model.cfg, 1, (9, 5, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss, _ = flow_matching_loss(model, batch, FlowMatchScheduler(), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)


def test_tiny_model_overfits_one_batch():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention on a shared CI box
    try:
        torch.manual_seed(0)
        model = build_model("tiny")
        batch = random_batch(model.cfg, 1, (9, 4, 4), generator=torch.Generator().manual_seed(0))
        sched = FlowMatchScheduler()
        ids = sample_timestep_ids(1, 9, 2, torch.Generator().manual_seed(1), num_timesteps=1000)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(60):
            noise = torch.Generator().manual_seed(123)  # one fixed batch: same noise and timesteps every step
            loss, _ = flow_matching_loss(model, batch, sched, generator=noise, frame_ids=ids)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[-1] < losses[0] / 10, losses[::10]
