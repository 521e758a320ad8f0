"""The training attention mask (docs/REFERENCE.md#8-attention-mask): a slice-by-slice transcription of the table vs
the vectorised mask."""

import pytest
import torch

from wampipe.train.dit.attention import TokenLayout, count_allowed_pairs, dense_mask, flex_block_mask, masked_attention


def table_mask(lay: TokenLayout) -> torch.Tensor:
    """docs/REFERENCE.md#8-attention-mask, written as slice assignments over [C | N | A | S]."""
    fs, nfpb, A, S, W = (
        lay.frame_seqlen,
        lay.num_frame_per_block,
        lay.num_action_per_block,
        lay.num_state_per_block,
        lay.local_attn_size,
    )
    K, V = lay.num_blocks, lay.video_len
    C0, N0, A0, S0 = 0, V, 2 * V, 2 * V + K * A
    m = torch.zeros(lay.seq_len, lay.seq_len, dtype=torch.bool)

    def frames(base, lo, hi):  # token range of latent frames [lo, hi) of a video copy
        return slice(base + lo * fs, base + hi * fs)

    m[frames(C0, 0, 1), frames(C0, 0, 1)] = True  # clean frame 0
    m[frames(N0, 0, 1), frames(N0, 0, 1)] = True  # noisy frame 0: only itself
    for b in range(K):
        blk = (1 + b * nfpb, 1 + (b + 1) * nfpb)
        end = blk[1]
        start = max(1, end - W) if W > 0 else 1
        q = frames(C0, *blk)
        m[q, frames(C0, 0, 1)] = True
        m[q, frames(C0, start, end)] = True
        for q in (frames(N0, *blk), slice(A0 + b * A, A0 + (b + 1) * A)):
            m[q, frames(C0, 0, blk[0])] = True  # clean frame 0 + earlier clean blocks
            m[q, frames(N0, *blk)] = True
            m[q, A0 + b * A : A0 + (b + 1) * A] = True
            m[q, S0 + b * S : S0 + (b + 1) * S] = True
        m[S0 + b * S : S0 + (b + 1) * S, S0 + b * S : S0 + (b + 1) * S] = True
    return m


LAYOUTS = {
    "tiny": TokenLayout(9, 4, 2, 4, 1, 9),
    "tiny-window": TokenLayout(9, 4, 2, 4, 1, 3),  # window active: older clean blocks drop out
    "5b-libero": TokenLayout(9, 50, 2, 16, 1, 9),
    "5b-droid": TokenLayout(9, 50, 2, 24, 1, 9),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mask_matches_table(name):
    lay = LAYOUTS[name]
    assert torch.equal(dense_mask(lay), table_mask(lay))
    assert count_allowed_pairs(lay) == int(table_mask(lay).sum())


def test_spec_pair_counts():
    # allowed (query, key) pairs per layer (docs/REFERENCE.md#8-attention-mask)
    assert LAYOUTS["5b-libero"].seq_len == 968 and count_allowed_pairs(LAYOUTS["5b-libero"]) == 272_092
    assert LAYOUTS["5b-droid"].seq_len == 1000 and count_allowed_pairs(LAYOUTS["5b-droid"]) == 286_204
    big = TokenLayout(9, 880, 2, 24, 1, 9)
    assert big.seq_len == 15_940 and count_allowed_pairs(big) == 76_576_484


def test_window_is_active_in_small_window_layout():
    m = dense_mask(LAYOUTS["tiny-window"])
    fs = 4
    last_clean_block_row = (1 + 3 * 2) * fs  # first token of clean frame 7 (block 3)
    assert m[last_clean_block_row, 0]  # frame 0 always visible
    assert not m[last_clean_block_row, 1 * fs]  # frame 1 is outside a 3-frame window ending at frame 9
    assert m[last_clean_block_row, 6 * fs]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_matches_dense_on_cpu():
    lay = LAYOUTS["tiny"]
    bm = flex_block_mask(lay, "cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, lay.seq_len, 16, generator=g) for _ in range(3))
    ref = masked_attention(q, k, v, dense_mask(lay))
    out = masked_attention(q, k, v, bm)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _tiles(bm):
    """(partial, full) tile sets of a BlockMask as bool [q tiles, kv tiles]."""

    def dense(num, idx):
        n = idx.shape[-1]
        keep = torch.arange(n)[None] < num[0, 0, :, None]
        out = torch.zeros(num.shape[-1], n, dtype=torch.bool)
        rows = torch.arange(num.shape[-1])[:, None].expand(-1, n)
        out[rows[keep], idx[0, 0][keep].long()] = True
        return out

    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


def test_lookup_and_expression_masks_skip_the_same_tiles():
    for lay in (LAYOUTS["5b-libero"], LAYOUTS["tiny-window"]):
        lookup, attrs = (_tiles(flex_block_mask(lay, "cpu", lookup=flag, block_size=16)) for flag in (True, False))
        assert torch.equal(lookup[0], attrs[0]) and torch.equal(lookup[1], attrs[1])


def test_lookup_mask_builds_eagerly_at_14b_layout():
    """CUDA builds the lookup mask without compiling (compiling it at 15 940 tokens stalled for minutes); the eager
    build marks exactly the 128x128 tiles that hold an allowed pair, full where every pair is allowed."""
    lay = TokenLayout(9, 880, 2, 24, 1, 9)
    partial, full = _tiles(flex_block_mask(lay, "cpu"))
    m = dense_mask(lay)
    n = -(-lay.seq_len // 128)
    padded = torch.zeros(n * 128, n * 128, dtype=torch.bool)
    padded[: lay.seq_len, : lay.seq_len] = m
    del m
    per_tile = padded.view(n, 128, n, 128).sum((1, 3), dtype=torch.int32)
    assert torch.equal(partial | full, per_tile > 0)
    assert torch.equal(full, per_tile == 128 * 128)
