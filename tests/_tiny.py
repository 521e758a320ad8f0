"""Tiny frozen-encoder checkpoints, written once per test session by the project's own script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """Every supported format: Wan .pth files and Diffusers/transformers folders, plus a umT5-format tokenizer."""
    out = tmp_path_factory.mktemp("tiny_checkpoints")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_checkpoints.py"), "--out", str(out)],
                   check=True, capture_output=True)
    return out
