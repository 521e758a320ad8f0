"""The open-loop sampler against the reference's scheduler and inference loop, and the action-error arithmetic.

tests/assets/flow_unipc_steps.safetensors holds what the official FlowUniPCMultistepScheduler (dreamzero0/dreamzero
ab790c1, its torch.compile decorators removed and its initial sigmas on the CPU; num_train_timesteps 1000, shift 1,
set_timesteps(16, shift=5.0)) computes in fp32 on CPU: its sigmas and timesteps, and the sample after each step when
driven by the velocity v(x) = tanh(x @ W) - x from `x_init`, evaluated at every step ('every') or on the 8-of-16
step mask with the last velocity reused ('mask8'); W and x_init are stored with them.

`RefUniPC` and `reference_loop` below are written from reading dreamzero0/dreamzero (ab790c1)
groot/vla/model/dreamzero/modules/flow_unipc_multistep_scheduler.py (FlowUniPCMultistepScheduler: __init__,
set_timesteps, convert_model_output, multistep_uni_p_bh_update, multistep_uni_c_bh_update, step) and the denoising
loop of WANPolicyHead.lazy_joint_video_action, keeping their structure (general order, the R/b systems, the step
mask, guidance on the video only), so the sampler's compact order-2 form is checked step by step against them.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ASSETS, tiny_model
from wampipe.train.dit.attention import TokenLayout, dense_mask, flex_block_mask, masked_attention
from wampipe.train.dit.model import build_model, random_batch
from wampipe.train.evaluation.sample import (
    ActionErrors,
    SamplerConfig,
    UniPC,
    action_error,
    sample_actions,
    unipc_schedule,
)

MASK8 = [True, True, True, False, False, False, True, False, False, False, True, False, False, True, True, True]


class RefUniPC:
    """FlowUniPCMultistepScheduler(num_train_timesteps=1000, shift=1, use_dynamic_shifting=False) with its defaults:
    solver_order 2, predict_x0, bh2, lower_order_final, no corrector disabled, final sigma 0."""

    def __init__(self, n: int = 1000, order: int = 2):
        alphas = np.linspace(1, 1 / n, n)[::-1].copy()
        sigmas = torch.from_numpy(1.0 - alphas).to(torch.float32)  # shift 1: unchanged
        self.n, self.solver_order = n, order
        self.sigma_min, self.sigma_max = sigmas[-1].item(), sigmas[0].item()

    def set_timesteps(self, steps: int, shift: float):
        sigmas = np.linspace(self.sigma_max, self.sigma_min, steps + 1).copy()[:-1]
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        timesteps = sigmas * self.n
        self.sigmas = torch.from_numpy(np.concatenate([sigmas, [0]]).astype(np.float32))
        self.timesteps = torch.from_numpy(timesteps).to(torch.int64)
        self.model_outputs: list[Any] = [None] * self.solver_order  # tensors once steps fill them
        self.lower_order_nums, self.last_sample = 0, None

    @staticmethod
    def _alpha_sigma(sigma):
        return 1 - sigma, sigma

    def _lambda(self, idx):
        a, s = self._alpha_sigma(self.sigmas[idx])
        return torch.log(a) - torch.log(s)

    def _rb(self, rks, hh, order):
        h_phi_1 = torch.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        factorial_i, B_h = 1, torch.expm1(hh)
        R, b = [], []
        for i in range(1, order + 1):
            R.append(torch.pow(rks, i - 1))
            b.append(h_phi_k * factorial_i / B_h)
            factorial_i *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial_i
        return torch.stack(R), torch.stack(b), h_phi_1, B_h

    def uni_p(self, sample, order, step_index):
        m0 = self.model_outputs[-1]
        h = self._lambda(step_index + 1) - self._lambda(step_index)
        rks, D1s = [], []
        for i in range(1, order):
            rk = (self._lambda(step_index - i) - self._lambda(step_index)) / h
            rks.append(rk)
            D1s.append((self.model_outputs[-(i + 1)] - m0) / rk)
        rks.append(torch.ones(()))
        R, b, h_phi_1, B_h = self._rb(torch.stack(rks), -h, order)
        alpha_t, sigma_t = self._alpha_sigma(self.sigmas[step_index + 1])
        x_t_ = sigma_t / self.sigmas[step_index] * sample - alpha_t * h_phi_1 * m0
        if not D1s:
            return x_t_
        rhos_p = torch.full((1,), 0.5) if order == 2 else torch.linalg.solve_ex(R[:-1, :-1], b[:-1])[0]
        pred_res = torch.einsum("k,bkc...->bc...", rhos_p, torch.stack(D1s, dim=1))
        return x_t_ - alpha_t * B_h * pred_res

    def uni_c(self, model_t, last_sample, order, step_index):
        m0 = self.model_outputs[-1]
        h = self._lambda(step_index) - self._lambda(step_index - 1)
        rks, D1s = [], []
        for i in range(1, order):
            rk = (self._lambda(step_index - (i + 1)) - self._lambda(step_index - 1)) / h
            rks.append(rk)
            D1s.append((self.model_outputs[-(i + 1)] - m0) / rk)
        rks.append(torch.ones(()))
        R, b, h_phi_1, B_h = self._rb(torch.stack(rks), -h, order)
        rhos_c = torch.full((1,), 0.5) if order == 1 else torch.linalg.solve_ex(R, b)[0]
        alpha_t, sigma_t = self._alpha_sigma(self.sigmas[step_index])
        x_t_ = sigma_t / self.sigmas[step_index - 1] * last_sample - alpha_t * h_phi_1 * m0
        corr_res = torch.einsum("k,bkc...->bc...", rhos_c[:-1], torch.stack(D1s, dim=1)) if D1s else 0
        return x_t_ - alpha_t * B_h * (corr_res + rhos_c[-1] * (model_t - m0))

    def step(self, model_output, sample, step_index):
        x0 = sample - self.sigmas[step_index] * model_output  # convert_model_output, flow_prediction
        if step_index > 0 and self.last_sample is not None:
            sample = self.uni_c(x0, self.last_sample, self.this_order, step_index)
        self.model_outputs = self.model_outputs[1:] + [x0]
        this_order = min(self.solver_order, len(self.timesteps) - step_index)
        self.this_order = min(this_order, self.lower_order_nums + 1)
        self.last_sample = sample
        prev = self.uni_p(sample, self.this_order, step_index)
        self.lower_order_nums = min(self.lower_order_nums + 1, self.solver_order)
        return prev


def reference_loop(model, batch, mask, cfg_scale=5.0, negative=None, seed=1140):
    """lazy_joint_video_action's denoising for one fresh observation (current_start_frame 1 after the frame-0 cache),
    expressed through the teacher-forcing forward: frame 0 clean at t 0, block 1 and the chunk noisy."""
    nfpb, A = model.cfg.num_frame_per_block, model.cfg.num_action_per_block
    z0 = batch.latents[:, :, :1]
    B, C, _, h, w = batch.latents.shape
    noise_obs = torch.randn((1, C, nfpb, h, w), generator=torch.Generator().manual_seed(seed)).expand(B, -1, -1, -1, -1)
    noise_action = torch.randn((1, A, model.cfg.action_dim), generator=torch.Generator().manual_seed(seed)).expand(
        B, -1, -1
    )
    video_sched, action_sched = RefUniPC(), RefUniPC()
    video_sched.set_timesteps(16, shift=5.0)
    action_sched.set_timesteps(16, shift=5.0)
    x, a, states, prev = noise_obs, noise_action, [], None
    for index, t in enumerate(video_sched.timesteps):
        t_v = torch.cat([torch.zeros(B, 1), torch.full((B, nfpb), float(t))], dim=1)
        t_a = torch.full((B, A), float(action_sched.timesteps[index]))
        args = (torch.cat([z0, x], 2), t_v, torch.cat([z0, torch.zeros_like(x)], 2), a, t_a, batch.state[:, :1])
        if mask[index]:
            v_c, a_c = model(*args, batch.text, batch.clip, state_sees_block=True)
            flow = v_c
            if negative is not None:
                v_u, _ = model(*args, negative.expand(B, -1, -1), batch.clip, state_sees_block=True)
                flow = v_u + cfg_scale * (v_c - v_u)
            prev = (flow[:, :, 1:], a_c)
        assert prev is not None  # every mask computes at index 0
        x = video_sched.step(prev[0], x, index)
        a = action_sched.step(prev[1], a, index)
        states.append((x, a))
    return states


KV_ASSET = ASSETS / "official_kv_inference.safetensors"


def kv_check_model():
    """The tiny DiT with CLIP widths the official model accepts (1280 x 257), each tensor seeded by its name."""
    model = build_model("tiny", image_dim=1280, image_len=257)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.05)
    return model.eval()


def kv_check_inputs(cfg, t: int):
    """(latent frame 0, noisy block, noisy actions, state, text, CLIP features) for 2 samples of a 4x4 latent."""
    g = torch.Generator().manual_seed(t)
    nfpb, A = cfg.num_frame_per_block, cfg.num_action_per_block
    return (
        torch.randn(2, cfg.out_dim, 1, 4, 4, generator=g),
        torch.randn(2, cfg.out_dim, nfpb, 4, 4, generator=g),
        torch.randn(2, A, cfg.action_dim, generator=g),
        torch.randn(2, 1, cfg.max_state_dim, generator=g),
        torch.randn(2, cfg.text_len, cfg.text_dim, generator=g),
        torch.randn(2, 257, 1280, generator=g),
    )


@pytest.mark.parametrize("t", [999, 535])
def test_one_block_forward_is_the_official_kv_cache_inference(t):
    """tests/assets/official_kv_inference.safetensors: the official CausalWanModel (ab790c1; fp32 SDPA in place of
    flash-attention on CPU, ATTENTION_BACKEND=torch) given `kv_check_model`'s weights strictly, run as
    lazy_joint_video_action does: latent frame 0 alone at timestep 0 with the KV cache kept
    (current_start_frame 0), then the noisy block, actions and state at timestep t (current_start_frame 1)."""
    model = kv_check_model()
    cfg, ref = model.cfg, load_file(KV_ASSET)
    z0, x, a, state, text, clip = kv_check_inputs(cfg, t)
    t_frames = torch.cat([torch.zeros(2, 1), torch.full((2, cfg.num_frame_per_block), float(t))], 1)
    args = (
        torch.cat([z0, x], 2),
        t_frames,
        torch.cat([z0, torch.zeros_like(x)], 2),
        a,
        torch.full((2, cfg.num_action_per_block), float(t)),
        state,
        text,
        clip,
    )
    with torch.no_grad():
        video, actions = model(*args, state_sees_block=True)
        _, trained = model(*args)
    torch.testing.assert_close(video[:, :, 1:], ref[f"t{t}.video"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actions, ref[f"t{t}.actions"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(trained, ref[f"t{t}.actions"], rtol=1e-5, atol=1e-5)  # the training mask differs


@pytest.fixture(scope="module")
def model_and_batch():
    model = tiny_model().double()
    batch = random_batch(model.cfg, 2, (5, 4, 6), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return model, batch


ASSET = ASSETS / "flow_unipc_steps.safetensors"


def _transcription() -> RefUniPC:
    ref = RefUniPC()
    ref.set_timesteps(16, shift=5.0)
    return ref


@pytest.mark.parametrize("name,mask", [("every", [True] * 16), ("mask8", MASK8)])
@pytest.mark.parametrize("solver", ["ours", "transcription"])
def test_scheduler_steps_equal_the_official_schedulers(name, mask, solver):
    """Ours, and the transcription the loop test below relies on."""
    ref = load_file(ASSET)
    sigmas, timesteps = unipc_schedule(16, 5.0)
    assert torch.equal(sigmas, ref["sigmas"]) and torch.equal(timesteps, ref["timesteps"])
    solver, x = UniPC(sigmas) if solver == "ours" else _transcription(), ref["x_init"]
    for i, run in enumerate(mask):
        if run:
            v = torch.tanh(x @ ref["W"]) - x
        x = solver.step(v, x, i)
        torch.testing.assert_close(x, ref[f"{name}.states"][i], rtol=1e-6, atol=1e-6, msg=f"step {i}")


def test_schedule_is_the_references():
    ref = RefUniPC()
    ref.set_timesteps(16, shift=5.0)
    sigmas, timesteps = unipc_schedule(16, 5.0)
    assert torch.equal(sigmas, ref.sigmas) and torch.equal(timesteps, ref.timesteps)
    assert timesteps[0] == 999 and sigmas[-1] == 0 and sigmas.dtype == torch.float32


@pytest.mark.parametrize("dit_steps,guided", [(16, False), (8, False), (8, True)])
def test_every_step_equals_the_reference_loop(model_and_batch, dit_steps, guided):
    model, batch = model_and_batch
    negative = torch.randn(1, model.cfg.text_len, model.cfg.text_dim, dtype=torch.float64) if guided else None
    mask = [True] * 16 if dit_steps == 16 else MASK8
    want = reference_loop(model, batch, mask, negative=negative)
    got = []
    sample_actions(model, batch, SamplerConfig(dit_steps=dit_steps), negative_text=negative, trace=got)
    assert len(got) == 16
    for i, ((v, a), (v_ref, a_ref)) in enumerate(zip(got, want)):
        assert torch.allclose(v, v_ref, rtol=1e-6, atol=1e-6), f"video, step {i}"
        assert torch.allclose(a, a_ref, rtol=1e-6, atol=1e-6), f"actions, step {i}"
    assert got[-1][1].abs().max() > 0  # a non-trivial chunk


def test_sampling_attention_is_the_kv_cache_inferences():
    """The reference's inference caches clean frame 0 (computed alone), then every token of the new block (noisy
    video, actions, states) attends to the cache and to all new tokens. The one-block teacher-forcing layout with
    state_sees_block does the same on those tokens, and none of them sees the layout's extra clean block or noisy
    frame 0."""
    cfg = tiny_model().cfg
    fs, nfpb = 4, cfg.num_frame_per_block
    layout = replace(cfg.layout(1 + nfpb, fs), state_sees_block=True)
    video = (1 + nfpb) * fs
    frame0, block = list(range(fs)), list(range(video + fs, 2 * video))
    register = list(range(2 * video, layout.seq_len))
    new = block + register
    mask = dense_mask(layout)
    want = torch.zeros_like(mask)
    want[torch.tensor(frame0)[:, None], torch.tensor(frame0)] = True
    want[torch.tensor(new)[:, None], torch.tensor(frame0 + new)] = True
    kept = torch.tensor(frame0 + new)
    assert torch.equal(mask[kept][:, kept], want[kept][:, kept])
    assert not mask[kept][:, [i for i in range(layout.seq_len) if i not in set(kept.tolist())]].any()
    training = dense_mask(cfg.layout(1 + nfpb, fs))
    states = torch.tensor(register[-cfg.num_state_per_block :])
    assert torch.equal(training[kept[:, None], kept][:-1], mask[kept[:, None], kept][:-1])  # all but the state row
    assert training[states].sum() == cfg.num_state_per_block < mask[states].sum()


@pytest.mark.parametrize("lookup", [True, False])
def test_sampling_attention_through_flex_equals_dense(lookup):
    """The GPU's FlexAttention masks (a dense lookup, or the expression) carry state_sees_block too."""
    layout = TokenLayout(3, 4, 2, 4, 1, 9, state_sees_block=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, layout.seq_len, 16, generator=g) for _ in range(3))
    out = masked_attention(q, k, v, flex_block_mask(layout, "cpu", lookup=lookup, block_size=16))
    torch.testing.assert_close(out, masked_attention(q, k, v, dense_mask(layout)), atol=1e-5, rtol=1e-5)
    training = masked_attention(q, k, v, dense_mask(replace(layout, state_sees_block=False)))
    assert not torch.allclose(out, training, atol=1e-3)


