"""Shard directories on object storage end to end, against a real S3 server on localhost (moto's, in its own
process): the integrity check and a 2-rank training run read s3:// URLs, and a build is published to one."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from devtools import synthetic
from wampipe.errors import UsageError
from wampipe.preprocess import outdir
from wampipe.preprocess.__main__ import main as preprocess_main
from wampipe.preprocess.check import check
from wampipe.preprocess.remote import prefetch_remote_state, publish, published, staging_dir
from wampipe.shardformat.files import atomic_write_json
from wampipe.shardformat.shard import ShardRecord
from wampipe.shardformat.storage import MANIFEST, ShardStore, sync_up, upload_order
from devtools.s3 import upload_then_sigkill
from tests.helpers import ROOT, TINY, tiny_torchrun
from wampipe.train.config import DataConfig
from wampipe.train.data import SampleReader, ShardIndex, ShardLoader


STEPS = 4


def _flip_member_byte(tar: Path, member: str) -> str:
    """Flip one byte inside `member` of the tar's first sample; returns the sample's key."""
    sample = ShardRecord.read(tar.with_suffix(".json")).samples[0]
    ref = next(m for m in sample.members if m.name == member)
    data = bytearray(tar.read_bytes())
    data[ref.offset + ref.size // 2] ^= 0x01
    tar.write_bytes(bytes(data))
    return sample.key


def test_check_reads_a_remote_directory_and_names_a_flipped_byte(tiny_shards, s3_bucket, tmp_path, capsys):
    url = f"{s3_bucket}/tiny"
    sync_up(tiny_shards, url)
    assert check(url) == []

    corrupt = tmp_path / "shard-000002.tar"
    shutil.copyfile(tiny_shards / corrupt.name, corrupt)
    shutil.copyfile(tiny_shards / "shard-000002.json", tmp_path / "shard-000002.json")
    key = _flip_member_byte(corrupt, "clip.npy")
    ShardStore(url).upload(corrupt, corrupt.name)  # one flipped byte, uploaded over the good object
    flipped = f"shard-000002.tar: sample {key}: member clip.npy checksum mismatch (corrupt shard)"
    with pytest.raises(SystemExit) as done:
        preprocess_main(["check", url])
    assert done.value.code == 1
    assert capsys.readouterr().out.splitlines() == [
        f"FAILED: 2 problem(s) in {url}",
        f"  {flipped}",
        "  shard-000002.tar: sha256 differs from the manifest",
    ]
    assert check(f"{s3_bucket}/nowhere") == [
        f"{s3_bucket}/nowhere/manifest.json: missing (an unfinished run, or not a shard directory)"
    ]


def _train(shards: str, run_dir: Path, *extra: str) -> None:
    command = tiny_torchrun(
        "--data.shards",
        shards,
        "--checkpoint.dir",
        str(run_dir),
        "--steps",
        str(STEPS),
        "--checkpoint.interval",
        "2",
        "--checkpoint.no-export",
        "--metrics.interval",
        "1",
        "--metrics.no-progress",
        "--metrics.no-tensorboard",
        "--parallel.deterministic",
        "--data.num-workers",
        "1",
        *extra,
    )
    done = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_loader_batches_from_s3_equal_local_ones_and_resume(tiny_shards, s3_bucket, s3_server):
    """One rank of two, one loader worker (its own connections): the same batches, bit for bit, from either place,
    and a loader resumed from the S3 loader's state continues them; every sample is one ranged GET of its tar."""
    url = f"{s3_bucket}/tiny"
    sync_up(tiny_shards, url)
    requests = len(s3_server.requests())

    def loader(root):
        return ShardLoader(DataConfig(shards=root, micro_batch_size=2, num_workers=1), TINY, 0, 2, torch.device("cpu"))

    local = loader(str(tiny_shards))
    expected = [next(it) for it in [iter(local)] for _ in range(6)]
    remote = loader(url)
    got = [next(it) for it in [iter(remote)] for _ in range(3)]
    resumed = loader(url)
    resumed.load_state_dict(remote.state_dict())
    got += [next(it) for it in [iter(resumed)] for _ in range(3)]
    for a, b in zip(expected, got, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tar_gets = [status for method, path, status in s3_server.requests()[requests:] if path.endswith(".tar")]
    assert len(tar_gets) >= 6 * 2 and set(tar_gets) == {"206"}


@pytest.mark.slow
def test_training_from_s3_continues_a_local_run_with_its_losses(tiny_shards, s3_bucket, s3_server, tmp_path):
    """2 ranks (gloo) with a loader worker each: a run on the local directory, then the same run resumed from its
    step-2 checkpoint on the S3 copy with a whole-shard cache logs the same losses for steps 3 and 4."""
    url, bucket = f"{s3_bucket}/tiny", s3_bucket.removeprefix("s3://")
    sync_up(tiny_shards, url)
    _train(str(tiny_shards), tmp_path / "local")
    shutil.copytree(tmp_path / "local", tmp_path / "s3")
    shutil.rmtree(tmp_path / "s3" / f"step-{STEPS:06d}")  # as if stopped after the step-2 checkpoint
    requests = len(s3_server.requests())
    cache = tmp_path / "cache"
    _train(url, tmp_path / "s3", "--data.cache-dir", str(cache))
    assert _losses(tmp_path / "s3") == _losses(tmp_path / "local") and len(_losses(tmp_path / "local")) == STEPS
    # the index and the text table, then whole shards into the cache: no ranged reads of the tars once cached
    tar_gets = [path for method, path, status in s3_server.requests()[requests:] if path.endswith(".tar")]
    cached = {p.name: p.read_bytes() for p in (cache / bucket / "tiny").rglob("shard-*.tar")}
    assert cached and all(data == (tiny_shards / name).read_bytes() for name, data in cached.items())
    assert tar_gets and {Path(p).name for p in tar_gets} == set(cached)


@pytest.mark.slow
def test_publish_killed_midway_resumes_refuses_other_inputs_and_replaces_a_build(tiny_shards, s3_bucket, tmp_path):
    url = f"{s3_bucket}/tiny"
    inputs = {
        "dataset": "droid",
        "src": "f" * 64,
        "vae": "v",
        "text_encoder": "t",
        "image_encoder": "i",
        "augment_variants": 0,
        "image_features": "encoded",
        "vae_compile": False,
        "seed": 1,
        "samples_per_shard": 7,
    }
    staging = staging_dir(url, tmp_path / "staging")  # a finished build as `preprocess shards` leaves it
    shutil.copytree(tiny_shards, staging)  # with work/ spills
    with outdir.hold(staging):  # and the lock file
        atomic_write_json(staging / outdir.INPUTS, inputs)
    order = upload_order(staging)
    assert "inputs.json" in order and not [p for p in order if p.startswith("work/") or p.endswith(".lock")]

    # killed by SIGKILL after the second file
    assert upload_then_sigkill("preprocess.remote:publish", staging, url) == [
        ["uploaded", order[0]],
        ["uploaded", order[1]],
    ]
    store = ShardStore(url)
    assert store.list() == order[:2] and not published(url, staging)
    assert check(url) == [f"{url}/manifest.json: missing (an unfinished run, or not a shard directory)"]

    report = publish(staging, url)
    assert report.skipped == order[:2] and report.uploaded == order[2:]
    assert check(url) == [] and store.list() == sorted(order) and published(url, staging)

    # Another machine (a fresh staging directory) resuming this build gets its inputs: other inputs are refused.
    fresh = staging_dir(url, tmp_path / "fresh")
    prefetch_remote_state(url, fresh)
    assert (fresh / "inputs.json").read_bytes() == (staging / "inputs.json").read_bytes()
    with pytest.raises(UsageError, match="--seed: 1 -> 2"):
        outdir.claim(fresh, {**inputs, "seed": 2}, overwrite=False)
    outdir.claim(fresh, inputs, overwrite=False)
    assert published(url, fresh)

    # A smaller build of other inputs replaces it (--overwrite): afterwards the remote holds exactly the new build.
    small = tmp_path / "small"
    synthetic.make_synthetic_shards(small, "tiny", episodes=2, windows_per_episode=3, samples_per_shard=4, seed=1)
    atomic_write_json(small / outdir.INPUTS, {**inputs, "samples_per_shard": 4})
    with pytest.raises(UsageError, match="pass --overwrite to replace the remote build"):
        prefetch_remote_state(url, small)
    prefetch_remote_state(url, small, overwrite=True)
    publish(small, url, lambda path, action: None, overwrite=True)
    assert check(url) == [] and store.list() == sorted(upload_order(small)) and len(upload_order(small)) < len(order)
    assert json.loads(store.read_bytes(MANIFEST))["totals"]["samples"] == 6


@pytest.mark.slow
def test_loader_benchmark_reads_from_s3(s3_bucket, tmp_path):
    url = f"{s3_bucket}/bench"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_loader.py"),
            "--preset",
            "tiny",
            "--shards",
            url,
            "--workers",
            "0",
            "1",
            "--batches",
            "2",
            "--micro-batch",
            "2",
            "--windows",
            "8",
            "--out",
            str(tmp_path / "bench"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["shards"], [(r["workers"], r["cache"]) for r in result["runs"]]) == (
        "s3",
        [(0, "remote"), (1, "remote")],
    )
    assert all(r["samples"] == 4 and r["samples_per_s_per_worker"] > 0 for r in result["runs"])
    assert ShardStore(url).read_bytes(MANIFEST) == (tmp_path / "bench" / "shards" / MANIFEST).read_bytes()


def test_a_prefix_rebuilt_with_other_data_never_reuses_the_old_copies(tmp_path, s3_bucket):
    """Two builds of the same sizes (other seeds) published one after the other at one URL, read through one cache
    directory: the second is read as itself, since copies are kept per build (the manifest's sha256), not by size."""
    url, cache = f"{s3_bucket}/set", tmp_path / "cache"
    builds = [tmp_path / "a", tmp_path / "b"]
    for seed, root in enumerate(builds, 1):
        synthetic.make_synthetic_shards(
            root, "tiny", episodes=2, windows_per_episode=2, samples_per_shard=2, seed=seed, compress="none"
        )
    assert [p.stat().st_size for p in sorted(builds[0].glob("shard-*.tar"))] == [
        p.stat().st_size for p in sorted(builds[1].glob("shard-*.tar"))
    ]

    def samples(root, cache_dir=None):
        index = ShardIndex(str(root), cache_dir)
        reader = SampleReader(index, TINY)
        return [reader.raw_row(r)[1]["latents"] for r in range(len(index.table))]

    for root in builds:
        sync_up(root, url)
        got, expected = samples(url, cache), samples(root)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.slow
def test_a_failed_run_from_s3_leaves_no_temporary_copy_behind(tiny_shards, s3_bucket, tmp_path):
    """Without a cache dir, the text table's copy lives in a temporary folder of the rank; a run that fails after
    opening the shards (here a variant they do not hold) ends without Python's exit handlers, and still removes it."""
    url = f"{s3_bucket}/tiny"
    sync_up(tiny_shards, url)
    temp = tmp_path / "tmp"
    temp.mkdir()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(ROOT / "train" / "main.py"),
        "--preset",
        "tiny",
        "--data.shards",
        url,
        "--data.variant",
        "5",
        "--checkpoint.dir",
        str(tmp_path / "run"),
        "--metrics.no-progress",
        "--metrics.no-tensorboard",
    ]
    done = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(temp)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0 and f"--data.variant 5: {url} holds 1 variant(s) per window" in done.stderr, (
        done.stderr[-3000:]
    )
    assert list(temp.glob("wampipe-store-*")) == []
