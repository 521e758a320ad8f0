"""Open-loop sampling of the action chunk and its error against the recorded actions
(docs/EVALUATION.md#6-open-loop-action-error; the reference's procedure:
docs/REFERENCE.md#13-open-loop-inference-and-action-error).

`sample_actions` runs DreamZero's inference for one observation: the clean first latent frame is the context, the
first causal block's video latents and its action chunk are denoised jointly from seeded Gaussian noise by two
flow UniPC multistep schedulers (16 steps, shift 5, order 2, B(h) = e^h - 1, the last step first order), the DiT
evaluated on the reference's step mask and its last prediction reused in between, the state token attending to the
whole block as in the reference's cached inference; classifier-free guidance (scale 5) steers the video only, and
only when a negative-prompt embedding is given. `action_error` turns sampled chunks into
per-dimension MSE over the real (masked) action dims, in q99-normalised and in raw units; `ActionProbe` is the
trainer's periodic version of it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.distributed as dist

from wampipe.shardformat.index import ShardIndex
from wampipe.shardformat.stats import unnormalize_q99
from wampipe.train.data import SampleReader, check_alongside, collate, set_names
from wampipe.train.dit.model import CausalWanModel, DiTBatch, DiTConfig

# The reference's DiT step masks by NUM_DIT_STEPS (its default 8): at a False step the last prediction is reused.
DIT_STEP_MASKS = {
    5: "TTTFFFFTFFFFTFFF",
    6: "TTFFFTFFFFTFFFTT",
    7: "TTTFFFTFFFTFFFTT",
    8: "TTTFFFTFFFTFFTTT",
    16: "T" * 16,
}


@dataclass(frozen=True)
class SamplerConfig:
    """Open-loop sampler settings; the defaults are the reference's."""

    steps: int = 16
    """Denoising steps (UniPC)."""
    shift: float = 5.0
    """Timestep shift of the sampling schedule."""
    num_train_timesteps: int = 1000
    """Timesteps the model was trained on (its timestep input is 1000·σ)."""
    dit_steps: int = 8
    """DiT evaluations among the 16 steps, on the reference's mask (5, 6, 7, 8; 16 = every step)."""
    cfg_scale: float = 5.0
    """Classifier-free guidance of the video prediction; applied only with a negative-prompt embedding."""
    seed: int = 1140
    """Seed of the initial noise; every sample starts from the same noise, as the reference's one-sample calls do."""
    state_sees_block: bool = True
    """State tokens attend to the whole block, as in the reference's KV-cache inference; False: only to their
    block's states, as in training."""

    def step_mask(self) -> list[bool]:
        if self.dit_steps == self.steps:
            return [True] * self.steps
        if self.steps != 16 or self.dit_steps not in DIT_STEP_MASKS:
            raise ValueError(
                f"--sampler.dit-steps {self.dit_steps}: with {self.steps} steps choose {self.steps}"
                + (f" or one of {sorted(DIT_STEP_MASKS)}" if self.steps == 16 else "")
            )
        return [c == "T" for c in DIT_STEP_MASKS[self.dit_steps]]


