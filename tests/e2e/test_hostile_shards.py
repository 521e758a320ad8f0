"""Shard directories crafted to attack their reader: each file is sealed again with the project's own sealing, as
anyone who edits a directory can do. The trainer's data entry (`ShardIndex`, what train/main.py calls), the
webdataset decoder and `preprocess check` must refuse each in one line naming the file and field, before anything
is read from outside the directory, written outside the cache, allocated from a crafted size or trained on."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wampipe.preprocess.check import check
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.storage import ShardStore, sync_up
from wampipe.train.config import DataConfig
from wampipe.train.data import ShardLoader
from wampipe.train.dit.export import shard_statistics
from wampipe.train.dit.model import preset
from wampipe.train.dit.weights import WeightsError
from tests.helpers import ROOT, outside_path_refusal, refused, reseal


ESCAPE = "../../../../tmp/x"  # below <cache>/<bucket>/<prefix>/: <cache>/../../tmp/x


@pytest.fixture
def copy(small_shards, tmp_path) -> Path:
    """A fresh copy of the session's small synthetic shards, at <tmp_path>/a/shards."""
    return Path(shutil.copytree(small_shards, tmp_path / "a" / "shards"))


def test_a_text_table_outside_the_directory_is_never_fetched_from_s3(copy, s3_bucket, tmp_path):
    """Trainer with a cache directory and `preprocess check` (a temporary directory per process): the crafted name
    would put the attacker's object at <tmp_path>/tmp/x from either."""
    reseal(copy / "manifest.json", lambda m: m["text_table"].update(file=ESCAPE))
    url = f"{s3_bucket}/shards"
    sync_up(copy, url)
    ShardStore(url).fs.pipe_file(f"{url.removeprefix('s3://')}/{ESCAPE}", b"attacker")  # where the name points
    landing = tmp_path / "tmp"
    message = outside_path_refusal(f"{url}/manifest.json", "text_table.file", ESCAPE)

    assert refused(url, tmp_path / "c" / "cache") == message
    done = subprocess.run(
        [sys.executable, "-m", "preprocess", "check", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path / "t")},
        timeout=120,
    )
    assert (done.returncode, done.stdout.splitlines(), done.stderr) == (
        1,
        [f"FAILED: 1 problem(s) in {url}", f"  {message}"],
        "",
    )
    assert not landing.exists()
    assert not [p for p in (tmp_path / "c").rglob("*") if p.is_file()]  # nothing fetched into the cache either


@pytest.mark.e2e
def test_edited_statistics_stop_the_trainer_at_start(copy, tmp_path):
    """q99 x 100 squeezes every action into a hundredth of its range: trained on silently before."""
    metadata = json.loads((copy / "metadata.json").read_text())
    for stats in metadata.values():
        for block in stats["statistics"].values():
            for sub in block.values():
                sub["q99"] = [q * 100 for q in sub["q99"]]
    (copy / "metadata.json").write_text(json.dumps(metadata))
    message = f"{copy / 'metadata.json'}: sha256 differs from the manifest"
    assert refused(copy) == message
    with pytest.raises(ShardFormatError, match=f"^{re.escape(message)}$"):
        ShardLoader(DataConfig(shards=copy, micro_batch_size=1), preset("tiny"), 0, 1, torch.device("cpu"))
    assert check(copy) == ["metadata.json: sha256 differs from the manifest"]
    with pytest.raises(WeightsError, match=f"^{re.escape(message)}$"):  # nor copied into an export or a tiny base
        shard_statistics(copy)

    # a real trainer start: one rank, stopped before any model is built, with the one line and no traceback
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            str(ROOT / "train" / "main.py"),
            "--preset",
            "tiny",
            "--data.shards",
            str(copy),
            "--checkpoint.dir",
            str(tmp_path / "run"),
            "--steps",
            "1",
            "--metrics.no-progress",
            "--metrics.no-tensorboard",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode != 0
    assert message in done.stderr.splitlines()
    assert "Traceback" not in done.stderr.split(message)[0]  # the rank's own report is the one line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.e2e  # a reader that blocked would block the test's own process: it runs in a child with a deadline
@pytest.mark.parametrize(
    "name, kind, trainer",
    [
        ("metadata.json", "fifo", "refused"),
        ("samples.npy", "link to /dev/zero", "refused"),
        ("shard-000001.json", "fifo", "opened"),
        ("text/prompts.json", "link to /dev/zero", "opened"),
    ],
)
def test_a_pipe_or_a_device_in_the_directory_never_blocks_a_reader(copy, name, kind, trainer):
    """Each file is opened without following a link and without blocking, and must be a regular file: the trainer
    refuses what it reads in one line (and never opens what it does not read), `check` names the file."""
    target = copy / name
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    code = (
        "import sys\nfrom wampipe.preprocess.check import check\nfrom wampipe.shardformat.manifest import "
        "ShardFormatError\nfrom wampipe.shardformat.index import ShardIndex\n"
        "try:\n    ShardIndex(sys.argv[1])\n    print('opened')\nexcept ShardFormatError as e:\n    print(e)\n"
        "for p in check(sys.argv[1], shard_jsons=True):\n    print(p)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    first, *problems = done.stdout.splitlines()
    if trainer == "opened":
        assert first == "opened"
    else:
        assert first.startswith(f"{target}: unreadable: ") and ("not a regular file" in first or "a link" in first)
    assert any(p.startswith(f"{name}: ") or f"/{name}: " in p for p in problems), problems
