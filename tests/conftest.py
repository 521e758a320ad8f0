"""Shared fixtures: sample LeRobot datasets written once per test session by the project's own script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def make_sample(out: Path, layout: str, episodes: int = 4, seed: int = 0, codec: str = "h264") -> Path:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_sample_dataset.py"), "--layout", layout, "--out", str(out),
         "--episodes", str(episodes), "--seed", str(seed), "--codec", codec],
        check=True, capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def droid_root(tmp_path_factory) -> Path:
    """DROID layout (LeRobot v2.1, 3 H.264 cameras 180x320, 15 fps), 4 episodes of lengths 192, 62, 97, 133."""
    return make_sample(tmp_path_factory.mktemp("data") / "droid", "droid")


@pytest.fixture(scope="session")
def libero_root(tmp_path_factory) -> Path:
    """LIBERO layout (LeRobot v2.0, 2 PNG cameras 256x256 in parquet, 10 fps), 4 episodes of lengths 168, 47, 73, 109."""
    return make_sample(tmp_path_factory.mktemp("data") / "libero", "libero")


@pytest.fixture(scope="session")
def libero_v3_root(tmp_path_factory) -> Path:
    """The LIBERO content in the LeRobot v3.0 layout (multi-episode parquet and mp4 files)."""
    return make_sample(tmp_path_factory.mktemp("data") / "libero_v3", "libero-v3")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (moto's standalone server) on localhost, one per test session."""
    from tests.s3 import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3") / "server.log").start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, request) -> str:
    """A fresh bucket on the session's S3 server, with the AWS_* variables pointing at it for this test (and the
    processes it starts); returns its s3:// URL."""
    import re
    import uuid

    from shardformat.storage import ShardStore

    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):  # the machine's own would win
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"{re.sub(r'[^a-z0-9]+', '-', request.node.name.lower())[:40].strip('-')}-{uuid.uuid4().hex[:8]}"
    ShardStore(f"s3://{bucket}").fs.mkdir(bucket)
    return f"s3://{bucket}"
