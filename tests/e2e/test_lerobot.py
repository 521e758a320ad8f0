"""The LeRobot reader on the three sample layouts: metadata, columns, cameras, instructions, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.e2e
def test_inspect_cli(droid_root):
    out = subprocess.run(
        [sys.executable, "-m", "preprocess", "inspect", str(droid_root), "--decode"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "LeRobot v2.1, 4 episodes, 484 frames, 15 fps" in out
    assert "decoded 1452 frames from 4 episodes" in out


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["droid", "libero"])
def test_sample_dataset_same_files_with_worker_processes(tmp_path, layout, droid_root, libero_root):
    from devtools.sample_data import write_sample_dataset

    serial = {"droid": droid_root, "libero": libero_root}[layout]  # the session fixtures: one process, seed 0
    parallel = write_sample_dataset(tmp_path / layout, layout, workers=2)
    files = sorted(p.relative_to(serial) for p in serial.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(parallel) for p in parallel.rglob("*") if p.is_file())
    for rel in files:
        assert (serial / rel).read_bytes() == (parallel / rel).read_bytes(), rel
