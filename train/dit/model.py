"""DreamZero's causal Wan DiT (the reference `CausalWanModel`), training forward only.

Parameter names and shapes equal the official ones (`tests/assets/dreamzero_{5b,14b}_keys.txt`),
so official checkpoints load strictly (see `train/dit/weights.py`). No parallelism here: `model.blocks` is an
`nn.ModuleList` that FSDP2 / activation checkpointing / compile wrap per block from outside.

Input contract (one training micro-batch, all tensors on the model's device; see docs/MODEL.md):

    DiTBatch.latents        [B, C, F, h, w]   clean VAE latents z (normalised, bf16 ok); F = 1 + K·nfpb
    DiTBatch.clip           [B, 257, 1280]    CLIP ViT-H/14 features of frame 0
    DiTBatch.text           [B, 512, 4096]    umT5 output, zero beyond each sample's length (`text.pad_text`), or
                            [B, T, 4096]      the same with its zero rows collapsed (`text.compact_text`), then
    DiTBatch.text_lengths   [B]               each sample's real rows (None with the 512-row form)
    DiTBatch.state          [B, K·S, 64]      proprio state, zero-padded to 64 dims
    DiTBatch.actions        [B, K·A, 32]      normalised actions in [-1, 1], zero-padded to 32 dims
    DiTBatch.action_mask    [B, K·A, 32]      bool, real action dims
    DiTBatch.has_real_action [B]              bool (1 for normal data)
    DiTBatch.y              [B, 20, F, h, w]  14B (`model_type='i2v'`) only: 4 mask + 16 first-frame latents

`train/dit/loss.py` draws noise and timesteps and calls

    video_pred, action_pred = model(noisy_latents, t_frames, latents, noisy_actions, t_actions,
                                    state, text, clip, y, text_lengths)

with `t_frames` [B, F] and `t_actions` [B, K·A] the raw timestep values 1000·σ. `video_pred` is
[B, out_dim, F, 2⌊h/2⌋, 2⌊w/2⌋]: an odd latent height (5B DROID: 11 rows) is floored by the patch
conv exactly as the reference does; the loss crops its target to match.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from wampipe import configs
from wampipe.errors import UsageError
from wampipe.train.dit.attention import TokenLayout, make_attention_mask, masked_attention, weighted_key_attention


@dataclass(frozen=True)
class DiTConfig:
    """CausalWanModel configuration; the first fields are the official config names."""

    model_type: Literal["ti2v", "i2v", "t2v"] = "ti2v"
    """'i2v' concatenates y to the latents (14B); every type but 't2v' has the CLIP cross-attention."""
    dim: int = 3072
    """Hidden width d."""
    ffn_dim: int = 14336
    """FFN inner width."""
    num_heads: int = 24
    """Attention heads (head_dim = dim / num_heads)."""
    num_layers: int = 30
    """Transformer blocks."""
    in_dim: int = 48
    """Channels into the patch conv (5B: 48; 14B: 16 latents + 20 y = 36)."""
    out_dim: int = 48
    """Channels predicted per latent voxel."""
    freq_dim: int = 256
    """Sinusoidal timestep embedding width."""
    eps: float = 1e-6
    """Norm epsilon."""
    frame_seqlen: int = 50
    """Tokens per latent frame (5B LIBERO 50, 14B DROID 880); checked against the input."""
    max_chunk_size: int = 4
    """Action chunks in the clean-stream window; local_attn_size = max_chunk_size·nfpb + 1 (-1: none)."""
    num_frame_per_block: int = 2
    """Latent frames per causal block."""
    num_action_per_block: int = 24
    """Action tokens per block (RLinf's LIBERO recipe: 16); a batch of another horizon (a mixture's other
    embodiment) runs with its own, as latents of another grid do."""
    num_state_per_block: int = 1
    """State tokens per block."""
    action_dim: int = 32
    """Padded action width."""
    max_state_dim: int = 64
    """Padded state width."""
    hidden_size: int = 1024
    """Width of the state encoder / action decoder MLPs."""
    text_dim: int = 4096
    """umT5 width."""
    text_len: int = 512
    """Text context length (the reference asserts 512)."""
    image_dim: int = 1280
    """CLIP feature width."""
    image_len: int = 257
    """CLIP tokens."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def local_attn_size(self) -> int:
        return -1 if self.max_chunk_size == -1 else self.max_chunk_size * self.num_frame_per_block + 1

    def layout(
        self, num_frames: int, frame_seqlen: int | None = None, num_action_per_block: int | None = None
    ) -> TokenLayout:
        return TokenLayout(
            num_frames,
            frame_seqlen or self.frame_seqlen,
            self.num_frame_per_block,
            num_action_per_block or self.num_action_per_block,
            self.num_state_per_block,
            self.local_attn_size,
        )


