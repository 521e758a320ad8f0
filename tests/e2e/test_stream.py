"""The streaming executor: CPU workers feeding a long-lived encoder process give the local pool's bytes, stop with a
worker's one-line error, and leave no process behind when the run is killed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from wampipe.preprocess.check import check
from tests.helpers import ROOT, alive, build, children, manifest, shards_cmd, unexpected, wait_for

pytestmark = pytest.mark.e2e  # every test runs the tools in processes of their own


def test_stream_gives_the_bytes_of_the_local_pool(droid_shards, droid_root, tiny_checkpoints, tmp_path):
    # droid_shards was built by the default executor on CPU (the local pool); the stream with the same torch threads
    # (the encoders' and the resize's rounding depend on the count) must give the same shards
    threads = json.loads((droid_shards / "inputs.json").read_text())["threads_per_worker"]
    out = tmp_path / "stream"
    done = build(
        droid_root, out, "droid", tiny_checkpoints, "--executor", "stream", "--threads-per-worker", str(threads)
    )
    assert check(out) == []
    assert manifest(out)["shards"] == manifest(droid_shards)["shards"]
    assert unexpected(done.stderr) == []  # the encoder's process prints no library warning either
    # the stream says where its start went: weight checks and hashing, then each encoder's process start and load
    assert re.search(r"^start: encoder weights checked in [\d.]+ s, inputs hashed in [\d.]+ s$", done.stdout, re.M)
    assert re.search(
        r"^encoders on cpu: ready [\d.]+ s after the run started it \(process start [\d.]+ s, "
        r"loading [\d.]+ s: diffusers import [\d.]+ s, VAE weights [\d.]+ s, CLIP weights [\d.]+ s\)$",
        done.stdout,
        re.M,
    ), done.stdout


def test_the_compiled_vae_gives_the_same_bytes_on_every_executor_and_batch_cut(droid_root, tiny_checkpoints, tmp_path):
    """The compiled VAE (the default with a GPU, asked for here on a CPU): the local pool, which cuts its batches
    unit by unit, and the stream, which cuts them from the samples of two workers as they arrive, give the same
    shards: each compiled call is padded to --batch-size, so a clip's bits depend neither on its batch's company nor
    on the executor. The local build compiles into an empty compile cache (private to the user: it holds code); the
    stream's encoder then finds every graph there and gets the same bits from the cached kernels."""
    cache = tmp_path / "compile-cache"
    common = ("--vae-compile", "on", "--compile-cache", str(cache), "--threads-per-worker", "1")
    stream, local = tmp_path / "stream", tmp_path / "local"
    done = build(droid_root, local, "droid", tiny_checkpoints, *common, "--executor", "local", "--workers", "1")
    assert any(cache.iterdir()) and cache.stat().st_mode & 0o077 == 0
    assert unexpected(done.stderr) == []
    done = build(droid_root, stream, "droid", tiny_checkpoints, *common, "--executor", "stream", "--workers", "2")
    # inductor's progress bar in the encoder process, which ends with os._exit, leaves no semaphore to the tracker
    assert unexpected(done.stderr) == [], done.stderr
    said = done.stdout
    assert check(stream) == [] and check(local) == []
    assert manifest(stream)["shards"] == manifest(local)["shards"]
    # recorded like any byte-changer, by the kernels' name: the 5B's encoder fuses its norms in channels-last
    assert json.loads((stream / "inputs.json").read_text())["vae_compile"] == "fused-norms-channels-last"
    ready = re.search(
        r"^encoders on cpu: ready .*: diffusers import [\d.]+ s, VAE weights [\d.]+ s, "
        r"compiling [\d.]+ s, CLIP weights [\d.]+ s; (\d+) of (\d+) graphs from the compile cache\)$",
        said,
        re.M,
    )
    assert ready and int(ready[1]) == int(ready[2]) > 0, said


def test_a_bad_episode_with_fail_fast_stops_the_stream_with_its_line(droid_root, tiny_checkpoints, tmp_path):
    src = tmp_path / "droid"
    subprocess.run(["cp", "-r", str(droid_root), str(src)], check=True)
    video = sorted(src.glob("videos/**/episode_000002.mp4"))[0]
    video.write_bytes(video.read_bytes()[:2000])  # truncated: undecodable
    done = subprocess.run(
        shards_cmd(
            src, tmp_path / "out", "droid", tiny_checkpoints, "--executor", "stream", "--workers", "2", "--fail-fast"
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "episode 2" in last and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="children die with their parent through prctl")
def test_killing_the_run_stops_every_worker_and_encoder(droid_root, tiny_checkpoints, tmp_path):
    out = tmp_path / "killed"
    cmd = shards_cmd(
        droid_root,
        out,
        "droid",
        tiny_checkpoints,
        "--executor",
        "stream",
        "--workers",
        "2",
        "--anchor-stride",
        "2",
        "--episodes-per-unit",
        "1",
    )
    owner = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(
            lambda: len(children(owner.pid)) >= 3 and list((out / "work").glob(".unit-*.tmp")),
            "two workers, an encoder and a unit being written",
        )
        procs = children(owner.pid)
        owner.send_signal(signal.SIGKILL)
    finally:
        owner.kill()
        owner.wait()
    wait_for(lambda: not any(alive(p) for p in procs), "the stream's processes to die with the run", timeout=15)
    files = sorted(p.name for p in (out / "work").iterdir())
    time.sleep(1)
    assert sorted(p.name for p in (out / "work").iterdir()) == files  # nothing writes on
    # (resuming a killed stream with the local pool: test_shards.py::test_kill_and_resume)


def spawned(pid: int) -> list[int]:
    """The multiprocessing children of `pid` that run a target (not its resource tracker)."""
    found = []
    for child in children(pid):
        try:
            if b"spawn_main" in open(f"/proc/{child}/cmdline", "rb").read():
                found.append(child)
        except OSError:
            continue
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_encoder_killed_while_importing_stops_the_run_before_any_worker_starts(
    droid_root, tiny_checkpoints, tmp_path
):
    """The CPU workers start only once the encoder processes have imported their libraries; an encoder that dies
    before that ends the run with its one line, and no worker was ever started."""
    out = tmp_path / "out"
    run = subprocess.Popen(
        shards_cmd(droid_root, out, "droid", tiny_checkpoints, "--executor", "stream", "--workers", "2"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: spawned(run.pid), "the encoder process", timeout=120)
        (encoder,) = spawned(run.pid)  # alone: still importing, the workers wait for it
        os.kill(encoder, signal.SIGKILL)
        seen, deadline = set(), time.time() + 120
        while run.poll() is None and time.time() < deadline:
            seen.update(spawned(run.pid))
            time.sleep(0.02)
        _, stderr = run.communicate()
    finally:
        run.kill()
        run.wait()
    assert seen <= {encoder}, f"CPU workers started before the encoder had imported: {seen}"
    assert run.returncode == 1
    assert stderr.strip().splitlines()[-1] == (
        "encoder-cpu died (killed by SIGKILL): out of host memory? see `dmesg`"
    ), stderr
    assert "Traceback" not in stderr and "resource_tracker" not in stderr, stderr
    assert not (out / "manifest.json").exists()
