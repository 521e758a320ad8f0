"""DreamZero's flow-matching objective (docs/REFERENCE.md#9-flow-matching-loss-and-schedule) on precomputed inputs.

Reference quirks kept by default (switch them off through `LossConfig`):
* the action loss is divided by all 32 padded action dims, not by the real ones (LIBERO: scale 7/32);
* noise is drawn in the dtype of the inputs (bf16 latents → bf16 Gaussian), as `randn_like` does there.
Fixed by design: `has_real_action` is a per-sample multiplier (the official code's broadcast only runs at 1
sample/GPU).
"""

from __future__ import annotations

import torch

from wampipe.train.config import LossConfig
from wampipe.train.dit.model import CausalWanModel, DiTBatch


class FlowMatchScheduler:
    """FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True).set_timesteps(steps, training=True)."""

    def __init__(
        self, num_train_timesteps: int = 1000, shift: float = 5.0, sigma_max: float = 1.0, sigma_min: float = 0.0
    ):
        n = num_train_timesteps
        s = torch.linspace(sigma_max, sigma_min, n + 1, dtype=torch.float32)[:-1]  # extra_one_step; fp32 as upstream
        self.sigmas = shift * s / (1 + (shift - 1) * s)
        self.timesteps = self.sigmas * n
        bell = torch.exp(-2 * ((self.timesteps - n / 2) / n) ** 2)
        bell = bell - bell.min()
        self.weights = bell * (n / bell.sum())  # mean 1, 0 at σ = 1, peak ≈ 2.08 at t ≈ 500
        self.num_train_timesteps = n

    def to(self, device) -> "FlowMatchScheduler":
        self.sigmas, self.timesteps, self.weights = (t.to(device) for t in (self.sigmas, self.timesteps, self.weights))
        return self


def sample_timestep_ids(
    batch: int,
    num_frames: int,
    num_frame_per_block: int,
    generator: torch.Generator | None = None,
    device=None,
    *,
    num_timesteps: int,
) -> torch.Tensor:
    """ids [B, F] ~ U{0..num_timesteps - 1}, `num_timesteps` being the scheduler's (`--loss.num-train-timesteps`);
    frames of a block share the id of its first frame, frame 0 keeps its own."""
    ids = torch.randint(0, num_timesteps, (batch, num_frames), generator=generator, device=device)
    first = ids[:, 1::num_frame_per_block]  # first frame of each block
    ids[:, 1:] = first.repeat_interleave(num_frame_per_block, dim=1)[:, : num_frames - 1]
    return ids


def action_ids(frame_ids: torch.Tensor, num_frame_per_block: int, num_action_per_block: int) -> torch.Tensor:
    """Actions coupled to their block: chunk k uses block k's id → [B, K·A]."""
    return frame_ids[:, 1::num_frame_per_block].repeat_interleave(num_action_per_block, dim=1)


def flow_matching_loss(
    model: CausalWanModel,
    batch: DiTBatch,
    scheduler: FlowMatchScheduler,
    cfg: LossConfig = LossConfig(),
    generator: torch.Generator | None = None,
    frame_ids: torch.Tensor | None = None,
):
    """One training loss (timesteps, noise, forward, weighted MSE). Returns (loss, dict of detached terms)."""
    mcfg = model.cfg
    z, a = batch.latents, batch.actions
    B, nf = z.shape[0], z.shape[2]
    dev = z.device
    if frame_ids is None:
        frame_ids = sample_timestep_ids(
            B, nf, mcfg.num_frame_per_block, generator, dev, num_timesteps=scheduler.num_train_timesteps
        )
    blocks = (nf - 1) // mcfg.num_frame_per_block
    a_ids = action_ids(frame_ids, mcfg.num_frame_per_block, max(1, a.shape[1] // max(1, blocks)))  # the batch's horizon
    if a_ids.shape[1] != a.shape[1]:
        raise ValueError(f"{nf} latent frames = {blocks} blocks, batch has {a.shape[1]} action tokens (not a multiple)")

    sig = scheduler.sigmas.to(dev)
    sigma_f = sig[frame_ids].to(z.dtype)[:, None, :, None, None]
    sigma_a = sig[a_ids].to(a.dtype)[..., None]
    eps = torch.randn(z.shape, generator=generator, device=dev, dtype=z.dtype)
    eps_a = torch.randn(a.shape, generator=generator, device=dev, dtype=a.dtype)
    z_t, target = (1 - sigma_f) * z + sigma_f * eps, eps - z
    a_t, target_a = (1 - sigma_a) * a + sigma_a * eps_a, eps_a - a

    t_frames = scheduler.timesteps.to(dev)[frame_ids]
    t_actions = scheduler.timesteps.to(dev)[a_ids]
    video_pred, action_pred = model(
        z_t, t_frames, z, a_t, t_actions, batch.state, batch.text, batch.clip, batch.y, batch.text_lengths
    )

    # odd latent height/width: the patch conv floors, so the target is cropped (as the official action head)
    target = target[..., : video_pred.shape[-2], : video_pred.shape[-1]]
    w = scheduler.weights.to(dev)
    per_frame = (video_pred.float() - target.float()).pow(2).mean(dim=(1, 3, 4))  # [B, F]
    loss_dyn = (per_frame * w[frame_ids]).mean()

    mask = batch.action_mask.float() * batch.has_real_action.float()[:, None, None]
    sq = (action_pred.float() - target_a.float()).pow(2) * mask
    denom = a.shape[-1] if cfg.action_loss_over_all_dims else batch.action_mask.float().sum(-1).clamp(min=1)
    per_token = sq.sum(-1) / denom  # [B, K·A]
    loss_act = (per_token * w[a_ids]).mean()

    loss = loss_dyn + cfg.action_weight * loss_act
    return loss, {"loss": loss.detach(), "loss_dynamics": loss_dyn.detach(), "loss_action": loss_act.detach()}
