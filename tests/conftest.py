"""Shared fixtures, each built once per test session (a fixture imported into several test modules would be built
once per module): sample LeRobot datasets, tiny encoder checkpoints, the DROID shards the CLI builds from them,
synthetic shards, and a local S3 server. Tests only read them; a test that changes one works on a copy. With
pytest-xdist (`make test` runs one test process per core) the processes build the file fixtures once between them
(`once`). What tests share besides fixtures is in tests/helpers.py; no test module imports another.

Two kinds of test, a folder each (README, Tests): tests/e2e/ runs the tools as a user does, in processes of their own
(the CLI, torchrun, a shard build, the S3 server); tests/unit/ calls the code in this process and starts no process,
which `unit_tests_start_no_process` checks, so the split stays true as tests are added."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from wampipe.train.dit.model import DiTConfig
from tests.helpers import build, once

# Two test processes on two cores each start builds and trainers whose torch threads fill the cores: OpenMP's
# threads, spinning while they wait for work (its default), then take the cores from each other's processes (two
# concurrent sample builds: 43 s instead of 23 s). Sleeping instead changes no result: the thread counts are the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# what makes a test end-to-end besides its own mark (`e2e`, or `slow`: multi-process trainer runs): a fixture that
# builds shards through the CLI or serves S3
E2E_FIXTURES = {"droid_shards", "libero_shards", "held_out_3", "s3_server", "small_disk"}
E2E_FOLDER = Path(__file__).parent / "e2e"


@pytest.fixture(scope="session")
def droid_root(tmp_path_factory) -> Path:
    """DROID layout (LeRobot v2.1, 3 H.264 cameras 180x320, 15 fps), 4 episodes of lengths 192, 62, 97, 133."""
    from devtools.sample_data import write_sample_dataset

    return once(tmp_path_factory, "droid_root", lambda d: write_sample_dataset(d / "droid", "droid"))


@pytest.fixture(scope="session")
def libero_root(tmp_path_factory) -> Path:
    """LIBERO layout (LeRobot v2.0, 2 PNG cameras 256x256 in parquet, 10 fps), episodes of 168, 47, 73, 109 frames."""
    from devtools.sample_data import write_sample_dataset

    return once(tmp_path_factory, "libero_root", lambda d: write_sample_dataset(d / "libero", "libero"))


@pytest.fixture(scope="session")
def libero_v3_root(tmp_path_factory) -> Path:
    """The LIBERO content in the LeRobot v3.0 layout (multi-episode parquet and mp4 files)."""
    from devtools.sample_data import write_sample_dataset

    return once(tmp_path_factory, "libero_v3_root", lambda d: write_sample_dataset(d / "libero_v3", "libero-v3"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> Path:
    """Every supported encoder format: Wan .pth files and Diffusers/transformers folders, a umT5-format tokenizer."""
    from devtools.tiny_checkpoints import write_tiny_checkpoints

    return once(tmp_path_factory, "tiny_checkpoints", lambda d: write_tiny_checkpoints(d / "ckpt"))


@pytest.fixture(scope="session")
def droid_shards(tmp_path_factory, droid_root, tiny_checkpoints) -> Path:
    """The sample DROID dataset built by the CLI (default executor: the local pool on CPU) with the tiny checkpoints."""

    def make(folder: Path) -> Path:
        done = build(droid_root, folder / "droid", "droid", tiny_checkpoints)
        (folder / "build-stdout.txt").write_text(done.stdout)  # beside the shards, not in them
        (folder / "build-stderr.txt").write_text(done.stderr)
        return folder / "droid"

    return once(tmp_path_factory, "droid_shards", make)


@pytest.fixture(scope="session")
def libero_shards(tmp_path_factory, libero_root, tiny_checkpoints) -> Path:
    """The sample LIBERO dataset built by the CLI with the same tiny checkpoints as `droid_shards`."""

    def make(folder: Path) -> Path:
        done = build(libero_root, folder / "libero", "libero", tiny_checkpoints)
        (folder / "build-stderr.txt").write_text(done.stderr)  # beside the shards, not in them
        return folder / "libero"

    return once(tmp_path_factory, "libero_shards", make)


@pytest.fixture(scope="session")
def held_out_3(tmp_path_factory, droid_root, tiny_checkpoints) -> Path:
    """The sample DROID dataset (episodes 0-3; 1 is shorter than a window) with episode 3 held out; the tests that
    use it leave it as built."""

    def make(folder: Path) -> Path:
        build(droid_root, folder / "droid", "droid", tiny_checkpoints, "--val-episodes", "3")
        return folder / "droid"

    return once(tmp_path_factory, "held_out_3", make)


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Path:
    """Synthetic shards of the tiny recipe: 5 episodes x 5 windows, 7 samples per shard (4 shards, the last short)."""
    from devtools.synthetic import make_synthetic_shards

    def make(folder: Path) -> Path:
        make_synthetic_shards(folder / "shards", "tiny", episodes=5, windows_per_episode=5, samples_per_shard=7, seed=1)
        return folder / "shards"

    return once(tmp_path_factory, "tiny_shards", make)


@pytest.fixture(scope="session")
def small_shards(tmp_path_factory) -> Path:
    """Synthetic shards of the tiny recipe: 3 episodes x 3 windows, 4 samples per shard."""
    from devtools.synthetic import make_synthetic_shards

    def make(folder: Path) -> Path:
        make_synthetic_shards(folder / "shards", "tiny", episodes=3, windows_per_episode=3, samples_per_shard=4, seed=1)
        return folder / "shards"

    return once(tmp_path_factory, "small_shards", make)


@pytest.fixture(scope="session")
def official_base(tmp_path_factory, small_shards) -> Path:
    """A random-weight checkpoint folder in the official DreamZero layout (several files + index) for the DiT the
    trainer builds for `small_shards`."""
    from devtools import tiny_base

    def make(folder: Path) -> Path:
        return tiny_base.write_base(tiny_base.Args(out=folder / "base", shards=small_shards, max_shard_mb=0.05, seed=5))

    return once(tmp_path_factory, "official_base", make)


@pytest.fixture(scope="session")
def small_dit(small_shards) -> DiTConfig:
    """The DiT the trainer builds for `small_shards` (the tiny preset takes its widths from them)."""
    from wampipe.train.builder import model_config
    from wampipe.train.config import Config, DataConfig

    return model_config(Config(data=DataConfig(shards=small_shards)))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (moto's standalone server) on localhost, one per test session."""
    from devtools.s3 import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3") / "server.log").start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, request) -> str:
    """A fresh bucket on the session's S3 server, with the AWS_* variables pointing at it for this test (and the
    processes it starts); returns its s3:// URL."""
    import re

    from wampipe.shardformat.storage import ShardStore

    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):  # the machine's own would win
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"{re.sub(r'[^a-z0-9]+', '-', request.node.name.lower())[:40].strip('-')}-{uuid.uuid4().hex[:8]}"
    ShardStore(f"s3://{bucket}").fs.mkdir(bucket)
    return f"s3://{bucket}"


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs: a disk that fills for real."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()})")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def pytest_collection_modifyitems(config, items):
    """The folder is the kind: every test under tests/e2e/ is marked e2e, and a test under tests/unit/ that needs
    processes (its mark, or a fixture that builds shards or serves S3) stops the collection, naming it."""
    misplaced = []
    for item in items:
        if E2E_FOLDER in Path(item.path).parents:
            item.add_marker(pytest.mark.e2e)
        elif any(map(item.get_closest_marker, ("e2e", "slow"))) or E2E_FIXTURES & set(item.fixturenames):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(f"end-to-end tests outside tests/e2e/ (move them there): {', '.join(misplaced)}")


