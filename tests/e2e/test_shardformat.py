"""The shard contract (shardformat): keys, durable writes under real process kills and races, sealed and versioned
JSON, member offsets and checksums, and `preprocess check` on every way a directory can be damaged."""

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from wampipe.shardformat.files import atomic_write_bytes, atomic_writer


def _slow_writer(path: str, ready: str) -> None:
    with atomic_writer(Path(path)) as f:
        f.write(b"x" * 4096)
        f.flush()
        Path(ready).write_text("")
        time.sleep(60)


@pytest.mark.e2e
def test_a_writer_killed_mid_write_leaves_no_visible_file(tmp_path):
    target, ready = tmp_path / "shard-000000.tar", tmp_path / "ready"
    proc = multiprocessing.get_context("fork").Process(target=_slow_writer, args=(str(target), str(ready)))
    proc.start()
    assert proc.pid is not None
    deadline = time.time() + 60
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert not target.exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ready"]
    # hidden, per process
    assert len(leftovers) == 1 and leftovers[0].startswith(f".shard-000000.tar.wampipe-{proc.pid}-")


def _racer(path: str, byte: int, rounds: int) -> None:
    for _ in range(rounds):
        atomic_write_bytes(Path(path), bytes([byte]) * (1 << 18))


@pytest.mark.e2e
def test_processes_racing_on_one_path_never_mix_their_bytes(tmp_path):
    target = tmp_path / "manifest.json"
    ctx = multiprocessing.get_context("fork")
    racers = [ctx.Process(target=_racer, args=(str(target), b, 20)) for b in (ord("a"), ord("b"))]
    for p in racers:
        p.start()
    seen = set()
    while any(p.is_alive() for p in racers):
        if target.exists():
            data = target.read_bytes()
            assert len(data) == 1 << 18 and len(set(data)) == 1, "a reader saw a mixed or partial file"
            seen.add(data[0])
    for p in racers:
        p.join()
        assert p.exitcode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temporary file left behind
