"""The eval-ready export (train/dit/export.py), checked as both official loaders would see it, without their code:
files and index, key set, shapes and dtypes equal to the base, frozen-encoder tensors byte-identical, DiT tensors the
trained ones, config.json describing the DiT, conf.yaml from the base, metadata.json from the shards. Written by two
real gloo ranks and by the trainer under torchrun; refusals of unusable bases; a SIGKILL mid-export leaves the
previous export whole."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest
import torch
import yaml

from tests.helpers import copy_tree, edit_export_conf, rewrite_weights
from wampipe.shardformat.index import Window
from wampipe.train.dit.export import check_base
from wampipe.train.dit.model import build_model
from wampipe.train.dit.weights import DREAMZERO_PREFIX, WeightsError


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def _with_tensors(edit):
    def make(base, out):
        folder = rewrite_weights(base, out, edit)
        for rel in ("config.json", "experiment_cfg"):
            (shutil.copytree if (base / rel).is_dir() else shutil.copyfile)(base / rel, folder / rel)
        return folder

    return make


P = DREAMZERO_PREFIX
BAD_BASES = {
    "extra DiT key": (
        _with_tensors(lambda sd: {**sd, P + "blocks.5.ffn.0.weight": torch.zeros(2)}),
        "1 base keys the model does not have, e.g. ['blocks.5.ffn.0.weight']",
    ),
    "missing DiT key": (
        _with_tensors(lambda sd: {k: v for k, v in sd.items() if k != P + "head.head.weight"}),
        "1 model keys absent from the base, e.g. ['head.head.weight']",
    ),
    "shape": (
        _with_tensors(lambda sd: {**sd, P + "head.head.bias": torch.zeros(3)}),
        "action_head.model.head.head.bias has shape (3,) in the base",
    ),
    "peft": (
        _with_tensors(lambda sd: {**sd, P + "blocks.0.self_attn.q.lora_A.weight": torch.zeros(2)}),
        "PEFT/LoRA keys",
    ),
    "no config": (lambda b, o: (copy_tree(b, o) / "config.json").unlink() or o, "no config.json"),
    "not dreamzero": (
        lambda b, o: _edit_config(copy_tree(b, o), lambda c: c.pop("action_head_cfg")) or o,
        "no action_head_cfg.config.diffusion_model_cfg",
    ),
    "other embodiment": (
        lambda b, o: edit_export_conf(copy_tree(b, o), lambda c: c["transforms"].clear()) or o,
        "no transforms.libero_sim (the shards' embodiment)",
    ),
    "lora only": (
        lambda b, o: edit_export_conf(copy_tree(b, o), lambda c: c.update(save_lora_only=True)) or o,
        "save_lora_only is true",
    ),
    "stale index": (
        lambda b, o: (copy_tree(b, o) / "model-00002-of-00010.safetensors").unlink() or o,
        "lists model-00002-of-00010.safetensors, which is missing",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BASES))
def test_unusable_bases_are_refused_naming_the_reason(official_base, small_dit, tmp_path, case):
    make, message = BAD_BASES[case]
    bad = make(official_base, tmp_path / "bad")
    with torch.device("meta"):
        model = build_model(small_dit)
    with pytest.raises(WeightsError) as err:
        check_base(bad, model, "libero_sim")
    assert message in str(err.value) and str(bad) in str(err.value)


# What the official constructors read from config.json, and the DiTConfig attribute each must equal.
# CausalWanModel(**diffusion_model_cfg): every entry is a keyword argument (an unknown one is a TypeError); a width
# left out silently takes the official default (noted) and the trained tensors then fail to load.
OFFICIAL_DIT_ARGS = {
    "model_type": "model_type",
    "dim": "dim",
    "in_dim": "in_dim",
    "ffn_dim": "ffn_dim",
    "out_dim": "out_dim",
    "freq_dim": "freq_dim",
    "eps": "eps",
    "num_heads": "num_heads",
    "num_layers": "num_layers",
    "frame_seqlen": "frame_seqlen",
    "max_chunk_size": "max_chunk_size",
    "num_frame_per_block": "num_frame_per_block",
    "num_action_per_block": "num_action_per_block",
    "num_state_per_block": "num_state_per_block",
    "text_len": "text_len",  # default 512; the official forward asserts the text context has this length
    "text_dim": "text_dim",  # default 4096
    "action_dim": "action_dim",  # default 32
    "max_state_dim": "max_state_dim",  # default 64
    "hidden_size": "hidden_size",  # default 1024 (the state encoder / action decoder MLP width)
}
# read but left at the official default, which our DiT has (checked on the model below); max_num_embodiments is
# overridden to 1 inside the constructor, the leading dim of our category weights
OFFICIAL_DIT_DEFAULTS = {
    "patch_size": (1, 2, 2),
    "sink_size": 0,
    "qk_norm": True,
    "cross_attn_norm": True,
    "num_registers": 8,
    "max_num_embodiments": 32,
}
OFFICIAL_DIT_OTHER = {
    "_target_",
    "_convert_",
    "diffusion_model_pretrained_path",
    "concat_first_frame_latent",
}  # default true: y onto the latents; only our 'i2v' does that
# WANPolicyHead(config): the head-level fields it reads with no usable default (num_frames has none at all)
OFFICIAL_HEAD_FIELDS = {
    "action_dim": "action_dim",
    "max_action_dim": "action_dim",
    "max_state_dim": "max_state_dim",
    "num_frame_per_block": "num_frame_per_block",
}


def _check_official_fields(config: dict, cfg, tag: str, conf: dict, latent_frames: int) -> None:
    from wampipe.shardformat.embodiments import get_embodiment

    head = config["action_head_cfg"]["config"]
    dm = head["diffusion_model_cfg"]
    assert set(dm) <= set(OFFICIAL_DIT_ARGS) | OFFICIAL_DIT_OTHER, set(dm) - set(OFFICIAL_DIT_ARGS) - OFFICIAL_DIT_OTHER
    assert {k: dm.get(k) for k in OFFICIAL_DIT_ARGS} == {k: getattr(cfg, a) for k, a in OFFICIAL_DIT_ARGS.items()}
    assert dm["concat_first_frame_latent"] is (cfg.model_type == "i2v")
    assert {k: head.get(k) for k in OFFICIAL_HEAD_FIELDS} == {
        k: getattr(cfg, a) for k, a in OFFICIAL_HEAD_FIELDS.items()
    }
    window = get_embodiment(tag).window
    assert head["num_frames"] == window.num_frames and 1 + (head["num_frames"] - 1) // 4 == latent_frames  # VAE 4x
    assert (
        head["action_horizon"] == window.action_horizon == len(conf["modality_configs"][tag]["action"]["delta_indices"])
    )
    assert (config["action_dim"], config["action_horizon"]) == (head["action_dim"], head["action_horizon"])


def test_config_json_carries_every_field_the_official_constructors_read(
    small_shards, official_base, small_dit, tmp_path
):
    from wampipe.shardformat.index import ShardIndex
    from wampipe.train.data import SampleReader
    from wampipe.train.dit.export import eval_config, export_official

    index = ShardIndex(small_shards)
    reader = SampleReader(index, None)  # pyright: ignore[reportArgumentType]  # raw() decodes no model input
    latent_frames = reader.raw(*cast(Window, index.windows[0]).variants[0])[1]["latents"].shape[1]
    reader.close()
    model = build_model(small_dit)
    assert model.patch_embedding.kernel_size == OFFICIAL_DIT_DEFAULTS["patch_size"]
    assert model.state_encoder.layer1.W.shape[0] == model.action_decoder.layer2.W.shape[0] == 1
    tag = index.manifest.embodiment
    conf = yaml.safe_load((official_base / "experiment_cfg" / "conf.yaml").read_text())

    def drop_new_fields(config):  # a base written without them: an export must add them
        head = config.pop("action_horizon") and config["action_head_cfg"]["config"]
        for key in ("num_frames", "action_horizon"):
            head.pop(key)
        head["diffusion_model_cfg"].pop("hidden_size")

    stale = copy_tree(official_base, tmp_path / "stale")
    _edit_config(stale, drop_new_fields)
    for folder in (
        official_base,
        export_official(model, tmp_path / "export", official_base, small_shards),
        export_official(model, tmp_path / "stale_export", stale, small_shards),
    ):
        _check_official_fields(json.loads((folder / "config.json").read_text()), small_dit, tag, conf, latent_frames)
    config = json.loads((official_base / "config.json").read_text())
    i2v = replace(small_dit, model_type="i2v", in_dim=small_dit.out_dim + 5)  # 14B-type: y concatenated
    _check_official_fields(eval_config(config, i2v, [tag]), i2v, tag, conf, latent_frames)
