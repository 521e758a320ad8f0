"""DreamZero's teacher-forcing attention mask (docs/REFERENCE.md#8-attention-mask) and the two kernels that apply it.

The DiT sequence is four streams laid end to end:

    [ C: clean video F·fs | N: noisy video F·fs | A: actions K·A | S: states K·S ]

Every token carries (stream, block β, latent frame). Video frame 0 has β = -1, frame f ≥ 1 has
β = (f-1) // nfpb; action j has β = j // A; state k has β = k // S. Which (query, key) pairs may
attend is a function of those attributes only (`allowed`), so the same expression builds

* a dense bool mask [L, L] for `scaled_dot_product_attention` (CPU, tests, reference), and
* a FlexAttention `BlockMask` (GPU): blocks of 128x128 with no allowed pair are skipped, so the
  ~70 % masked pairs cost nothing.

The reference implements the same mask as 18 flash-attention calls per layer on sliced q/k/v.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CLEAN, NOISY, ACTION, STATE = 0, 1, 2, 3


@dataclass(frozen=True)
class TokenLayout:
    """Token layout of one training sequence (all samples of a batch share it)."""

    num_frames: int
    """Latent frames F per video copy (9 for 33 pixel frames)."""
    frame_seqlen: int
    """Tokens per latent frame after the (1,2,2) patch (5B LIBERO: 50)."""
    num_frame_per_block: int
    """Latent frames per causal block (nfpb, 2)."""
    num_action_per_block: int
    """Action tokens per block (A: 16 LIBERO, 24 DROID)."""
    num_state_per_block: int
    """State tokens per block (S, 1)."""
    local_attn_size: int
    """Clean-stream window in frames (W = max_chunk_size·nfpb + 1), -1 for none."""
    state_sees_block: bool = False
    """The reference's KV-cache inference: state tokens attend as their block's noisy video and actions do (in
    training they see only their block's states)."""

    @property
    def num_blocks(self) -> int:
        k, rem = divmod(self.num_frames - 1, self.num_frame_per_block)
        if rem or k < 1:
            raise ValueError(f"{self.num_frames} latent frames is not 1 + k*{self.num_frame_per_block}")
        return k

    @property
    def video_len(self) -> int:
        return self.num_frames * self.frame_seqlen

    @property
    def register_len(self) -> int:
        """Action and state tokens after the two video copies."""
        return self.num_blocks * (self.num_action_per_block + self.num_state_per_block)

    @property
    def seq_len(self) -> int:
        return 2 * self.video_len + self.register_len

    def token_attributes(self, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(stream, block, frame) per token, each int32 [L]; frame = -1 for action/state tokens."""
        fs, nfpb, k = self.frame_seqlen, self.num_frame_per_block, self.num_blocks
        frame = torch.arange(self.num_frames).repeat_interleave(fs)
        video_block = torch.where(frame == 0, -1, torch.div(frame - 1, nfpb, rounding_mode="floor"))
        n_act, n_state = k * self.num_action_per_block, k * self.num_state_per_block
        stream = torch.cat(
            [
                torch.full((self.video_len,), CLEAN),
                torch.full((self.video_len,), NOISY),
                torch.full((n_act,), ACTION),
                torch.full((n_state,), STATE),
            ]
        )
        block = torch.cat(
            [
                video_block,
                video_block,
                torch.arange(n_act) // self.num_action_per_block,
                torch.arange(n_state) // self.num_state_per_block,
            ]
        )
        frames = torch.cat([frame, frame, torch.full((n_act + n_state,), -1)])
        stream, block, frames = (t.to(device=device, dtype=torch.int32) for t in (stream, block, frames))
        return stream, block, frames


def allowed(sq, bq, fq, sk, bk, fk, nfpb: int, window: int, state_sees_block: bool = False):
    """The table of docs/REFERENCE.md#8-attention-mask as elementwise tensor logic (broadcasts; also valid inside a
    flex mask_mod); `state_sees_block`: see TokenLayout."""
    # clean stream: frame 0 sees itself; block β sees frame 0 and clean blocks ≤ β inside the window
    clean_end = 1 + (bq + 1) * nfpb
    lo = torch.clamp(clean_end - window, min=1) if window > 0 else torch.ones_like(clean_end)
    clean_q = (sq == CLEAN) & (sk == CLEAN) & ((bk == -1) | ((bq >= 0) & (bk >= 0) & (bk <= bq) & (fk >= lo)))
    # noisy frame 0: only itself
    noisy0_q = (sq == NOISY) & (bq == -1) & (sk == NOISY) & (bk == -1)
    # noisy block / action chunk β: clean context of earlier blocks + its own N, A, S
    denoise_q = (
        ((sq == NOISY) | (sq == ACTION) | ((sq == STATE) & state_sees_block))
        & (bq >= 0)
        & (((sk == CLEAN) & (bk < bq)) | ((sk != CLEAN) & (bk == bq)))
    )
    state_q = (sq == STATE) & (sk == STATE) & (bk == bq)
    return clean_q | noisy0_q | denoise_q | state_q


def dense_mask(layout: TokenLayout, device=None) -> torch.Tensor:
    """Bool [L, L], True where query row may attend to key column."""
    s, b, f = layout.token_attributes(device)
    return allowed(
        s[:, None],
        b[:, None],
        f[:, None],
        s[None],
        b[None],
        f[None],
        layout.num_frame_per_block,
        layout.local_attn_size,
        layout.state_sees_block,
    )


def count_allowed_pairs(layout: TokenLayout) -> int:
    """Number of allowed (q, k) pairs, from per-unit attributes (never builds the L×L mask).

    The mask is constant over a video frame, an action block or a state block, so counting on
    those units is exact — used by flops.py for the 14B layout (15 940² pairs).
    """
    s, b, f = layout.token_attributes()
    key = torch.stack([s, b, f], 1)
    units, sizes = torch.unique_consecutive(key, dim=0, return_counts=True)
    us, ub, uf = units.unbind(1)
    m = allowed(
        us[:, None],
        ub[:, None],
        uf[:, None],
        us[None],
        ub[None],
        uf[None],
        layout.num_frame_per_block,
        layout.local_attn_size,
        layout.state_sees_block,
    )
    return int((m.long() * sizes[:, None] * sizes[None]).sum())


def flex_block_mask(
    layout: TokenLayout, device, compile: bool | None = None, lookup: bool = True, block_size: int = 128
):
    """FlexAttention BlockMask for `layout` (B and H broadcast).

    The kernel evaluates the mask_mod inside partially masked tiles: with `lookup` (default) one load from a
    precomputed dense [L, L] bool mask, else the `allowed` expression on per-token attributes (fwd+bwd 55 % slower at
    the 5B layout, 15 % at 14B on an H200: docs/PERFORMANCE.md, scripts/bench_attention.py).

    `compile` (default: only for the expression on CUDA) builds the mask with a compiled kernel. The lookup is a
    gather that the eager build does in well under a second on a GPU (8 s on one CPU core at the 14B's 15 940
    tokens, 3 GB peak), whereas compiling it at the 14B layout stalled the trainer in Triton for over 150 s.
    """
    device = torch.device(device)
    compile = device.type == "cuda" and not lookup if compile is None else compile
    from torch.nn.attention.flex_attention import create_block_mask

    if lookup:
        dense = dense_mask(layout, device)

        def mask_mod(batch, head, q_idx, kv_idx) -> torch.Tensor:
            return dense[q_idx, kv_idx]
    else:
        attrs = torch.stack(layout.token_attributes(device))  # [3, L]: one captured buffer
        nfpb, window, state = layout.num_frame_per_block, layout.local_attn_size, layout.state_sees_block

        def mask_mod(batch, head, q_idx, kv_idx) -> torch.Tensor:
            return allowed(
                attrs[0, q_idx],
                attrs[1, q_idx],
                attrs[2, q_idx],
                attrs[0, kv_idx],
                attrs[1, kv_idx],
                attrs[2, kv_idx],
                nfpb,
                window,
                state,
            )

    L = layout.seq_len
    return create_block_mask(
        mask_mod, B=None, H=None, Q_LEN=L, KV_LEN=L, device=device, BLOCK_SIZE=block_size, _compile=compile
    )


def make_attention_mask(layout: TokenLayout, device, backend: str = "auto", **flex_options):
    """The teacher-forcing mask for an attention backend: a FlexAttention BlockMask ('flex', `flex_block_mask`
    options) or the dense bool mask for SDPA ('dense'); 'auto' = flex on CUDA, dense elsewhere."""
    device = torch.device(device)
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "dense"
    return flex_block_mask(layout, device, **flex_options) if backend == "flex" else dense_mask(layout, device)


_COMPILED_FLEX = None


def _compiled_flex():
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def masked_attention(q, k, v, mask, compile_flex: bool | None = None):
    """q, k, v [B, H, L, D]; mask is a dense bool [L, L] (SDPA) or a FlexAttention BlockMask.

    Flex runs compiled on CUDA (eager flex materialises every score); eagerly elsewhere (CPU tests).
    """
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():  # inside a compiled block: dynamo lowers flex_attention itself
        # plain 4D buffers: inductor's CPU flex template reads the rank of the producer's buffer
        return flex_attention(q.contiguous(), k.contiguous(), v.contiguous(), block_mask=mask)
    compile_flex = q.is_cuda if compile_flex is None else compile_flex
    fn = _compiled_flex() if compile_flex else flex_attention
    return fn(q, k, v, block_mask=mask)


def weighted_key_attention(q, k, v, key_log_weight):
    """Softmax attention in which key j of sample b counts exp(key_log_weight[b, j]) times.

    q [B, H, Lq, D], k/v [B, H, Lk, D], key_log_weight fp32 [B, Lk]. On CUDA a FlexAttention score_mod adds the
    weight to the fp32 scores; elsewhere (FlexAttention has no CPU backward) SDPA takes it as a bias in q's dtype
    (fp32 on CPU).
    """
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_log_weight[:, None, None, :].to(q.dtype))
    from torch.nn.attention.flex_attention import flex_attention

    def add_log_weight(score, b, h, q_idx, kv_idx):
        return score + key_log_weight[b, kv_idx]

    if torch.compiler.is_compiling():
        return flex_attention(q.contiguous(), k.contiguous(), v.contiguous(), score_mod=add_log_weight)
    return _compiled_flex()(q, k, v, score_mod=add_log_weight)
