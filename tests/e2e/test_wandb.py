"""--metrics.wandb-project: a real 1-rank torchrun of the tiny recipe logging to W&B in offline mode, the run's
records read back from the .wandb file it writes (wandb's own protobuf schema) against metrics.jsonl and the run's
config.yaml."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT

BLOCK = 32768  # the .wandb file is a LevelDB-style log: records in 32 KiB blocks, each chunk behind a 7-byte header


def wandb_records(path: Path) -> list:
    """Every record of a .wandb file (wandb 0.31 ships no Python reader of its own: its core is a Go binary)."""
    # protobuf builds the message classes at import: pyright cannot see them
    from wandb.proto.wandb_internal_pb2 import Record  # pyright: ignore[reportAttributeAccessIssue]

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7  # after the file header: magic, 2-byte ident, version
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)  # after the CRC
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow
def test_an_offline_wandb_run_holds_the_logged_fields_and_the_config(tiny_shards, tmp_path):
    run_dir, wandb_dir = tmp_path / "run", tmp_path / "wandb-files"
    wandb_dir.mkdir()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "WANDB_DIR": str(wandb_dir),
        "WANDB_SILENT": "true",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            "train/main.py",
            "--preset",
            "tiny",
            "--data.shards",
            str(tiny_shards),
            "--checkpoint.dir",
            str(run_dir),
            "--steps",
            "4",
            "--metrics.interval",
            "2",
            "--metrics.no-progress",
            "--metrics.no-tensorboard",
            "--checkpoint.no-export",
            "--metrics.wandb-project",
            "test",
            "--metrics.wandb-mode",
            "offline",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [log] = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(log)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("test", "run")
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in jsonl] == [2, 4]
    assert [{k: row[k] for k in jsonl[0]} for row in history] == jsonl  # every field, every interval
    config = {item.key: json.loads(item.value_json) for item in run.config.update if item.key != "_wandb"}
    assert config == yaml.safe_load((run_dir / "config.yaml").read_text())["train"]  # the run's settings, once
    assert config["metrics"]["wandb_project"] == "test"