def unipc_schedule(steps: int, shift: float, num_train_timesteps: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """(σ [steps + 1] fp32 ending at 0, integer model timesteps [steps]): `steps` points from the training grid's
    largest σ (1 − 1/N, stored in fp32) down to 0, shifted σ' = sσ/(1 + (s−1)σ), timesteps truncated to integers."""
    sigma_max = float(np.float32(1 - 1 / num_train_timesteps))
    s = np.linspace(sigma_max, 0.0, steps + 1)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    timesteps = torch.from_numpy(s * num_train_timesteps).to(torch.int64)
    return torch.from_numpy(np.append(s, 0.0).astype(np.float32)), timesteps


def _lam(sigma: torch.Tensor) -> torch.Tensor:
    """log-SNR λ = log α − log σ of the flow path x_σ = (1−σ)x0 + σε."""
    return torch.log(1 - sigma) - torch.log(sigma)


class UniPC:
    """Flow UniPC multistep, order 2, data prediction, B(h) = e^h − 1, lower order at the last step, corrector at every
    step but the first. `step` takes the velocity prediction at σ_i and returns the sample at σ_{i+1}."""

    def __init__(self, sigmas: torch.Tensor):
        self.sigmas = sigmas
        self.x0 = []  # data predictions of the last two steps, newest last
        self.last_sample = None
        self.order = 0  # the predictor's order at the previous step

    def step(self, velocity: torch.Tensor, sample: torch.Tensor, i: int) -> torch.Tensor:
        sig = self.sigmas
        x0 = sample - sig[i] * velocity
        if self.last_sample is not None:  # UniC: correct the previous predictor's result with this prediction
            m0 = self.x0[-1]
            h, a_t, hphi = self._h(i - 1, i)
            x_pre = sig[i] / sig[i - 1] * self.last_sample - a_t * hphi * m0
            if self.order == 1:
                sample = x_pre - a_t * hphi * 0.5 * (x0 - m0)
            else:
                rk = (_lam(sig[i - 2]) - _lam(sig[i - 1])) / h
                rho = _corrector_weights(rk, -h, hphi)
                sample = x_pre - a_t * hphi * (rho[0] * (self.x0[-2] - m0) / rk + rho[1] * (x0 - m0))
        self.x0 = (self.x0 + [x0])[-2:]
        self.order = min(2, len(sig) - 1 - i, len(self.x0))
        self.last_sample = sample
        h, a_t, hphi = self._h(i, i + 1)
        out = sig[i + 1] / sig[i] * sample - a_t * hphi * x0
        if self.order == 2:  # UniP-2: ρ = 1/2 on the divided difference of the last two data predictions
            rk = (_lam(sig[i - 1]) - _lam(sig[i])) / h
            out = out - a_t * hphi * 0.5 * (self.x0[-2] - x0) / rk
        return out

    def _h(self, s: int, t: int):
        """(h = λ_t − λ_s, α_t, e^{−h} − 1) between grid points s and t."""
        h = _lam(self.sigmas[t]) - _lam(self.sigmas[s])
        return h, 1 - self.sigmas[t], torch.expm1(-h)


def _corrector_weights(rk: torch.Tensor, hh: torch.Tensor, hphi: torch.Tensor) -> torch.Tensor:
    """ρ of the order-2 UniC update: solve [[1, 1], [r_k, 1]] ρ = (φ_2, 2·φ_3) / B(h), with the h-scaled φ functions
    φ_2 = (e^hh − 1)/hh − 1 and φ_3 = φ_2/hh − 1/2, hh = −h."""
    one = torch.ones_like(rk)
    phi2 = hphi / hh - 1
    phi3 = phi2 / hh - 0.5
    return torch.linalg.solve(
        torch.stack([torch.stack([one, one]), torch.stack([rk, one])]), torch.stack([phi2 / hphi, 2 * phi3 / hphi])
    )


def first_block(batch: DiTBatch, nfpb: int, num_state_per_block: int) -> tuple[DiTBatch, int]:
    """The inputs of the first chunk (latent frame 0 + one block, its states and actions), latents cropped to even
    height/width (the patch conv never reads the odd row); returns it with the chunk's action count."""
    blocks = (batch.latents.shape[2] - 1) // nfpb
    horizon = batch.actions.shape[1] // blocks
    h, w = (n - n % 2 for n in batch.latents.shape[-2:])
    frames = slice(0, 1 + nfpb)
    y = None if batch.y is None else batch.y[:, :, frames, :h, :w]
    return DiTBatch(
        latents=batch.latents[:, :, frames, :h, :w],
        clip=batch.clip,
        text=batch.text,
        state=batch.state[:, :num_state_per_block],
        actions=batch.actions[:, :horizon],
        action_mask=batch.action_mask[:, :horizon],
        has_real_action=batch.has_real_action,
        y=y,
        text_lengths=batch.text_lengths,
    ), horizon


def initial_noise(shape: tuple[int, ...], seed: int, device) -> torch.Tensor:
    """Gaussian noise of `shape` from a generator seeded with `seed` (the reference seeds one per tensor)."""
    return torch.randn(shape, generator=torch.Generator(device).manual_seed(seed), device=device)


@torch.no_grad()
def sample_actions(
    model: CausalWanModel,
    batch: DiTBatch,
    cfg: SamplerConfig = SamplerConfig(),
    negative_text: torch.Tensor | None = None,
    trace: list | None = None,
) -> torch.Tensor:
    """The first chunk's q99-normalised actions [B, A, action_dim] sampled for each observation of `batch` (latent
    frame 0, CLIP features, prompt, first state). `negative_text` [B or 1, text_len, text_dim] turns guidance on.
    `trace`, when a list, receives (video, actions) after every step."""
    mcfg = model.cfg
    nfpb = mcfg.num_frame_per_block
    first, horizon = first_block(batch, nfpb, mcfg.num_state_per_block)
    dtype = torch.promote_types(first.latents.dtype, torch.float32)  # the solver's state: fp32 at least
    z = first.latents.to(dtype)
    B, C, _, h, w = z.shape
    dev = z.device
    context = z[:, :, :1]
    # the clean stream beyond frame 0 is masked from the noisy block; zeros make that evident
    clean = torch.cat([context, torch.zeros_like(z[:, :, 1:])], dim=2)
    video = initial_noise((1, C, nfpb, h, w), cfg.seed, dev).to(dtype).expand(B, -1, -1, -1, -1)
    actions = initial_noise((1, horizon, mcfg.action_dim), cfg.seed, dev).to(dtype).expand(B, -1, -1)
    sigmas, timesteps = unipc_schedule(cfg.steps, cfg.shift, cfg.num_train_timesteps)
    sigmas = sigmas.to(dev)
    video_solver, action_solver = UniPC(sigmas), UniPC(sigmas)
    guided = negative_text is not None and cfg.cfg_scale != 1.0
    zero = torch.zeros(B, 1, device=dev, dtype=dtype)

    def predict(t: float, text, text_lengths):
        t_frames = torch.cat([zero, torch.full((B, nfpb), t, device=dev, dtype=dtype)], dim=1)
        t_actions = torch.full((B, horizon), t, device=dev, dtype=dtype)
        v, a = model(
            torch.cat([context, video], dim=2),
            t_frames,
            clean,
            actions,
            t_actions,
            first.state,
            text,
            first.clip,
            first.y,
            text_lengths,
            state_sees_block=cfg.state_sees_block,
        )
        return v[:, :, 1:].to(dtype), a.to(dtype)

    for i, (t, run) in enumerate(zip(timesteps.tolist(), cfg.step_mask())):
        if run:  # else the reference steps again with the last prediction
            v, a = predict(float(t), first.text, first.text_lengths)
            if guided:
                assert negative_text is not None  # guided only with one
                v_neg, _ = predict(float(t), negative_text.expand(B, -1, -1), None)
                v = v_neg + cfg.cfg_scale * (v - v_neg)
        video = video_solver.step(v, video, i)
        actions = action_solver.step(a, actions, i)
        if trace is not None:
            trace.append((video, actions))
    return actions


@dataclass
class ActionErrors:
    """Sums of squared action errors per dim (normalised and raw), first action and whole chunk, with counts."""

    dims: int
    sums: torch.Tensor = field(init=False)  # [4, dims]: chunk norm, chunk raw, first norm, first raw
    counts: torch.Tensor = field(init=False)  # [2, dims]: chunk, first

    def __post_init__(self):
        self.sums = torch.zeros(4, self.dims, dtype=torch.float64)
        self.counts = torch.zeros(2, self.dims, dtype=torch.float64)

    def add(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, q01, q99) -> None:
        """pred, target: normalised [B, A, ≥dims]; mask: bool, the entries that count."""
        pred, target = pred[..., : self.dims].double().cpu(), target[..., : self.dims].double().cpu()
        mask = mask[..., : self.dims].double().cpu()
        raw = (unnormalize_q99(pred, q01, q99) - unnormalize_q99(target, q01, q99)).pow(2)
        norm = (pred - target).pow(2)
        for k, sl in enumerate((slice(None), slice(0, 1))):
            m = mask[:, sl]
            self.sums[2 * k] += (norm[:, sl] * m).sum((0, 1))
            self.sums[2 * k + 1] += (raw[:, sl] * m).sum((0, 1))
            self.counts[k] += m.sum((0, 1))

    def all_reduce(self) -> None:
        if dist.is_initialized():
            both = torch.cat([self.sums, self.counts]).to(_collective_device())
            dist.all_reduce(both)
            self.sums, self.counts = both[:4].double().cpu(), both[4:].double().cpu()

    def report(self) -> dict:
        """Per-dim MSE (None where a dim had no valid entry) and the mean over dims that had one."""
        out = {}
        for k, part in enumerate(("chunk", "first")):
            for j, unit in enumerate(("", "_raw")):
                mse = self.sums[2 * k + j] / self.counts[k]
                valid = self.counts[k] > 0
                out[f"{part}{unit}"] = {
                    "per_dim": [float(v) if ok else None for v, ok in zip(mse, valid)],
                    "mean": float(mse[valid].mean()) if valid.any() else None,
                }
        return out


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def action_error(
    model: CausalWanModel,
    batches,
    q01,
    q99,
    cfg: SamplerConfig = SamplerConfig(),
    negative_text: torch.Tensor | None = None,
    on_sample=None,
) -> ActionErrors:
    """Sampled first chunks of `batches` (dicts of model inputs; an optional bool `weight` [B] leaves samples out)
    against their recorded actions. Collective when a process group is up: the sums are all-reduced.
    `on_sample(pred, target, mask)` sees each batch's normalised chunks."""
    errors = ActionErrors(len(q01))
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            inputs = DiTBatch(**{f.name: batch[f.name] for f in fields(DiTBatch) if f.name in batch})
            pred = sample_actions(model, inputs, cfg, negative_text)
            target, mask = inputs.actions[:, : pred.shape[1]], inputs.action_mask[:, : pred.shape[1]]
            if "weight" in batch:
                mask = mask & batch["weight"].to(mask.device)[:, None, None]
            errors.add(pred, target, mask, q01, q99)
            if on_sample is not None:
                on_sample(pred, target, mask)
    finally:
        model.train(was_training)
    errors.all_reduce()
    return errors


def eval_batches(
    index,
    model_cfg: DiTConfig,
    samples: int,
    batch_size: int,
    device,
    start: int = 0,
    stride: int = 1,
    count: int | None = None,
):
    """Batches of the windows start, start + stride, ... (the first variant, a prompt column from a fixed seed),
    `count` of them taken cyclically from the first `samples` (default: each once); a `weight` per sample is False
    on the repeats, so every rank can make the same number of calls."""
    samples = min(samples, len(index.windows))
    picks = list(range(start, samples, stride)) if count is None else [start + stride * j for j in range(count)]
    reader, rng = SampleReader(index, model_cfg), np.random.default_rng(0)
    try:
        for i in range(0, len(picks), batch_size):
            chunk = picks[i : i + batch_size]
            batch = collate(
                [reader.sample(index.windows[j % samples], rng, variant=0) for j in chunk], model_cfg.text_len
            )
            batch["weight"] = torch.tensor([j < samples for j in chunk])
            yield {k: v.to(device) for k, v in batch.items()}
    finally:
        reader.close()


class ActionProbe:
    """The trainer's periodic open-loop action error (--metrics.action-interval): the first `samples` windows of each
    probed shard directory, split over the ranks, sampled with the model being trained. Collective."""

    def __init__(
        self,
        dirs: list[str],
        model_cfg: DiTConfig,
        samples: int,
        rank: int,
        world: int,
        device,
        image_encoder=None,
        batch_size: int = 4,
        cache_dir: str | None = None,
        run_indexes=None,
    ):
        """`run_indexes`: the training sets' indexes, which each probed directory must be built like (checked
        here, at start)."""
        from wampipe.train.config import ShardSet

        self.names = set_names([ShardSet(d) for d in dirs])
        self.indexes = [ShardIndex(d, cache_dir) for d in dirs]
        for index in self.indexes:
            check_alongside(index, run_indexes or self.indexes, "an action-evaluation set")
        self.model_cfg, self.samples, self.batch_size = model_cfg, samples, batch_size
        self.rank, self.world, self.device, self.image_encoder = rank, world, device, image_encoder

    @classmethod
    def from_config(cls, cfg, model_cfg: DiTConfig, rank: int, world: int, device, indexes, image_encoder=None):
        """None when --metrics.action-interval is 0; else on --metrics.action-shards (default: each set's validation
        split, else the set; `indexes`: the run's open set indexes, which name the splits)."""
        from wampipe.train.evaluation.validation import val_dir

        m = cfg.metrics
        if not m.action_interval:
            return None
        sets = [str(s.shards) for s in cfg.data.sets()]
        dirs = list(m.action_shards) or [val_dir(s, index) or s for s, index in zip(sets, indexes)]
        return cls(
            dirs,
            model_cfg,
            m.action_samples,
            rank,
            world,
            device,
            image_encoder,
            run_indexes=indexes,
            cache_dir=cfg.data.cache_dir,
        )

    def _batches(self, index):
        per_rank = math.ceil(min(self.samples, len(index.windows)) / self.world)
        for batch in eval_batches(
            index,
            self.model_cfg,
            self.samples,
            self.batch_size,
            self.device,
            start=self.rank,
            stride=self.world,
            count=per_rank,
        ):
            if self.image_encoder is not None:  # shards of CLIP's input pixels, as the training step encodes them
                batch["clip"] = self.image_encoder.encode_pixels(batch.pop("clip_pixels")).to(torch.bfloat16)
            yield batch

    def __call__(self, model: CausalWanModel, step: int) -> dict:
        """{'step', 'action_mse/<set>', 'action_mse_raw/<set>', 'action_s'}: the chunk's MSE averaged over the real
        dims, and the seconds it took."""
        started = time.perf_counter()
        row = {"step": step}
        for name, index in zip(self.names, self.indexes):
            report = action_error(model, self._batches(index), index.q01["action"], index.q99["action"]).report()
            row[f"action_mse/{name}"] = report["chunk"]["mean"]
            row[f"action_mse_raw/{name}"] = report["chunk_raw"]["mean"]
        return row | {"action_s": time.perf_counter() - started}