@functools.cache
def _recipe_shape(name: str) -> DiTConfig:
    return configs.apply(DiTConfig(), configs.section(configs.recipe(name), "dit", name), f"configs/{name}.yaml: dit")


def preset(name: str, **overrides) -> DiTConfig:
    """The DiT shape of recipe `name` (configs/<name>.yaml, section dit; read on first use), with `overrides`."""
    if name not in configs.names():
        raise UsageError(f"unknown DiT preset {name!r}; choose one of {configs.names()}")
    return replace(_recipe_shape(name), **overrides)


@dataclass
class DiTBatch:
    """One micro-batch of precomputed inputs (shapes in the module docstring)."""

    latents: torch.Tensor
    clip: torch.Tensor
    text: torch.Tensor
    state: torch.Tensor
    actions: torch.Tensor
    action_mask: torch.Tensor
    has_real_action: torch.Tensor
    y: torch.Tensor | None = None
    text_lengths: torch.Tensor | None = None


MODEL_INPUTS = [f.name for f in fields(DiTBatch)]  # what a micro-batch brings the model


def text_key_log_weight(
    lengths: torch.Tensor, rows: int, text_len: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[B, rows]: 0 on a sample's real rows, log((text_len - n) / (rows - n)) on its zero rows, so the
    rows - n zero keys kept stand for the text_len - n of the full layout. fp32 unless the model runs in fp64."""
    n = lengths.to(dtype)[:, None]
    pos = torch.arange(rows, device=lengths.device, dtype=dtype)[None]
    weight = torch.log((text_len - n) / (rows - n).clamp(min=1))
    return torch.where(pos >= n, weight, torch.zeros_like(weight))


# ---------------------------------------------------------------- embeddings


def sinusoidal_embedding(dim: int, t: torch.Tensor) -> torch.Tensor:
    """Wan timestep embedding [cos, sin], computed in float64 as the reference does."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    angles = t.to(torch.float64).flatten()[:, None] * freqs
    return torch.cat([angles.cos(), angles.sin()], dim=-1).view(*t.shape, dim)


def action_time_encoding(dim: int, t: torch.Tensor) -> torch.Tensor:
    """GR00T action-encoder encoding [sin, cos] in fp32, ω_i = exp(-i·ln 1e4 / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(-torch.arange(half, dtype=torch.float32, device=t.device) * (math.log(10000.0) / half))
    angles = t.float()[..., None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def rope_angles(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Angles [N, dim/2] of a 1D RoPE of `dim` channels (float64)."""
    inv = 1.0 / torch.pow(10000.0, torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    return positions.to(torch.float64)[:, None] * inv


def rope_tables(
    layout: TokenLayout, grid_hw: tuple[int, int], head_dim: int, device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, head_dim/2] for the whole sequence, angles in float64, tables in `dtype`
    (docs/REFERENCE.md#7-dit-token-layout-rope-and-timesteps).

    Video: pairs split 22/21/21 (for head_dim 128) over (frame, row, col); clean and noisy copies share
    positions. Actions and states: 1D RoPE over all pairs at positions j and k.
    """
    h, w = grid_hw
    d_t = head_dim - 4 * (head_dim // 6)
    d_s = 2 * (head_dim // 6)
    f_idx, y_idx, x_idx = torch.meshgrid(
        torch.arange(layout.num_frames, device=device),
        torch.arange(h, device=device),
        torch.arange(w, device=device),
        indexing="ij",
    )
    video = torch.cat(
        [rope_angles(f_idx.flatten(), d_t), rope_angles(y_idx.flatten(), d_s), rope_angles(x_idx.flatten(), d_s)],
        dim=-1,
    )
    k = layout.num_blocks
    actions = rope_angles(torch.arange(k * layout.num_action_per_block, device=device), head_dim)
    states = rope_angles(torch.arange(k * layout.num_state_per_block, device=device), head_dim)
    angles = torch.cat([video, video, actions, states])
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, D]; rotates adjacent pairs (2i, 2i+1) in the tables' dtype (fp32; reference: complex128)."""
    xf = x.to(cos.dtype).unflatten(-1, (-1, 2))
    re, im = xf[..., 0], xf[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([re * c - im * s, re * s + im * c], dim=-1).flatten(-2).type_as(x)


# ---------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 (Wan's WanLayerNorm)."""

    def forward(self, x):
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).type_as(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.dim
        self.num_heads = cfg.num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(d, cfg.eps), RMSNorm(d, cfg.eps)

    def forward(self, x, rope, mask):
        B, L, _ = x.shape
        q = apply_rope(self.norm_q(self.q(x)).view(B, L, self.num_heads, -1), *rope)
        k = apply_rope(self.norm_k(self.k(x)).view(B, L, self.num_heads, -1), *rope)
        v = self.v(x).view(B, L, self.num_heads, -1)
        # fp32 norm weights lift q, k to fp32 under autocast; attention runs in v's dtype (bf16)
        q, k = q.to(v.dtype), k.to(v.dtype)
        out = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.o(out.transpose(1, 2).flatten(2))


class CrossAttention(nn.Module):
    """Text branch (+ CLIP branch unless t2v); outputs summed before `o`. No key mask (as the reference)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.dim
        self.num_heads, self.image_len = cfg.num_heads, cfg.image_len
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(d, cfg.eps), RMSNorm(d, cfg.eps)
        self.has_image = cfg.model_type != "t2v"
        if self.has_image:
            self.k_img, self.v_img = nn.Linear(d, d), nn.Linear(d, d)
            self.norm_k_img = RMSNorm(d, cfg.eps)

    def _heads(self, t):
        return t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def forward(self, x, context, text_log_weight=None):
        """text_log_weight [B, T] fp32 (compact text): per-key log multiplicity of the text rows."""
        text = context[:, self.image_len :] if self.has_image else context
        v = self._heads(self.v(text))
        q = self._heads(self.norm_q(self.q(x))).to(v.dtype)
        k = self._heads(self.norm_k(self.k(text))).to(v.dtype)
        out = (
            F.scaled_dot_product_attention(q, k, v)
            if text_log_weight is None
            else weighted_key_attention(q, k, v, text_log_weight)
        )
        if self.has_image:
            img = context[:, : self.image_len]
            v_img = self._heads(self.v_img(img))
            out = out + F.scaled_dot_product_attention(
                q, self._heads(self.norm_k_img(self.k_img(img))).to(v_img.dtype), v_img
            )
        return self.o(out.transpose(1, 2).flatten(2))


def split_rows(rows: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, 1 + F + R, ...] rows in timestep order -> (clean, noisy, register) as `per_token` takes them."""
    return rows[:, :1], rows[:, 1 : 1 + frames], rows[:, 1 + frames :]


def per_frame(rows: torch.Tensor, frame_tokens: int) -> torch.Tensor:
    """[B, F, ...] one row per frame -> [B, F·frame_tokens, ...], each row repeated for its frame's tokens."""
    B, F = rows.shape[:2]
    return rows.unsqueeze(2).expand(B, F, frame_tokens, *rows.shape[2:]).flatten(1, 2)


def per_token(rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], tokens: int) -> torch.Tensor:
    """Rows of the sequence's distinct timesteps -> one per token [B, tokens, ...].

    `rows` = (clean [B, 1, ...]: the clean copy's t = 0, noisy [B, F, ...]: one per noisy frame, register [B, R, ...]:
    one per action and state token). The clean row stands for all F·fs clean tokens and each noisy row for its
    frame's fs tokens, as expanded views: inside a compiled block the consumers read the few rows directly, and
    backward sums each row's tokens there, instead of a [B, L, 6, d] tensor and its gradient per block.
    """
    clean, noisy, register = rows
    B, F = noisy.shape[:2]
    fs = (tokens - register.shape[1]) // (2 * F)
    return torch.cat([clean.expand(B, F * fs, *clean.shape[2:]), per_frame(noisy, fs), register], dim=1)


class Block(nn.Module):
    """CausalWanAttentionBlock: per-token adaLN modulation around self-attn and FFN; plain cross-attn."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.dim
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)
        self.norm1 = LayerNorm(d, cfg.eps, elementwise_affine=False)
        self.self_attn = SelfAttention(cfg)
        self.norm3 = LayerNorm(d, cfg.eps, elementwise_affine=True)
        self.cross_attn = CrossAttention(cfg)
        self.norm2 = LayerNorm(d, cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, d))

    def forward(self, x, e0, context, rope, mask, text_log_weight=None):
        """x [B, L, d]; e0 the time projection [B, ·, 6, d] of the clean, noisy-frame and register rows
        (`per_token`)."""
        rows = tuple(self.modulation.unsqueeze(0) + part for part in e0)
        sh1, sc1, g1, sh2, sc2, g2 = per_token(rows, x.shape[1]).unbind(2)
        x = x + self.self_attn(self.norm1(x) * (1 + sc1) + sh1, rope, mask) * g1
        x = x + self.cross_attn(self.norm3(x), context, text_log_weight)
        return x + self.ffn(self.norm2(x) * (1 + sc2) + sh2) * g2


class Head(nn.Module):
    def __init__(self, cfg: DiTConfig, patch_numel: int = 4):
        super().__init__()
        d = cfg.dim
        self.norm = LayerNorm(d, cfg.eps, elementwise_affine=False)
        self.head = nn.Linear(d, cfg.out_dim * patch_numel)
        self.modulation = nn.Parameter(torch.randn(1, 2, d) / d**0.5)

    def forward(self, x, e):
        """x, e [B, N, d]; e is the time embedding before the projection."""
        shift, scale = (self.modulation.unsqueeze(0) + e.unsqueeze(2)).unbind(2)
        return self.head(self.norm(x) * (1 + scale) + shift)


class CategoryLinear(nn.Module):
    """The reference's CategorySpecificLinear with one category: x @ W[0] + b[0]."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.W = nn.Parameter(0.02 * torch.randn(1, n_in, n_out))
        self.b = nn.Parameter(torch.zeros(1, n_out))

    def forward(self, x):
        return x @ self.W[0].to(x.dtype) + self.b[0].to(x.dtype)


class CategoryMLP(nn.Module):
    def __init__(self, n_in: int, hidden: int, n_out: int):
        super().__init__()
        self.layer1, self.layer2 = CategoryLinear(n_in, hidden), CategoryLinear(hidden, n_out)

    def forward(self, x):
        return self.layer2(F.relu(self.layer1(x)))


class ActionEncoder(nn.Module):
    def __init__(self, action_dim: int, d: int):
        super().__init__()
        self.dim = d
        self.W1, self.W2, self.W3 = CategoryLinear(action_dim, d), CategoryLinear(2 * d, d), CategoryLinear(d, d)

    def forward(self, actions, t):
        """actions [B, N, action_dim], t [B, N] raw timesteps → [B, N, d]."""
        a = self.W1(actions)
        x = torch.cat([a, action_time_encoding(self.dim, t).to(a.dtype)], dim=-1)
        return self.W3(F.silu(self.W2(x)))


class ImageProjection(nn.Module):
    """CLIP features → d (Wan's MLPProj: LN, Linear, GELU, Linear, LN)."""

    def __init__(self, n_in: int, d: int):
        super().__init__()
        self.proj = nn.Sequential(
            nn.LayerNorm(n_in), nn.Linear(n_in, n_in), nn.GELU(), nn.Linear(n_in, d), nn.LayerNorm(d)
        )

    def forward(self, x):
        return self.proj(x)


# ---------------------------------------------------------------- model


class CausalWanModel(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.state_encoder = CategoryMLP(cfg.max_state_dim, cfg.hidden_size, d)
        self.action_encoder = ActionEncoder(cfg.action_dim, d)
        self.action_decoder = CategoryMLP(d, cfg.hidden_size, cfg.action_dim)
        self.patch_embedding = nn.Conv3d(cfg.in_dim, d, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        if cfg.model_type != "t2v":
            self.img_emb = ImageProjection(cfg.image_dim, d)
        self.attention_backend: Literal["auto", "flex", "dense"] = "auto"
        self.flex_mask_options: dict = {}  # flex_block_mask keyword arguments (lookup, block_size); {} = its defaults
        self._masks: dict = {}
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """The reference's init: xavier Linears, N(0, .02) text/time MLPs, zero output head."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.LayerNorm, RMSNorm)) and m.weight is not None:
                nn.init.ones_(m.weight)
                if (bias := getattr(m, "bias", None)) is not None:
                    nn.init.zeros_(bias)
            elif isinstance(m, CategoryLinear):
                m.W.normal_(0, 0.02)
                m.b.zero_()
            elif isinstance(m, (Block, Head)):
                m.modulation.normal_().div_(self.cfg.dim**0.5)
        nn.init.xavier_uniform_(self.patch_embedding.weight.view(self.cfg.dim, -1))
        assert self.patch_embedding.bias is not None  # built with one (nn.Conv3d's default)
        nn.init.zeros_(self.patch_embedding.bias)
        for seq in (self.text_embedding, self.time_embedding):
            for m in seq:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.head.head.weight)

    def attention_mask(self, layout: TokenLayout, device: torch.device):
        """Cached per (layout, device, backend, flex options): `make_attention_mask`."""
        key = (layout, str(device), self.attention_backend, tuple(sorted(self.flex_mask_options.items())))
        if key not in self._masks:
            self._masks[key] = make_attention_mask(layout, device, self.attention_backend, **self.flex_mask_options)
        return self._masks[key]

    def _patchify(self, latents, y):
        if self.cfg.model_type == "i2v":
            if y is None:
                raise ValueError("model_type 'i2v' needs y (4 mask + 16 first-frame latent channels)")
            latents = torch.cat([latents, y.to(latents.dtype)], dim=1)
        x = self.patch_embedding(latents.to(self.patch_embedding.weight.dtype))
        return x.flatten(2).transpose(1, 2), tuple(x.shape[2:])

    def forward(
        self,
        noisy_latents,
        t_frames,
        clean_latents,
        noisy_actions,
        t_actions,
        state,
        text,
        clip,
        y=None,
        text_lengths=None,
        state_sees_block: bool = False,
    ):
        """Teacher-forcing forward (docs/REFERENCE.md#7-dit-token-layout-rope-and-timesteps).
        Returns (video_pred [B, C_out, F, 2⌊h/2⌋, 2⌊w/2⌋], action_pred).

        With `text_lengths`, `text` is the compact form (`compact_text`); without, the full text_len rows.
        `state_sees_block`: the attention of the reference's inference (TokenLayout), for sampling."""
        cfg = self.cfg
        B, _, nf = noisy_latents.shape[:3]
        full_text = text_lengths is None and text.shape[1] == cfg.text_len
        compact = text_lengths is not None and text.shape[1] <= cfg.text_len
        if not (full_text or compact) or clip.shape[1] != cfg.image_len:
            raise ValueError(
                f"context must be text [B,{cfg.text_len},·] (or at most {cfg.text_len} rows with "
                f"text_lengths) and clip [B,{cfg.image_len},·], got {tuple(text.shape)} and "
                f"{tuple(clip.shape)}"
            )
        xn, grid = self._patchify(noisy_latents, y)
        text_log_weight = None
        if compact:
            assert text_lengths is not None  # compact only with them
            text_log_weight = text_key_log_weight(
                text_lengths, text.shape[1], cfg.text_len, torch.float64 if xn.dtype == torch.float64 else torch.float32
            )
        xc, _ = self._patchify(clean_latents, y)
        k = cfg.layout(nf).num_blocks
        # the horizon comes with the batch, as the latent grid does: each embodiment of a mixture keeps its own
        layout = replace(
            cfg.layout(nf, grid[1] * grid[2], max(1, noisy_actions.shape[1] // k)), state_sees_block=state_sees_block
        )
        if noisy_actions.shape[1] % k or state.shape[1] != k * cfg.num_state_per_block:
            raise ValueError(
                f"{nf} latent frames = {k} blocks need a multiple of {k} actions and "
                f"{k * cfg.num_state_per_block} states, got {noisy_actions.shape[1]} and {state.shape[1]}"
            )
        dtype = xn.dtype
        register = torch.cat(
            [self.action_encoder(noisy_actions.to(dtype), t_actions), self.state_encoder(state.to(dtype))], dim=1
        )
        x = torch.cat([xc, xn, register], dim=1)

        # timesteps of the distinct rows (`per_token`): clean 0, each noisy frame its own, actions their own, state
        # k its block's first action's
        t_state = t_actions[:, :: layout.num_action_per_block // cfg.num_state_per_block]
        t_rows = torch.cat([torch.zeros_like(t_frames[:, :1]), t_frames, t_actions, t_state], dim=1)
        e = self.time_embedding(sinusoidal_embedding(cfg.freq_dim, t_rows).to(dtype))  # [B, 1 + F + R, d]
        e0 = split_rows(self.time_projection(e).unflatten(2, (6, cfg.dim)), nf)

        context = self.text_embedding(text.to(dtype))
        if cfg.model_type != "t2v":
            context = torch.cat([self.img_emb(clip.to(dtype)), context], dim=1)

        rope = rope_tables(
            layout, grid[1:], cfg.head_dim, x.device, torch.float64 if x.dtype == torch.float64 else torch.float32
        )
        mask = self.attention_mask(layout, x.device)
        for block in self.blocks:
            x = block(x, e0, context, rope, mask, text_log_weight)

        n_video = layout.video_len
        noisy = slice(n_video, 2 * n_video)
        out = self.head(x[:, noisy], per_frame(split_rows(e, nf)[1], layout.frame_seqlen))
        action_pred = self.action_decoder(x[:, 2 * n_video : 2 * n_video + noisy_actions.shape[1]])
        return self.unpatchify(out, grid), action_pred

    def unpatchify(self, x, grid):
        """[B, f·h·w, 4·C] read as (p=1, q=2, r=2, c) → [B, C, f, 2h, 2w]."""
        f, h, w = grid
        c = self.cfg.out_dim
        x = x.view(x.shape[0], f, h, w, 1, 2, 2, c)
        return torch.einsum("bfhwpqrc->bcfphqwr", x).reshape(x.shape[0], c, f, 2 * h, 2 * w)


def build_model(name_or_cfg: str | DiTConfig, **overrides) -> CausalWanModel:
    cfg = preset(name_or_cfg, **overrides) if isinstance(name_or_cfg, str) else replace(name_or_cfg, **overrides)
    return CausalWanModel(cfg)


def random_batch(
    cfg: DiTConfig,
    batch: int,
    latent_shape: tuple[int, int, int],
    device=None,
    dtype=torch.float32,
    generator: torch.Generator | None = None,
    real_action_dims: int = 7,
) -> DiTBatch:
    """A DiTBatch of random tensors obeying the input contract (tests, GPU checks, benchmarks)."""
    nf, h, w = latent_shape
    k = (nf - 1) // cfg.num_frame_per_block

    def rnd(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    n_act = k * cfg.num_action_per_block
    action_mask = torch.zeros(batch, n_act, cfg.action_dim, dtype=torch.bool, device=device)
    action_mask[..., :real_action_dims] = True
    actions = (rnd(batch, n_act, cfg.action_dim).clamp(-1, 1) * action_mask).to(dtype)
    lengths = torch.randint(1, cfg.text_len + 1, (batch,), generator=generator, device=device)
    text = rnd(batch, cfg.text_len, cfg.text_dim) * (
        torch.arange(cfg.text_len, device=device)[None, :, None] < lengths[:, None, None]
    )
    y = None
    if cfg.model_type == "i2v":
        y = torch.zeros(batch, cfg.in_dim - cfg.out_dim, nf, h, w, device=device, dtype=dtype)
        y[:, :4, 0] = 1
        y[:, 4:] = rnd(batch, cfg.in_dim - cfg.out_dim - 4, nf, h, w)
    return DiTBatch(
        latents=rnd(batch, cfg.out_dim, nf, h, w),
        clip=rnd(batch, cfg.image_len, cfg.image_dim),
        text=text.to(dtype),
        state=rnd(batch, k * cfg.num_state_per_block, cfg.max_state_dim),
        actions=actions,
        action_mask=action_mask,
        has_real_action=torch.ones(batch, dtype=torch.bool, device=device),
        y=y,
    )
