"""`--model.init-from` into a model sharded by FSDP2 over two real gloo ranks (built on meta, wrapped for activation
checkpointing, materialized, then each rank reads its own rows): the parameters equal the unsharded load exactly, for
an official DreamZero folder, a Wan base (cold start) and our export; a missing or extra key is refused on every rank
with the names; the trainer exits with that one line; the load benchmark runs end to end on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import start_processes

from wampipe.train.config import ParallelConfig
from wampipe.train.dit.model import DiTConfig, build_model
from wampipe.train.parallel import parallelize
from wampipe.train.dit.weights import DREAMZERO_PREFIX, WeightsError, allowed_absent, load_weights, save_weights
from tests.helpers import ROOT, rewrite_weights
from wampipe.train.runtime import leave_finished


WORLD = 2
SEED = 3


def _worker(rank: int, tmp: str, cases: dict, dit: DiTConfig) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    try:
        results = {}
        for name, (path, source) in cases.items():
            with torch.device("meta"):
                model = build_model(dit)
            parallelize(model, ParallelConfig(activation_checkpoint="full"))  # names gain the wrapper's prefix
            model.to_empty(device="cpu")
            try:
                report = load_weights(model, path, source, seed=SEED)
            except WeightsError as err:
                results[name] = ("refused", str(err))
                continue
            local = {n: cast(DTensor, p).to_local().shape[0] for n, p in model.named_parameters()}
            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            results[name] = ("loaded", report.source, report.initialised, local, sd if rank == 0 else None)
        torch.save(results, f"{tmp}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # a finished rank leaves as the trainer's do: the interpreter's teardown of the gloo group's C++ objects can
    # abort a rank whose work is done ("terminate called without an active exception")
    leave_finished()


@pytest.mark.e2e
def test_sharded_load_equals_unsharded_and_refuses_bad_keys(official_base, small_dit, tmp_path):
    plain = build_model(small_dit)
    wan = {k: v.to(torch.bfloat16) for k, v in plain.state_dict().items() if not allowed_absent(plain, k)}
    torch.save(wan, tmp_path / "wan.pth")  # a Wan base: the DreamZero additions absent
    save_weights(build_model(small_dit), tmp_path / "export", max_shard_bytes=100_000)
    missing = rewrite_weights(
        official_base,
        tmp_path / "missing",
        lambda sd: {k: v for k, v in sd.items() if k != DREAMZERO_PREFIX + "blocks.1.ffn.2.weight"},
    )
    extra = rewrite_weights(
        official_base,
        tmp_path / "extra",
        lambda sd: {**sd, DREAMZERO_PREFIX + "blocks.9.ffn.0.weight": torch.zeros(2, 2)},
    )
    cases = {
        "official": (official_base, "auto"),
        "wan": (tmp_path / "wan.pth", "wan"),
        "export": (tmp_path / "export", "auto"),
        "missing": (missing, "auto"),
        "extra": (extra, "auto"),
    }
    start_processes(_worker, args=(str(tmp_path), cases, small_dit), nprocs=WORLD, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    for name, source in [("official", "dreamzero"), ("wan", "wan"), ("export", "export")]:
        path, _ = cases[name]
        reference = build_model(small_dit)
        report = load_weights(reference, path, source, seed=SEED)
        status, got_source, initialised, local, sd = ranks[0][name]
        assert (status, got_source, initialised) == ("loaded", source, report.initialised), name
        assert sd.keys() == reference.state_dict().keys()
        for k, v in reference.state_dict().items():
            assert torch.equal(sd[k], v), (name, k)
        # each rank held its torch.chunk share of the rows, e.g. 1 and 0 of a [1, ...] category weight
        other = ranks[1][name][3]
        for n, rows in local.items():
            full = sd[n.replace("_checkpoint_wrapped_module.", "")].shape[0]
            assert (rows, other[n]) == (min(full, -(-full // 2)), full - min(full, -(-full // 2))), n
    assert ranks[0]["wan"][2] and all(allowed_absent(reference, k) for k in ranks[0]["wan"][2])

    for r in range(WORLD):
        status, message = ranks[r]["missing"]
        assert status == "refused" and "1 model keys missing" in message and "blocks.1.ffn.2.weight" in message
        status, message = ranks[r]["extra"]
        assert status == "refused" and "1 keys the model does not have" in message and "blocks.9.ffn.0" in message
        assert str(extra) in message


@pytest.mark.slow
def test_trainer_refuses_a_checkpoint_with_a_missing_key_in_one_line(small_shards, official_base, tmp_path):
    broken = rewrite_weights(
        official_base,
        tmp_path / "broken",
        lambda sd: {k: v for k, v in sd.items() if k != DREAMZERO_PREFIX + "head.head.bias"},
    )
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train" / "main.py"),
            "--preset",
            "tiny",
            "--data.shards",
            str(small_shards),
            "--checkpoint.dir",
            str(tmp_path / "run"),
            "--model.init-from",
            str(broken),
            "--model.init-device",
            "meta",
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "MASTER_PORT": "29631", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"--model.init-from {broken} (dreamzero): 1 model keys missing, e.g. ['head.head.bias']"
    )
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_bench_init_load_runs_on_cpu(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_init_load.py"),
            "--preset",
            "tiny",
            "--nproc",
            "2",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "result.json").read_text())
    assert (result["preset"], result["world_size"], result["init_device"], result["backend"]) == (
        "tiny",
        2,
        "meta",
        "gloo",
    )
    assert result["params"] == sum(p.numel() for p in build_model("tiny").parameters())
    assert [r["rank"] for r in result["ranks"]] == [0, 1] and result["base_write_s"] > 0
    for r in result["ranks"]:
        assert r["build_load_s"] > 0 and r["peak_rss_gib"] >= r["rss_before_gib"] > 0 and r["peak_anon_rss_gib"] > 0
