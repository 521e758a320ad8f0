"""The stream's default worker count leaves each encoder process the cores it keeps busy: three per GPU (its launch
thread, its batch preparation, the compiler at start), one for an encoder on the CPU."""

from typing import Literal

import pytest
import torch

from wampipe.preprocess import shards


def args(device: str, executor: Literal["stream", "local", "ray"] = "stream") -> shards.Args:
    return shards.Args(
        dataset="droid",
        src="src",  # pyright: ignore[reportArgumentType]  # src is never read here
        out="out",
        device=device,
        executor=executor,
    )


@pytest.mark.parametrize(
    "cores, gpus, device, workers",
    [
        (64, 4, "cuda", 52),  # four encoder processes: 12 cores left to them
        (16, 1, "cuda", 13),
        (16, 4, "cuda:2", 13),  # one named GPU: one encoder process
        (2, 1, "cuda", 1),  # never fewer than one worker
        (16, 0, "cpu", 15),  # the CPU encoder keeps one core
    ],
)
def test_stream_leaves_cores_to_each_encoder(monkeypatch, cores, gpus, device, workers):
    monkeypatch.setattr(shards.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert shards.default_workers(args(device)) == workers


def test_local_executor_defaults_to_one_worker():
    assert shards.default_workers(args("cpu", executor="local")) == 1
