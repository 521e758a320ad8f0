"""Window index patterns and anchor multiplicities against the reference's table and RLinf's multi-anchor rule
(docs/REFERENCE.md#2-windows-and-anchor-sampling)."""

from collections import Counter

import numpy as np
import pytest

from wampipe.preprocess.windows import episode_windows, rlinf_sample, window_at
from wampipe.shardformat.embodiments import EMBODIMENTS, get_embodiment

# The reference's patterns (docs/REFERENCE.md#2-windows-and-anchor-sampling), written out: video offsets, action
# rows, state rows, full windows per episode = L - extent.
SPEC = {
    "oxe_droid": (list(range(0, 97, 3)), 96, [0, 24, 48, 72], 96),
    "libero_sim": (
        [
            0,
            3,
            6,
            9,
            12,
            15,
            16,
            18,
            19,
            21,
            22,
            25,
            28,
            31,
            32,
            34,
            35,
            37,
            38,
            41,
            44,
            47,
            48,
            50,
            51,
            53,
            54,
            57,
            60,
            63,
            66,
            69,
            72,
        ],
        64,
        [0, 16, 32, 48],
        72,
    ),
    "franka_pnp": ([*range(0, 8), *range(12, 20), *range(24, 32), *range(36, 44), 44], 48, [0, 12, 24, 36], 48),
}


@pytest.mark.parametrize("tag", sorted(SPEC))
def test_pattern_matches_spec(tag):
    video, n_actions, states, extent = SPEC[tag]
    pattern = get_embodiment(tag).window
    assert list(pattern.frame_offsets) == video and len(video) == 33
    assert list(pattern.action_offsets) == list(range(n_actions))
    assert list(pattern.state_offsets) == states
    assert pattern.extent == extent


@pytest.mark.parametrize("tag", sorted(SPEC))
def test_windows_for_many_lengths(tag):
    video, n_actions, states, extent = SPEC[tag]
    pattern = get_embodiment(tag).window
    lengths = [1, extent - 1, extent, extent + 1, extent + 2, 2 * extent, 161, 200, 419]
    for length in lengths:
        windows = episode_windows(length, pattern)
        assert [w.start for w in windows] == list(range(max(0, length - extent))), length
        for w in windows:
            assert w.video_rows.tolist() == [w.start + v for v in video]
            assert w.action_rows.tolist() == list(range(w.start, w.start + n_actions))
            assert w.state_rows.tolist() == [w.start + s for s in states]
            assert w.video_rows.max() < length and w.action_rows.max() < length
            assert w.weight >= 1


@pytest.mark.parametrize("tag", sorted(SPEC))
def test_weights_count_rlinf_anchors(tag):
    """Each window's weight = anchors whose full RLinf sample shows that window's video; partial samples are dropped."""
    pattern = get_embodiment(tag).window
    for length in (pattern.extent + 1, 150, 263):
        by_start = Counter()
        for f in range(length):
            sample = rlinf_sample(f, length, pattern)
            if sample.num_chunks == 4 and sample.action.size == 4 * pattern.action_horizon and sample.state.size == 4:
                # a misaligned sample counts for whichever of its starts begins a full window
                video_ok = sample.video[0] + pattern.extent < length
                by_start[int(sample.video[0] if video_ok else sample.action[0])] += 1
        assert {w.start: w.weight for w in episode_windows(length, pattern)} == dict(by_start)


def test_droid_l200_example():
    """DROID L=200 gives 104 distinct windows, 57 hit by one anchor, 47 by 2 or 3 (RLinf: 3)."""
    windows = episode_windows(200, get_embodiment("oxe_droid").window)
    assert len(windows) == 104
    assert Counter(w.weight for w in windows) == {1: 57, 3: 47}


def test_droid_short_episodes_valid_anchors():
    """RLinf keeps 5 of 97 anchors at L=97 and 118 of 120 at L=120."""
    pattern = get_embodiment("oxe_droid").window
    assert sum(w.weight for w in episode_windows(97, pattern)) == 5
    assert sum(w.weight for w in episode_windows(120, pattern)) == 118
    assert episode_windows(96, pattern) == []


def test_droid_rlinf_is_aligned():
    pattern = get_embodiment("oxe_droid").window
    for length in range(97, 420, 7):
        for f in range(length):
            s = rlinf_sample(f, length, pattern)
            if s.num_chunks == 4:
                assert (
                    s.action[0] == s.video[0] and s.state.tolist() == (s.video[0] + np.array([0, 24, 48, 72])).tolist()
                )


def test_libero_misalignment_is_not_reproduced():
    """RLinf LIBERO, L=200, f=163 pairs video a0=115 with actions/states a0=131; our window 115 is aligned."""
    pattern = get_embodiment("libero_sim").window
    s = rlinf_sample(163, 200, pattern)
    assert (s.video[0], s.action[0], s.state[0]) == (115, 131, 131)
    misaligned = [
        f for f in range(200) if (x := rlinf_sample(f, 200, pattern)).num_chunks == 4 and x.action[0] != x.video[0]
    ]
    assert len(misaligned) == 15
    ours = {w.start: w for w in episode_windows(200, pattern)}[115]
    assert ours.action_rows[0] == ours.state_rows[0] == ours.video_rows[0] == 115
    franka = get_embodiment("franka_pnp").window
    assert (
        sum(1 for f in range(60) if (x := rlinf_sample(f, 60, franka)).num_chunks == 4 and x.action[0] != x.video[0])
        == 2
    )


def test_anchor_stride_keeps_every_nth_window():
    pattern = get_embodiment("oxe_droid").window
    every = episode_windows(300, pattern)
    third = episode_windows(300, pattern, anchor_stride=3)
    assert [w.start for w in third] == [w.start for w in every][::3]
    assert [w.weight for w in third] == [w.weight for w in every][::3]
    with pytest.raises(ValueError):
        episode_windows(300, pattern, anchor_stride=0)


def test_language_bounded_windows_stay_in_one_segment():
    pattern = get_embodiment("oxe_droid").window
    language = np.array(["a"] * 150 + ["b"] * 170, dtype=object)
    # an object array, which episode_windows reads through np.asarray (its hint says Sequence)
    windows = episode_windows(len(language), pattern, language=language)  # pyright: ignore[reportArgumentType]
    assert windows
    # the reference checks the language at anchor rows only (a chunk's frames/actions may run past a change)
    for w in windows:
        assert len(set(language[w.state_rows])) == 1
    starts = [w.start for w in windows]
    assert starts[0] == 0 and starts[-1] == 320 - 97
    assert len(starts) < 320 - 96  # windows whose anchors straddle the change are never drawn


def test_window_at_and_registry():
    assert set(EMBODIMENTS) == {"oxe_droid", "libero_sim", "franka_pnp"}
    w = window_at(5, get_embodiment("oxe_droid").window)
    assert w.video_rows[-1] == 101 and w.action_rows[-1] == 100 and (w.start, w.weight) == (5, 1)
    with pytest.raises(KeyError):
        get_embodiment("nope")
