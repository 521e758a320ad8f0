"""Analytic FLOPs per sample of the DiT training step (one fused multiply-add = 2 FLOPs; reference figures in
docs/REFERENCE.md#11-sizes-and-flops).

Counts the matmuls (linears, convs, attention QKᵀ and PV over the allowed pairs of the attention mask);
elementwise work (norms, modulation, RoPE, softmax) is not counted, as in `FlopCounterMode`.
Backward = 2 × forward; per-block activation recompute adds one forward of the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from wampipe.train.dit.attention import count_allowed_pairs
from wampipe.train.dit.model import DiTConfig


@dataclass(frozen=True)
class DiTFlops:
    """FLOPs of one sample, broken down as in docs/REFERENCE.md#11-sizes-and-flops."""

    token_linears: float
    context_kv: float
    self_attention: float
    cross_attention: float
    time_embedding: float
    other: float

    @property
    def blocks_forward(self) -> float:
        return self.token_linears + self.context_kv + self.self_attention + self.cross_attention

    @property
    def forward(self) -> float:
        return self.blocks_forward + self.time_embedding + self.other

    @property
    def backward(self) -> float:
        return 2 * self.forward

    @property
    def fwd_bwd(self) -> float:
        return 3 * self.forward

    def train_step(self, recompute: float) -> float:
        """fwd+bwd, plus one more forward of the fraction `recompute` of the blocks that recompute in full
        (True = all of them, False = none; partial recompute: recomputed blocks / blocks)."""
        return self.fwd_bwd + float(recompute) * self.blocks_forward


def dit_flops(
    cfg: DiTConfig, latent_shape: tuple[int, int, int], text_rows: int | None = None, per_token_time: bool = False
) -> DiTFlops:
    """FLOPs per sample for latents of (F, h, w) (e.g. 5B LIBERO: (9, 10, 20)); `text_rows` = umT5 rows the model
    runs on (compact text, `compact_text_rows`), default the full text_len. The time embedding runs once per distinct
    timestep (`model.per_token`); `per_token_time` counts it once per token, as the reference runs it."""
    text_rows = cfg.text_len if text_rows is None else text_rows
    nf, h, w = latent_shape
    fs = (h // 2) * (w // 2)
    layout = cfg.layout(nf, fs)
    k = layout.num_blocks
    n_act, n_state = k * cfg.num_action_per_block, k * cfg.num_state_per_block
    n_video = nf * fs
    L = layout.seq_len
    d, f, nl = cfg.dim, cfg.ffn_dim, cfg.num_layers
    has_img = cfg.model_type != "t2v"
    n_ctx = text_rows + (cfg.image_len if has_img else 0)

    token_linears = 2 * L * nl * (6 * d * d + 2 * d * f)  # self q,k,v,o + cross q,o + ffn
    context_kv = 2 * n_ctx * 2 * d * d * nl  # k, v of both context branches, every layer
    self_attention = 4 * count_allowed_pairs(layout) * d * nl
    cross_attention = 4 * L * n_ctx * d * nl
    time_rows = L if per_token_time else 1 + nf + n_act + n_state  # clean, noisy frames, actions, states
    time_embedding = 2 * time_rows * (cfg.freq_dim * d + d * d + 6 * d * d)
    other = (
        2 * text_rows * (cfg.text_dim * d + d * d)
        + (2 * cfg.image_len * (cfg.image_dim**2 + cfg.image_dim * d) if has_img else 0)
        + 2 * 2 * n_video * cfg.in_dim * 4 * d  # patch conv, clean + noisy copy
        + 2 * n_video * d * 4 * cfg.out_dim  # head on the noisy copy
        + 2 * n_act * (cfg.action_dim * d + 2 * d * d + d * d)  # action encoder
        + 2 * n_state * (cfg.max_state_dim * cfg.hidden_size + cfg.hidden_size * d)  # state encoder
        + 2 * n_act * (d * cfg.hidden_size + cfg.hidden_size * cfg.action_dim)  # action decoder
    )
    return DiTFlops(
        float(token_linears),
        float(context_kv),
        float(self_attention),
        float(cross_attention),
        float(time_embedding),
        float(other),
    )
