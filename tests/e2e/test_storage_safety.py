"""`python -m preprocess shards` deletes or replaces only what a build of it wrote, never follows a planted link, and
object storage fails at start and in one line: real files, real processes, the real local S3 server (moto's) and
real sockets that refuse or never answer."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from devtools import synthetic
from wampipe.errors import UsageError
from wampipe.preprocess import outdir
from wampipe.preprocess.__main__ import main
from wampipe.preprocess.check import check
from wampipe.preprocess.remote import AT_START, publish
from wampipe.shardformat.files import atomic_write_json
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.storage import ShardStore, upload_order
from tests.helpers import FOREIGN, FOREIGN_REFUSAL, ROOT, refusal, shards_cmd
from devtools.s3 import CREDENTIALS, S3Server

# Another tool's shard directory: files at the names a build writes, none of them recorded by a build.


def failed_at_start(cmd: list[str]) -> str:
    """The one line of a CLI run that must fail (exit 1, no traceback); a hang is cut after two minutes."""
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.e2e
def test_a_planted_lock_link_is_refused_and_its_target_untouched(droid_root, tiny_checkpoints, tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("someone's file\n")
    (out / outdir.LOCK).symlink_to(victim)
    line = failed_at_start(shards_cmd(droid_root, out, "droid", tiny_checkpoints))
    assert line == f"{out / outdir.LOCK}: cannot be the lock file (a symbolic link): remove it, or use another --out"
    assert victim.read_text() == "someone's file\n" and sorted(p.name for p in out.iterdir()) == [outdir.LOCK]
    for plant in (lambda lock: os.link(victim, lock), os.mkfifo):  # a second name of the file, a pipe
        (out / outdir.LOCK).unlink()
        plant(out / outdir.LOCK)
        with pytest.raises(UsageError) as exc, outdir.hold(out):
            pass
        assert str(exc.value) == (
            f"{out / outdir.LOCK}: not a plain file of its own (a device, pipe or hard link): "
            f"remove it, or use another --out"
        )
    assert victim.read_text() == "someone's file\n"


def test_hidden_files_of_the_user_survive_a_run_and_a_failed_run(droid_shards, droid_root, tiny_checkpoints, tmp_path):
    out = Path(shutil.copytree(droid_shards, tmp_path / "out"))  # a complete build: the rerun finalizes again
    mine = [out / ".notes.tmp", out / "work" / ".x.tmp", out / "text" / ".draft.json.tmp"]
    for path in mine:
        path.write_text("mine\n")
    left = out / "work" / ".unit-000009.tar.wampipe-123-0a1b2c3d.tmp"  # what a killed run of the tool leaves
    left.write_bytes(b"partial")
    main(shards_cmd(droid_root, out, "droid", tiny_checkpoints)[3:])
    assert check(out) == [] and all(p.read_text() == "mine\n" for p in mine) and not left.exists()

    fresh = tmp_path / "fresh"  # a run that fails after taking the directory: no unit is done
    fresh.mkdir()
    (fresh / ".x.tmp").write_text("mine\n")
    message = refusal(shards_cmd(droid_root, fresh, "droid", tiny_checkpoints, "--stage", "finalize"))
    assert message.startswith(f"cannot finalize {fresh}: units [0, 1] are not done")
    assert (fresh / ".x.tmp").read_text() == "mine\n"


def test_a_remote_prefix_with_a_foreign_build_is_refused_at_start_and_kept(
    s3_bucket, droid_root, tiny_checkpoints, tmp_path
):
    url = f"{s3_bucket}/droid"
    store = ShardStore(url)
    for name, data in FOREIGN.items():
        store.fs.pipe_file(store.path(name), data)
    staging = tmp_path / "staging"
    for extra in ([], ["--overwrite"]):
        message = refusal(shards_cmd(droid_root, url, "droid", tiny_checkpoints, "--staging-dir", str(staging), *extra))
        assert message == FOREIGN_REFUSAL.format(where=url, names=", ".join(sorted(FOREIGN)))
        assert {name: store.read_bytes(name) for name in store.list()} == FOREIGN
    assert not (staging / "work").exists()


def test_publishing_over_another_build_needs_overwrite_and_deletes_only_that_builds_files(
    tiny_shards, s3_bucket, tmp_path
):
    url = f"{s3_bucket}/tiny"
    inputs = {
        "dataset": "droid",
        "src": "f" * 64,
        "vae": "v",
        "text_encoder": "t",
        "image_encoder": "i",
        "augment_variants": 0,
        "seed": 1,
        "samples_per_shard": 7,
    }  # a build's record (outdir.RECORD_KEYS)
    first = Path(shutil.copytree(tiny_shards, tmp_path / "first"))
    atomic_write_json(first / outdir.INPUTS, inputs)
    second = tmp_path / "second"
    synthetic.make_synthetic_shards(second, "tiny", episodes=2, windows_per_episode=3, samples_per_shard=4, seed=1)
    atomic_write_json(second / outdir.INPUTS, {**inputs, "samples_per_shard": 4})
    store = ShardStore(url)
    publish(first, url, lambda path, action: None)
    store.fs.pipe_file(store.path("notes.txt"), b"mine\n")  # a user's file beside the build
    before = {name: store.read_bytes(name) for name in store.list()}

    with pytest.raises(UsageError) as exc:
        publish(second, url, lambda path, action: None)
    assert str(exc.value) == (
        f"{url} holds another build (its inputs.json differs from {second / 'inputs.json'}); "
        f"nothing was uploaded or deleted: pass --overwrite to replace it, or use another --out"
    )
    assert {name: store.read_bytes(name) for name in store.list()} == before

    publish(second, url, lambda path, action: None, overwrite=True)
    assert check(url) == [] and store.list() == sorted([*upload_order(second), "notes.txt"])
    assert json.loads(store.read_bytes("manifest.json"))["totals"]["samples"] == 6


def test_a_missing_bucket_is_refused_before_any_unit(s3_bucket, droid_root, tiny_checkpoints, tmp_path):
    url = f"{s3_bucket}-missing/droid"
    bucket = url.split("/")[2]
    staging = tmp_path / "staging"
    line = failed_at_start(shards_cmd(droid_root, url, "droid", tiny_checkpoints, "--staging-dir", str(staging)))
    assert line == f"{url}: list bucket {bucket} failed: The specified bucket does not exist; {AT_START}"
    assert not staging.exists()  # nothing was built


@pytest.mark.e2e
def test_wrong_credentials_are_one_line_at_start(droid_root, tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # this server checks every request's signature
    server = S3Server(tmp_path / "server.log").start()
    try:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        url = "s3://bucket/droid"
        line = failed_at_start(
            shards_cmd(droid_root, url, "droid", tiny_checkpoints, "--staging-dir", str(tmp_path / "staging"))
        )
    finally:
        server.stop()
    assert line == (
        f"{url}: list bucket bucket failed: The AWS Access Key Id you provided does not exist in our "
        f"records; {AT_START}"
    )


@contextmanager
def silent_endpoint() -> Iterator[str]:
    """An HTTP endpoint on localhost that accepts every connection and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:  # closed at the end of the test
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        for connection in accepted:
            connection.close()


