"""A bad flag of any command is one line naming the flag, before a dataset, a checkpoint or a shard is read (the
checks run in this process; the commands turn them into their one-line exit)."""

from dataclasses import replace

import pytest
import torch

from wampipe.errors import WampipeError
from wampipe.preprocess import preview, shards, stats
from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.train.evaluation import open_loop
from wampipe.train.config import DataConfig
from wampipe.train.data import open_sets


def refused(call, *args) -> str:
    """The one line a bad flag stops with: the project's error, which the command's entry point prints."""
    with pytest.raises(WampipeError) as stop:
        call(*args)
    message = str(stop.value)
    assert "\n" not in message, "a bad flag ends with its message"
    return message


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"weights": [0.0]}, "--weights must be positive, finite numbers (a dataset's share of the mixture), got 0.0"),
        ({"weights": [float("nan")]}, "--weights must be positive, finite numbers"),
        ({"weights": [1.0, -2.0], "src": ["a", "b"]}, "got -2.0"),
        ({"embodiment": "nope"}, "--embodiment: unknown embodiment 'nope'; known: ['franka_pnp', 'libero_sim'"),
        ({"max_relative_episodes": -1}, "--max-relative-episodes must be 0 (all) or more, got -1"),
    ],
)
def test_stats_flags(extra, message, tmp_path):
    args = stats.Args(src=[tmp_path / "nowhere"], embodiment="oxe_droid", out=tmp_path / "metadata.json")
    src = [tmp_path / s for s in extra.pop("src", [])] or args.src
    assert message in refused(stats.run, replace(args, src=src, **extra))
    assert not (tmp_path / "metadata.json").exists()


def test_stats_out_a_directory(tmp_path):
    args = stats.Args(src=[tmp_path / "nowhere"], embodiment="oxe_droid", out=tmp_path)
    assert refused(stats.run, args) == (f"--out {tmp_path} is a directory; give the path of the metadata.json to write")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"samples": 0}, "--samples must be at least 1, got 0"),
        ({"samples": -3}, "--samples must be at least 1, got -3"),
        ({"batch_size": 0}, "--batch-size must be at least 1, got 0"),
        ({"batch_size": -1}, "--batch-size must be at least 1, got -1"),
        ({"plot_samples": -1}, "--plot-samples must be at least 0, got -1"),
        ({"device": "foo"}, "--device foo: "),
    ],
)
def test_evaluate_flags(extra, message, tmp_path):
    args = open_loop.Args(source=tmp_path / "run", shards=str(tmp_path / "shards"), out=tmp_path / "out", device="cpu")
    assert refused(open_loop.evaluate, replace(args, **extra)).startswith(message)
    assert not (tmp_path / "out").exists()


def test_evaluate_out_a_file_is_refused_before_the_work(tmp_path):
    (tmp_path / "taken").write_text("a file of the user's\n")
    args = open_loop.Args(
        source=tmp_path / "run", shards=str(tmp_path / "shards"), out=tmp_path / "taken", device="cpu"
    )
    assert refused(open_loop.evaluate, args).startswith(f"--out {tmp_path / 'taken'} is a file")
    assert (tmp_path / "taken").read_text() == "a file of the user's\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_without_a_device(tmp_path):
    args = open_loop.Args(source=tmp_path, shards=str(tmp_path), device="cuda")
    assert refused(open_loop.evaluate, args) == "--device cuda: no CUDA device is visible"
    assert refused(shards.check_arguments, shards.Args(device="cuda")) == "--device cuda: no CUDA device is visible"


@pytest.mark.parametrize("device", ["foo", "cuda:x", "gpu"])
def test_shards_device(device):
    assert refused(shards.check_arguments, shards.Args(device=device)) == (
        f"--device must be cpu, cuda or cuda:N, got {device!r}"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"samples": 0}, "--samples must be at least 1, got 0"),
        ({"samples": -1}, "--samples must be at least 1, got -1"),
    ],
)
def test_preview_flags(extra, message, tmp_path):
    args = preview.Args(shards=str(tmp_path / "shards"), vae=tmp_path / "vae.pth", out=tmp_path / "out")
    assert refused(preview.preview, replace(args, **extra)) == message
    (tmp_path / "file").write_text("")
    assert refused(preview.preview, replace(args, out=tmp_path / "file")).startswith(f"--out {tmp_path / 'file'}")


def test_a_variant_the_shards_do_not_hold(small_shards):
    assert len(open_sets(DataConfig(shards=str(small_shards), variant=0))) == 1
    assert refused(open_sets, DataConfig(shards=str(small_shards), variant=5)) == (
        f"--data.variant 5: {small_shards} holds 1 variant(s) per window (0-0; auto draws one per visit)"
    )


def test_held_out_episodes_without_a_window(droid_root):
    """Episode 1 of the sample DROID data has 62 rows, fewer than a window's 97."""
    ds = LeRobotDataset(droid_root)
    shards.check_held_out_windows("0,2", (0, 2), ds, 97)  # both long enough
    shards.check_held_out_windows("0.5", (0, 1), ds, 97)  # a fraction: one of them gives windows
    assert refused(shards.check_held_out_windows, "1,2", (1, 2), ds, 97) == (
        "--val-episodes 1,2: episodes 1 (62 rows) give no window (a window needs 97 rows); hold out longer episodes"
    )
    assert "episodes 1 (62 rows)" in refused(shards.check_held_out_windows, "0.5", (1,), ds, 97)