def test_only_the_observation_conditions_the_chunk(model_and_batch):
    """Recorded actions and the latent frames after frame 0 (the future) never reach the sampled chunk."""
    model, batch = model_and_batch
    base = sample_actions(model, batch)
    future = random_batch(model.cfg, 2, (5, 4, 6), dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    batch2 = type(batch)(**{**vars(batch), "actions": future.actions})
    batch2.latents = torch.cat([batch.latents[:, :, :1], future.latents[:, :, 1:]], dim=2)
    assert torch.equal(sample_actions(model, batch2), base)
    batch3 = type(batch)(**{**vars(batch), "latents": future.latents})
    assert not torch.allclose(sample_actions(model, batch3), base)


def test_action_error_is_the_masked_mean_per_dim():
    pred = torch.tensor([[[0.5, 0.0, 9.0], [1.0, -1.0, 9.0]], [[0.0, 0.5, 9.0], [-0.5, 0.0, 9.0]]])
    target = torch.zeros(2, 2, 3)
    mask = torch.tensor([[[1, 1, 0], [1, 0, 0]], [[0, 1, 0], [1, 1, 0]]], dtype=torch.bool)
    q01, q99 = np.array([0.0, -2.0]), np.array([2.0, 2.0])  # raw = (x + 1) / 2 · span + q01: scale 1 and 2
    errors = ActionErrors(2)
    errors.add(pred, target, mask, q01, q99)
    r = errors.report()
    # dim 0 counts (0,0)=.25, (0,1)=1, (1,1)=.25; dim 1 counts (0,0)=0, (1,0)=.25, (1,1)=0
    assert r["chunk"]["per_dim"] == pytest.approx([1.5 / 3, 0.25 / 3])
    assert r["chunk_raw"]["per_dim"] == pytest.approx([1.5 / 3, 4 * 0.25 / 3])
    assert r["chunk"]["mean"] == pytest.approx((0.5 + 0.25 / 3) / 2)
    assert r["first"]["per_dim"] == pytest.approx([0.25, 0.25 / 2])  # first action: dim 0 only sample 0 counts
    assert r["first_raw"]["per_dim"] == pytest.approx([0.25, 4 * 0.25 / 2])


def test_a_dim_without_valid_entries_has_no_error():
    errors = ActionErrors(2)
    errors.add(
        torch.ones(1, 2, 2),
        torch.zeros(1, 2, 2),
        torch.tensor([[[1, 0], [1, 0]]], dtype=torch.bool),
        np.zeros(2),
        np.ones(2),
    )
    assert errors.report()["chunk"] == {"per_dim": [1.0, None], "mean": 1.0}


def test_action_error_weights_out_padding_samples(model_and_batch):
    model, batch = model_and_batch
    q01, q99 = np.full(7, -1.0), np.full(7, 1.0)
    inputs = {k: v for k, v in vars(batch).items() if v is not None}
    both = action_error(model, [inputs], q01, q99).report()
    one = action_error(model, [{**inputs, "weight": torch.tensor([True, False])}], q01, q99).report()
    first = {k: (v[:1] if torch.is_tensor(v) else v) for k, v in inputs.items()}
    alone = action_error(model, [first], q01, q99).report()

    def flat(report):
        return [v for part in report.values() for v in part["per_dim"] + [part["mean"]]]

    assert flat(one) == pytest.approx(flat(alone), rel=1e-9) and flat(one) != pytest.approx(flat(both), rel=1e-3)
