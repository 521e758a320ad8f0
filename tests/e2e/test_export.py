"""The eval-ready export (train/dit/export.py), checked as both official loaders would see it, without their code:
files and index, key set, shapes and dtypes equal to the base, frozen-encoder tensors byte-identical, DiT tensors the
trained ones, config.json describing the DiT, conf.yaml from the base, metadata.json from the shards. Written by two
real gloo ranks and by the trainer under torchrun; refusals of unusable bases; a SIGKILL mid-export leaves the
previous export whole."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import start_processes

from tests.helpers import ROOT, copy_tree, edit_export_conf
from devtools import tiny_base
from wampipe.train.config import CheckpointConfig, Config, DataConfig, ModelConfig
from wampipe.train.dit.export import export_run, export_weights
from wampipe.train.dit.model import build_model
from wampipe.train.dit.weights import DREAMZERO_PREFIX, load_weights
from wampipe.train.runtime import leave_finished

WORLD = 2
SHIFT = 0.5  # added to every trained parameter, so each DiT tensor differs from the base


def read_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """All tensors and the keys per weight file, checking the one weights form and the index as the loaders do."""
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    assert index.is_file() != single.is_file(), "exactly one of model.safetensors and its index"
    tensors, files = {}, {}
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [single.name]
    assert sorted(p.name for p in folder.glob("*.safetensors")) == names  # nothing stray beside them
    for name in names:
        with safe_open(str(folder / name), "pt") as h:
            files[name] = sorted(h.keys())
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    if index.is_file():
        blob = json.loads(index.read_text())
        assert blob["weight_map"] == {k: n for n, keys in files.items() for k in keys}
        assert blob["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in tensors.values())
    return tensors, files


def _config_only(base: Path, out: Path) -> Path:
    """An official config without weights (a run started from a Wan base), its DiT fields and flags stale."""
    (out / "experiment_cfg").mkdir(parents=True)
    shutil.copyfile(base / "experiment_cfg" / "conf.yaml", out / "experiment_cfg" / "conf.yaml")
    config = json.loads((base / "config.json").read_text())
    head = config["action_head_cfg"]["config"]
    head["diffusion_model_cfg"]["num_action_per_block"] = 99
    head.update(train_architecture="lora", skip_component_loading=False, max_state_dim=64)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _worker(rank: int, tmp: str, shards: Path, init_from: Path, cases: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    from wampipe.train.builder import build

    try:
        for name, base in cases.items():
            data = DataConfig(shards=shards)  # pyright: ignore[reportArgumentType]  # a Path: the loader reads str()
            cfg = Config(
                data=data,
                model=ModelConfig(init_from=init_from, init_device="meta"),
                checkpoint=CheckpointConfig(dir=Path(tmp) / name, export_base=base),
            )
            model = build(cfg, torch.device("cpu"))
            with torch.no_grad():
                for p in model.parameters():
                    cast(DTensor, p).to_local().add_(SHIFT)
            export_run(cfg.checkpoint, model, metadata={"step": 7}, shards=shards)
    finally:
        dist.destroy_process_group()
    # a finished rank leaves as the trainer's do: the interpreter's teardown of the gloo group's C++ objects can
    # abort a rank whose work is done ("terminate called without an active exception")
    leave_finished()


@pytest.mark.e2e
def test_eval_ready_export_from_two_ranks(small_shards, official_base, small_dit, tmp_path):
    single = tiny_base.write_base(tiny_base.Args(out=tmp_path / "single", shards=small_shards, seed=5))
    config_only = _config_only(official_base, tmp_path / "config_only")
    stale = tmp_path / "single_run" / "export"
    stale.mkdir(parents=True)
    (stale / "model.safetensors.index.json").write_text("{}")  # a previous export's index must not survive
    cases = {"sharded_run": official_base, "single_run": single, "config_only_run": config_only}
    start_processes(
        _worker, args=(str(tmp_path), small_shards, official_base, cases), nprocs=WORLD, start_method="spawn"
    )

    trained = {
        k[len(DREAMZERO_PREFIX) :]: (v.float() + SHIFT).to(torch.bfloat16)  # what the ranks held, cast back
        for k, v in read_folder(official_base)[0].items()
        if k.startswith(DREAMZERO_PREFIX)
    }
    model_keys = set(build_model(small_dit).state_dict())
    for name, src in cases.items():
        out = tmp_path / name / "export"
        assert sorted(p.name for p in out.parent.iterdir()) == ["export"]  # no staging folder left
        got, files = read_folder(out)
        dit_keys = {k[len(DREAMZERO_PREFIX) :] for k in got if k.startswith(DREAMZERO_PREFIX)}
        assert dit_keys == model_keys and not any("base_layer" in k or "lora_" in k for k in got)
        for k in dit_keys:
            assert torch.equal(got[DREAMZERO_PREFIX + k], trained[k]), (name, k)
        if name != "config_only_run":
            want, want_files = read_folder(src)
            assert files == want_files  # the base's file names, each holding the same keys
            assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in want.items()}
            for k, v in want.items():
                if not k.startswith(DREAMZERO_PREFIX):  # frozen encoders, byte for byte (0-d log_scale included)
                    assert v.view(torch.uint8).equal(got[k].view(torch.uint8)) if v.dim() else torch.equal(v, got[k])
        else:  # the DiT alone, in the export dtype
            assert set(got) == {DREAMZERO_PREFIX + k for k in model_keys} and list(files) == ["model.safetensors"]
        conf = "experiment_cfg/conf.yaml"
        assert (out / conf).read_bytes() == (src / conf).read_bytes()
        assert (out / "experiment_cfg" / "metadata.json").read_bytes() == (small_shards / "metadata.json").read_bytes()
        head = json.loads((out / "config.json").read_text())["action_head_cfg"]["config"]
        dm = head["diffusion_model_cfg"]
        w = {
            k: got[DREAMZERO_PREFIX + k].shape
            for k in (
                "blocks.0.self_attn.q.weight",
                "blocks.0.ffn.0.weight",
                "patch_embedding.weight",
                "head.head.weight",
                "action_decoder.layer2.W",
                "state_encoder.layer1.W",
            )
        }
        assert dm["dim"] == w["blocks.0.self_attn.q.weight"][0] and dm["ffn_dim"] == w["blocks.0.ffn.0.weight"][0]
        assert dm["in_dim"] == w["patch_embedding.weight"][1] and 4 * dm["out_dim"] == w["head.head.weight"][0]
        assert dm["num_layers"] == len({k.split(".")[1] for k in dit_keys if k.startswith("blocks.")})
        assert head["max_action_dim"] == w["action_decoder.layer2.W"][-1]
        assert head["max_state_dim"] == w["state_encoder.layer1.W"][1]
        assert dm["num_action_per_block"] == small_dit.num_action_per_block and dm["model_type"] == small_dit.model_type
        assert (head["skip_component_loading"], head["defer_lora_injection"], head["train_architecture"]) == (
            True,
            False,
            "full",
        )
        with safe_open(str(out / sorted(files)[0]), "pt") as h:
            assert h.metadata()["format"] == "pt" and h.metadata()["step"] == "7"


P = DREAMZERO_PREFIX


@pytest.mark.slow
def test_trainer_writes_an_eval_ready_export_and_refuses_a_bad_base_at_start(
    small_shards, official_base, small_dit, tmp_path
):
    common = [
        str(ROOT / "train" / "main.py"),
        "--preset",
        "tiny",
        "--data.shards",
        str(small_shards),
        "--steps",
        "2",
        "--checkpoint.interval",
        "0",
        "--metrics.no-progress",
        "--metrics.no-tensorboard",
        "--model.init-from",
        str(official_base),
        "--model.init-device",
        "meta",
        "--data.num-workers",
        "0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "29633"}
    bad = copy_tree(official_base, tmp_path / "bad")
    edit_export_conf(bad, lambda c: c["modality_configs"].clear())
    done = subprocess.run(
        [sys.executable, *common, "--checkpoint.dir", str(tmp_path / "refused"), "--checkpoint.export-base", str(bad)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        f"--checkpoint.export-base {bad}/experiment_cfg/conf.yaml: no modality_configs.libero_sim (the shards' "
        "embodiment); the official loader needs it"
    )
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()  # refused before the first step

    run = tmp_path / "run"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            *common,
            "--checkpoint.dir",
            str(run),
            "--checkpoint.export-base",
            str(official_base),
        ],
        check=True,
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    got, files = read_folder(run / "export")
    want, want_files = read_folder(official_base)
    assert files == want_files
    changed = [k for k in want if k.startswith(P) and not torch.equal(got[k], want[k])]
    assert len(changed) > len(want) // 2  # two AdamW steps move (nearly) every DiT tensor
    assert all(torch.equal(got[k], want[k]) for k in want if not k.startswith(P))
    model = build_model(small_dit)
    report = load_weights(model, run / "export")  # our loader reads the export back, strictly
    assert report.source == "dreamzero" and report.loaded == len(model.state_dict())


def _export_forever(out: str, ready: str) -> None:
    """Export a plain model again and again; `ready` appears after the first complete export."""
    torch.manual_seed(0)
    model = build_model("tiny", dim=256, ffn_dim=1024, num_layers=8)
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        export_weights(model, out, dtype=torch.float32, max_shard_bytes=4 << 20)
        Path(ready).touch()


@pytest.mark.slow
def test_sigkill_mid_export_leaves_the_previous_export_whole(tmp_path):
    out = tmp_path / "export"
    proc = multiprocessing.get_context("spawn").Process(target=_export_forever, args=(str(out), str(tmp_path / "ok")))
    proc.start()
    assert proc.pid is not None
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ok").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        while not (tmp_path / ".export.tmp").exists() and time.monotonic() < deadline:
            time.sleep(0.001)  # the next export is being written
        time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    assert proc.exitcode == -signal.SIGKILL
    tensors, files = read_folder(out)  # complete: every file the index names, sizes adding up
    assert len(files) > 1
    torch.manual_seed(0)
    model = build_model("tiny", dim=256, ffn_dim=1024, num_layers=8)
    rounds = {round((tensors[k] - v).mean().item()) for k, v in model.state_dict().items()}
    assert len(rounds) == 1 and rounds.pop() >= 1  # every tensor from the same export, none mixed in
    load_weights(model, out, source="export")  # strict: all keys present
    export_weights(model, out)  # a later export cleans the killed one's staging folder up
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "ok") == ["export"]