@pytest.fixture(scope="module")
def raw_root(tmp_path_factory) -> Path:
    """A raw DROID dataset of 8 episodes, with failed ones and a keep-ranges file (the selection's input)."""
    from devtools.sample_data import write_sample_dataset

    return write_sample_dataset(tmp_path_factory.mktemp("raw") / "droid", "droid-raw", episodes=8)


@pytest.fixture(scope="module")
def ranges_file(raw_root) -> Path:
    """`raw_root`'s keep-ranges file."""
    from devtools.sample_data import keep_ranges_path

    return keep_ranges_path(raw_root)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, tiny_shards) -> Path:
    """A finished synthetic shard directory (4 shards, text table, statistics, manifest, work/ spills), plus the
    leftovers an interrupted writer may leave: a hidden temporary file and a lock file."""
    import shutil

    out = Path(shutil.copytree(tiny_shards, tmp_path_factory.mktemp("shards") / "tiny"))
    (out / ".shard-000009.tar.123.0a1b2c3d.tmp").write_bytes(b"partial")
    (out / "finalize.lock").write_text("123")
    return out


@pytest.fixture(scope="module")
def loader_shards(tmp_path_factory) -> Path:
    """25 windows x 2 variants in shards of 7 (the last one short), 5 synthetic episodes; each episode's first and last
    windows have anchor multiplicity 3 and 2, so an anchor-weighted epoch visits 5 x 8 = 40 windows."""
    from devtools import synthetic

    out = tmp_path_factory.mktemp("shards") / "tiny"
    synthetic.make_synthetic_shards(
        out, "tiny", episodes=5, windows_per_episode=5, augment_variants=2, samples_per_shard=7, seed=3
    )
    return out


@contextlib.contextmanager
def recording_processes():
    """The processes started meanwhile (commands, multiprocessing children), as a list of their descriptions."""
    started = []
    real_init, real_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def recording_init(self, args, *rest, **kwargs):
        started.append(args if isinstance(args, str) else " ".join(map(str, args)))
        real_init(self, args, *rest, **kwargs)

    def recording_start(self):
        started.append(f"multiprocessing child {self.name}")
        real_start(self)

    subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = recording_init, recording_start
    try:
        yield started
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = real_init, real_start


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request):
    """A test not marked e2e fails if it started a process (a command, or a multiprocessing child), naming it."""
    if request.node.get_closest_marker("e2e"):
        yield
        return
    with recording_processes() as started:
        yield
    assert not started, f"a unit test started a process ({started[0][:200]}): move it to tests/e2e/"


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A fixture of a unit test file (or one of its tests) that starts a process stops the test, naming it: the
    check above sees only the test's own call. The session's shared builds in this file are setup for both kinds."""
    if fixturedef.scope == "session" or E2E_FOLDER in Path(request.node.path).parents:
        return (yield)
    with recording_processes() as started:
        result = yield
    if started:
        raise pytest.UsageError(
            f"fixture {fixturedef.argname} of {request.node.nodeid} started a process ({started[0][:200]}): "
            f"the tests that use it belong in tests/e2e/"
        )
    return result
