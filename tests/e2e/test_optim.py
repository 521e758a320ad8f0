"""AdamW with bf16 moments (--optim.moments bf16): unbiased stochastic rounding, torch's AdamW update, and a real
two-rank run that resumes exactly and stays close to fp32 moments."""

import json
import subprocess

import pytest

from tests.helpers import ROOT, trainer_command, trainer_env


@pytest.mark.slow
def test_two_ranks_with_bf16_moments_resume_exactly_and_stay_close_to_fp32(tiny_shards, tmp_path):
    def run(name, *extra):
        cmd = [
            *trainer_command(tiny_shards, tmp_path / name),
            "--steps",
            "6",
            "--checkpoint.interval",
            "3",
            "--checkpoint.no-export",
            "--parallel.backend",
            "gloo",
            *extra,
        ]
        subprocess.run(cmd, check=True, env=trainer_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
        return [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    bf16 = run("bf16", "--optim.moments", "bf16")
    run("resumed", "--optim.moments", "bf16", "--stop-after", "3")
    resumed = run("resumed", "--optim.moments", "bf16")
    fp32 = run("fp32", "--optim.moments", "fp32")
    assert resumed == bf16  # metrics.jsonl holds steps 1-3 of the first invocation and 4-6 of the resume
    assert bf16[:2] == fp32[:2] and bf16 != fp32  # the same first update, then the rounding shows
    assert bf16 == pytest.approx(fp32, rel=0.05)