@contextmanager
def refusing_endpoint() -> Iterator[str]:
    """An address on localhost where nothing listens: connections are refused."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        address = f"http://127.0.0.1:{probe.getsockname()[1]}"
    yield address


@pytest.mark.e2e
@pytest.mark.parametrize("endpoint", ["closed", "silent"])
def test_an_unreachable_or_stalled_endpoint_is_one_line_at_start(
    endpoint, droid_root, tiny_checkpoints, tmp_path, monkeypatch
):
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WAMPIPE_S3_READ_TIMEOUT", "1")  # 5 tries of 1 s instead of 10 s
    url = "s3://bucket/droid"
    cmd = shards_cmd(droid_root, url, "droid", tiny_checkpoints, "--staging-dir", str(tmp_path / "staging"))
    with silent_endpoint() if endpoint == "silent" else refusing_endpoint() as address:
        monkeypatch.setenv("AWS_ENDPOINT_URL", address)
        line = failed_at_start(cmd)
    reason = "Read timeout on endpoint URL" if endpoint == "silent" else "Could not connect to the endpoint URL"
    assert line.startswith(f'{url}: list bucket bucket failed: {reason}: "{address}/bucket?')
    assert line.endswith(AT_START) and not (tmp_path / "staging").exists()


@pytest.mark.timeout(300)
def test_a_frozen_endpoint_stops_the_loader_within_one_request_deadline(tiny_shards, s3_bucket, s3_server, monkeypatch):
    """Training from s3:// through a proxy that freezes mid-run (connections held open, nothing forwarded): the
    loader's worker gives up after one request's deadline, not after s3fs's nested retries, and the run stops with
    one line naming the shard and the sample."""
    import torch

    from devtools.proxy import FreezableProxy
    from tests.helpers import TINY
    from wampipe.shardformat.storage import S3_TRIES, request_deadline, sync_up
    from wampipe.train.config import DataConfig
    from wampipe.train.data import ShardLoader

    url = f"{s3_bucket}/tiny"
    sync_up(tiny_shards, url)
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    proxy = FreezableProxy((host, int(port)))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("WAMPIPE_S3_READ_TIMEOUT", "1")  # a deadline of 1 + 5 x 1 + 1.9 s
    monkeypatch.setenv("WAMPIPE_S3_CONNECT_TIMEOUT", "1")
    assert request_deadline() == pytest.approx(1 + S3_TRIES * 1 + 1.9, abs=0.1)
    try:
        batches = iter(
            ShardLoader(DataConfig(shards=url, micro_batch_size=2, num_workers=1), TINY, 0, 1, torch.device("cpu"))
        )
        next(batches)
        proxy.freeze()
        with pytest.raises(ShardFormatError) as stop:
            for _ in range(64):  # more batches than the loader prefetched before the freeze
                next(batches)
    finally:
        proxy.close()
    assert str(stop.value).startswith(f"{url}/shard-")
    assert str(stop.value).endswith(
        f": unreadable: no answer from the endpoint within 8 s ({S3_TRIES} tries of "
        f"WAMPIPE_S3_READ_TIMEOUT seconds of silence)"
    )
