"""LoRA fine-tuning (train/dit/lora.py): the official recipe's trainable set (5B counts on the meta device), the update
starting at zero, gradients only where the recipe trains, merging; and the trainer under torchrun with two gloo
ranks from an official base built on the meta device: a run stopped and resumed logs the uninterrupted run's losses
exactly, frozen weights stay the base's, a resume with another rank is refused in one line, the merged export equals
the base with the lora-only export's adapters folded in, and the lora-only folder has the official PEFT layout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader

from wampipe.train.dit.lora import ADAPTERS, PEFT_PREFIX, TRAINABLE
from wampipe.train.dit.weights import DREAMZERO_PREFIX

from tests.helpers import ROOT, merge_lora

STEPS = 6


# ---------------------------------------------------------------- the trainer under torchrun


def _train(shards: Path, base: Path, run_dir: Path, *extra: str, ranks: int = 2, check: bool = True):
    """The trainer on `ranks` gloo ranks (torchrun; 1 = a plain process, whose last stderr line is the trainer's)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    cmd = [
        sys.executable,
        *launcher,
        str(ROOT / "train" / "main.py"),
        "--preset",
        "tiny",
        "--data.shards",
        str(shards),
        "--checkpoint.dir",
        str(run_dir),
        "--steps",
        str(STEPS),
        "--checkpoint.interval",
        "3",
        "--metrics.interval",
        "1",
        "--metrics.no-progress",
        "--metrics.no-tensorboard",
        "--data.num-workers",
        "0",
        "--parallel.deterministic",
        "--parallel.param-dtype",
        "float32",
        "--checkpoint.export-dtype",
        "float32",
        "--model.init-from",
        str(base),
        "--model.init-device",
        "meta",
        "--lora.rank",
        "4",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "29641"}
    return subprocess.run(cmd, check=check, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def runs(small_shards, official_base, tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted LoRA run (merged export), and one stopped after a checkpoint and resumed (lora-only)."""
    full, resumed = tmp_path_factory.mktemp("lora_full"), tmp_path_factory.mktemp("lora_resumed")
    _train(small_shards, official_base, full)
    lora_only = ["--checkpoint.export-lora", "lora-only", "--checkpoint.export-base", str(official_base)]
    _train(small_shards, official_base, resumed, "--stop-after", "3", *lora_only)
    assert not (resumed / "export").exists() and len(_losses(resumed)) == 3
    _train(small_shards, official_base, resumed, *lora_only)
    return full, resumed


@pytest.mark.slow
def test_resumed_lora_run_reproduces_the_losses_and_saves_trainable_state_only(runs):
    full, resumed = runs
    assert [s for s, _ in _losses(full)] == list(range(1, STEPS + 1))
    assert _losses(resumed) == _losses(full)
    meta = FileSystemReader(str(full / "step-000006")).read_metadata()
    saved = {k.split(".", 1)[1] for k in meta.state_dict_metadata if k.startswith("model.")}
    assert saved and all(k.split(".")[0] in TRAINABLE or k.rsplit(".", 1)[1] in ADAPTERS for k in saved)
    assert "blocks.0.self_attn.q.lora_A" in saved


@pytest.mark.slow
def test_resume_with_another_rank_is_refused_in_one_line(small_shards, official_base, runs, tmp_path):
    run_dir = tmp_path / "run"
    subprocess.run(["cp", "-r", str(runs[0]), str(run_dir)], check=True)
    done = _train(small_shards, official_base, run_dir, "--lora.rank", "8", "--steps", "9", ranks=1, check=False)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "a checkpoint of another model (lora: checkpoint {'rank': 4" in last
    assert "this run {'rank': 8" in last and "--lora flags" in last


def _base_dit(base: Path) -> dict[str, torch.Tensor]:
    sd = {}
    for f in sorted(base.glob("*.safetensors")):
        sd.update(load_file(f))
    return {k[len(DREAMZERO_PREFIX) :]: v for k, v in sd.items() if k.startswith(DREAMZERO_PREFIX)}


@pytest.mark.slow
def test_exports_merged_and_lora_only_agree(runs, official_base):
    base = official_base
    full, resumed = runs
    merged = load_file(full / "export" / "model.safetensors")
    lora = load_file(resumed / "export" / "model.safetensors")
    base_sd = _base_dit(base)
    assert set(merged) == set(base_sd) and not any("lora" in k for k in merged)

    peft = re.compile(r"blocks\.\d+\.(self_attn|cross_attn)\.[qkvo]|blocks\.\d+\.ffn\.[02]")
    adapters = {k for k in lora if ".lora_" in k}
    assert adapters and all(k.startswith(PEFT_PREFIX) for k in lora)
    for k in adapters:
        named = re.fullmatch(re.escape(PEFT_PREFIX) + r"(.+)\.(lora_[AB])\.default\.weight", k)
        assert named is not None, k
        layer, leaf = named.groups()
        assert peft.fullmatch(layer), k
    plain = {k[len(PEFT_PREFIX) :]: v for k, v in lora.items() if k not in adapters}
    assert {k.split(".")[0] for k in plain} == set(TRAINABLE) | {"blocks", "img_emb"}  # + the CLIP branch
    assert all(".k_img." in k or ".v_img." in k or ".norm_k_img." in k for k in plain if k.startswith("blocks."))

    # re-merging the lora-only tensors onto the base reproduces the merged export
    ours = {**base_sd, **plain}
    ours.update({re.sub(r"\.default\.weight$", "", k[len(PEFT_PREFIX) :]): v for k, v in lora.items() if k in adapters})
    remerged = merge_lora({k: v.float() for k, v in ours.items()}, alpha=4.0)
    assert set(remerged) == set(merged)
    for k, v in merged.items():
        torch.testing.assert_close(remerged[k], v, rtol=0, atol=1e-6, msg=k)
    frozen = ["patch_embedding.weight", "blocks.0.cross_attn.k_img.weight", "blocks.1.norm3.weight"]
    assert all(torch.equal(merged[k], base_sd[k].float()) for k in frozen)  # frozen: the base's, bit for bit
    assert not torch.equal(merged["blocks.0.self_attn.q.weight"], base_sd["blocks.0.self_attn.q.weight"].float())

    head = json.loads((resumed / "export" / "config.json").read_text())["action_head_cfg"]["config"]
    assert (head["train_architecture"], head["skip_component_loading"], head["defer_lora_injection"]) == (
        "lora",
        False,
        False,
    )
    assert (head["lora_rank"], head["lora_alpha"], head["lora_target_modules"]) == (4, 4.0, "q,k,v,o,ffn.0,ffn.2")
    conf = yaml.safe_load((resumed / "export" / "experiment_cfg" / "conf.yaml").read_text())
    assert conf["save_lora_only"] is True
    assert conf | {"save_lora_only": False} == yaml.safe_load((base / "experiment_cfg" / "conf.yaml").read_text())


@pytest.mark.slow
def test_resumed_full_fine_tuning_does_not_read_init_from(small_shards, official_base, tmp_path):
    """Rank 0 = full fine-tuning: the step checkpoint holds every weight, so a resumed run skips --model.init-from
    (a 14B base is ~1 min of reading) and still logs the uninterrupted run's losses; a LoRA run re-reads it (above)."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _train(small_shards, official_base, full, "--lora.rank", "0", ranks=1)
    _train(small_shards, official_base, resumed, "--lora.rank", "0", "--stop-after", "3", ranks=1)
    gone = tmp_path / "moved-base"  # the base is not there any more: reading it would stop the run
    done = _train(small_shards, gone, resumed, "--lora.rank", "0", ranks=1)
    assert "--model.init-from is not read" in done.stdout
    assert [s for s, _ in _losses(full)] == list(range(1, STEPS + 1)) and _losses(resumed) == _losses(full)
    fresh = _train(small_shards, gone, tmp_path / "fresh", "--lora.rank", "0", ranks=1, check=False)
    assert fresh.returncode != 0 and str(gone) in fresh.stderr  # without a checkpoint it is read, and refused
