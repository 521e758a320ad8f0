"""Slicing, relative actions, q99 normalization and padding (docs/REFERENCE.md#5-state-action-and-normalization)."""

import numpy as np
import pytest
import torch

from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.preprocess.state_action import columns_for, slice_keys, window_state_action
from wampipe.preprocess.stats import build_metadata
from wampipe.preprocess.windows import episode_windows
from wampipe.shardformat.embodiments import get_embodiment
from wampipe.shardformat.stats import normalize_q99, pad_with_mask, stat_vector, unnormalize_q99
from wampipe.train.dit.model import DiTConfig

MAX_STATE_DIM, MAX_ACTION_DIM = DiTConfig.max_state_dim, DiTConfig.action_dim


def test_normalize_q99_values():
    q01, q99 = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([2.0, 1.0, 4.0])
    x = torch.tensor([[1.0, 5.0, 5.0], [-1.0, 0.5, 3.0], [0.5, -3.0, 2.0]])
    expected = torch.tensor(
        [
            [0.0, 1.0, 1.0],  # 5 on the constant dim: identity, then clamped to 1
            [-1.0, 0.5, 0.0],  # 2*(-1-0)/2-1 = -2 -> -1
            [-0.5, -1.0, -1.0],
        ]
    )
    torch.testing.assert_close(normalize_q99(x, q01, q99), expected)
    inside = torch.tensor([[0.3, 0.2, 2.5]])
    torch.testing.assert_close(unnormalize_q99(normalize_q99(inside, q01, q99), q01, q99), inside)
    assert normalize_q99(x.double(), q01, q99).dtype == torch.float64


def test_pad_with_mask():
    x = torch.arange(8.0).reshape(1, 8).repeat(4, 1)
    padded, mask = pad_with_mask(x, MAX_STATE_DIM)
    assert padded.shape == mask.shape == (4, 64) and mask.dtype == torch.bool
    assert mask[:, :8].all() and not mask[:, 8:].any() and (padded[:, :8] == x).all() and (padded[:, 8:] == 0).all()
    with pytest.raises(ValueError):
        pad_with_mask(torch.zeros(2, 65), MAX_STATE_DIM)


def test_droid_window_slices_and_relative_actions(droid_root):
    emb = get_embodiment("oxe_droid")
    ds = LeRobotDataset(droid_root)
    columns = columns_for(ds.modality.state, emb.state_keys) + columns_for(ds.modality.action, emb.action_keys)
    episode = ds.episode(ds.episode_indices[0], columns)
    raw_state = episode.columns["observation.state"]  # [L, 14]: cartesian 0:6, gripper 6:7, joints 7:14
    raw_action = episode.columns["action"]  # [L, 28]: gripper 12:13, joints 14:21
    states = slice_keys(episode, ds.modality.state, emb.state_keys)
    actions = slice_keys(episode, ds.modality.action, emb.action_keys)
    window = episode_windows(episode.length, emb.window)[10]
    state, action = window_state_action(states, actions, window, emb)
    a0 = window.start
    assert state.shape == (4, 8) and action.shape == (96, 8) and state.dtype == action.dtype == np.float32
    for c in range(4):
        np.testing.assert_array_equal(
            state[c], np.r_[raw_state[a0 + 24 * c, 7:14], raw_state[a0 + 24 * c, 6:7]].astype(np.float32)
        )
        for k in range(24):
            row = a0 + 24 * c + k
            joints = raw_action[row, 14:21] - raw_state[a0 + 24 * c, 7:14]  # relative to the chunk's first row
            np.testing.assert_allclose(action[24 * c + k, :7], joints, rtol=1e-6, atol=1e-7)
            assert action[24 * c + k, 7] == np.float32(raw_action[row, 12])  # gripper stays absolute


def test_libero_window_is_absolute(libero_root):
    emb = get_embodiment("libero_sim")
    ds = LeRobotDataset(libero_root)
    episode = ds.episode(ds.episode_indices[0], ["state", "actions"])
    window = episode_windows(episode.length, emb.window)[3]
    state, action = window_state_action(
        slice_keys(episode, ds.modality.state, emb.state_keys),
        slice_keys(episode, ds.modality.action, emb.action_keys),
        window,
        emb,
    )
    np.testing.assert_array_equal(state, episode.columns["state"][[3, 19, 35, 51]])
    np.testing.assert_array_equal(action, episode.columns["actions"][3:67])


def test_missing_sub_key_is_a_dataset_error(libero_root):
    ds = LeRobotDataset(libero_root)
    episode = ds.episode(ds.episode_indices[0], ["state"])
    with pytest.raises(DatasetError, match="joint_position"):
        slice_keys(episode, ds.modality.state, ("joint_position",))


def model_view(x: np.ndarray, statistics, modality: str, keys, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer's loader makes of a stored window (train/data.py): q99-normalized and padded, with a mask."""
    q01, q99 = (stat_vector(statistics, modality, keys, q) for q in ("q01", "q99"))
    return pad_with_mask(normalize_q99(torch.from_numpy(x), q01, q99), width)


def test_model_view_with_dataset_statistics(droid_root):
    emb = get_embodiment("oxe_droid")
    ds = LeRobotDataset(droid_root)
    statistics = build_metadata([droid_root], emb)["oxe_droid"]["statistics"]
    episode = ds.episode(ds.episode_indices[0], ["observation.state", "action"])
    window = episode_windows(episode.length, emb.window)[0]
    state, action = window_state_action(
        slice_keys(episode, ds.modality.state, emb.state_keys),
        slice_keys(episode, ds.modality.action, emb.action_keys),
        window,
        emb,
    )
    out = dict(zip(("state", "state_mask"), model_view(state, statistics, "state", emb.state_keys, MAX_STATE_DIM)))
    out |= dict(
        zip(("action", "action_mask"), model_view(action, statistics, "action", emb.action_keys, MAX_ACTION_DIM))
    )
    assert out["state"].shape == (4, MAX_STATE_DIM) and out["action"].shape == (96, MAX_ACTION_DIM)
    assert out["state_mask"][:, :8].all() and not out["state_mask"][:, 8:].any()
    assert out["action_mask"].sum() == 96 * 8
    assert out["action"].abs().max() <= 1 and out["state"].abs().max() <= 1
    # joint 0 of the first state row by hand with the joint_position q01/q99
    q01, q99 = statistics["state"]["joint_position"]["q01"][0], statistics["state"]["joint_position"]["q99"][0]
    expected = np.clip(2 * (state[0, 0] - np.float32(q01)) / (np.float32(q99) - np.float32(q01)) - 1, -1, 1)
    assert out["state"][0, 0].item() == pytest.approx(float(expected), abs=1e-6)
