"""What the training loop carries from step to step besides the weights and the optimizer, and what a checkpoint
saves of it (train/checkpoint.py: per rank, rank-N.json + rank-N.safetensors beside the DCP shards)."""

from __future__ import annotations

import numpy as np
import torch


def noise_seed(seed: int, rank: int, step: int = 0) -> int:
    """Seed of a rank's noise/timestep stream: distinct across ranks, a pure function of (seed, rank, step)."""
    return 1_000_003 * (seed + 1) + rank + 7919 * step


class TrainState:
    """The loop's host state (torch.distributed.checkpoint's `Stateful`: state_dict / load_state_dict): the optimizer
    step, the steps skipped for a non-finite loss, the warmup the run started with (a resume with a longer --steps
    keeps it), the loader's position (what it has drawn: `samples_seen`) and this rank's noise generator."""

    def __init__(self, loader, seed: int, rank: int, device: torch.device, warmup: int):
        self.step, self.skipped, self.warmup = 0, 0, warmup
        self.loader, self.seed, self.rank = loader, seed, rank
        self.noise = torch.Generator(device).manual_seed(noise_seed(seed, rank))

    @property
    def samples_seen(self) -> np.ndarray:
        """Samples this rank has drawn from each shard set."""
        return self.loader.samples_seen()

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "skipped": self.skipped,
            "warmup": self.warmup,
            "data": self.loader.state_dict(),
            "rng": self.noise.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """`state` as train/checkpoint.py `load` returns it. From a run of another world size it is rank 0's
        (`same_rank` false), whose noise stream is not this rank's: the streams start afresh from the step."""
        self.step, self.skipped, self.warmup = state["step"], state["skipped"], state["warmup"]
        self.loader.load_state_dict(state["data"])
        if state["same_rank"]:
            self.noise.set_state(state["rng"])
        else:
            self.noise.manual_seed(noise_seed(self.seed, self.rank, self.step))
