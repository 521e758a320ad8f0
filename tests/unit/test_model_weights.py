"""Official names and shapes (strict, on the meta device) and the checkpoint loaders on tiny files."""

import json
import logging
import math

import pytest
import torch
from safetensors.torch import save_file

from wampipe.train.dit.model import build_model
from wampipe.train.dit.weights import Checkpoint, WeightsError, allowed_absent, load_weights, save_weights

from tests.helpers import ASSETS


def read_keys(name: str) -> dict[str, tuple[int, ...]]:
    """The official DiT key list `tests/assets/<name>` (key, shape, dtype per line; derived from the model code)."""
    out = {}
    for line in (ASSETS / name).read_text().splitlines():
        if line and not line.startswith("#"):
            key, shape, _ = line.split("\t")
            out[key] = tuple(json.loads(shape.replace("(", "[").replace(")", "]").replace(",]", "]")))
    return out


@pytest.mark.parametrize(
    "preset,keys_file,n_params,n_new",
    [
        ("droid-5b", "dreamzero_5b_keys.txt", 5_606_692_832, 606_905_120),
        ("droid-14b", "dreamzero_14b_keys.txt", 16_484_292_448, 89_413_664),
    ],
)
def test_official_names_and_shapes_load_strictly(preset, keys_file, n_params, n_new):
    keys = read_keys(keys_file)
    with torch.device("meta"):
        model = build_model(preset)
        sd = {k: torch.empty(shape) for k, shape in keys.items()}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == keys
    model.load_state_dict(sd, strict=True, assign=True)
    assert sum(p.numel() for p in model.parameters()) == n_params
    # what a Wan base lacks (docs/REFERENCE.md#7-dit-token-layout-rope-and-timesteps): enc/dec for both, plus the CLIP
    # branch for the ti2v 5B
    assert sum(math.prod(s) for k, s in keys.items() if allowed_absent(model, k)) == n_new


def _tiny(**kw):
    torch.manual_seed(0)
    return build_model("tiny", **kw)


def _assert_same_params(a, b):
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("max_shard_bytes", [1 << 40, 60_000])
def test_export_roundtrip(tmp_path, max_shard_bytes):
    src = _tiny()
    path = save_weights(src, tmp_path / "export", max_shard_bytes=max_shard_bytes)
    if max_shard_bytes < 1 << 40:
        assert path.name == "model.safetensors.index.json" and len(list(path.parent.glob("model-*"))) > 1
    dst = build_model("tiny")
    report = load_weights(dst, tmp_path / "export")
    assert report.source == "export" and report.initialised == []
    _assert_same_params(src, dst)


def test_full_dreamzero_checkpoint_pt(tmp_path):
    src = _tiny()
    ckpt = {f"action_head.model.{k}": v for k, v in src.state_dict().items()}
    ckpt["action_head.text_encoder.block.0.weight"] = torch.zeros(3)  # frozen encoders ride along, ignored
    ckpt["action_head.vae.model.conv.weight"] = torch.zeros(3)
    torch.save({"state_dict": ckpt}, tmp_path / "dreamzero.pt")
    dst = build_model("tiny")
    report = load_weights(dst, tmp_path / "dreamzero.pt")
    assert report.source == "dreamzero" and report.loaded == len(src.state_dict())
    _assert_same_params(src, dst)
    del ckpt["action_head.model.blocks.0.ffn.0.weight"]
    torch.save(ckpt, tmp_path / "broken.pth")
    with pytest.raises(WeightsError, match="broken.pth.*blocks.0.ffn.0.weight"):
        load_weights(build_model("tiny"), tmp_path / "broken.pth")


def test_wan_base_cold_start_ti2v(tmp_path, caplog):
    src = _tiny()
    base = {k: v.to(torch.bfloat16) for k, v in src.state_dict().items() if not allowed_absent(src, k)}
    # Wan's on-disk layout: sharded safetensors + diffusion_pytorch_model.safetensors.index.json
    names = sorted(base)
    half = len(names) // 2
    shards = {
        "diffusion_pytorch_model-00001-of-00002.safetensors": names[:half],
        "diffusion_pytorch_model-00002-of-00002.safetensors": names[half:],
    }
    for fname, keys in shards.items():
        save_file({k: base[k].contiguous() for k in keys}, str(tmp_path / fname))
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}})
    )
    torch.save({}, tmp_path / "Wan2.2_VAE.pth")  # other files in a Wan folder are not read
    assert len(Checkpoint(tmp_path).shapes) == len(base)

    dst = build_model("tiny")
    with torch.no_grad():
        for p in dst.parameters():
            p.fill_(7.0)
    with caplog.at_level(logging.INFO, logger="wampipe.train.dit.weights"):
        report = load_weights(dst, tmp_path, source="wan")
    assert report.source == "wan"
    new = set(report.initialised)
    assert any(k.startswith("action_encoder.") for k in new) and "img_emb.proj.1.weight" in new
    assert "blocks.1.cross_attn.k_img.weight" in new and "blocks.0.cross_attn.q.weight" not in new
    assert "cold start" in caplog.text and "img_emb" in caplog.text and "state_encoder" in caplog.text
    sd = dst.state_dict()
    for k in base:
        assert torch.equal(sd[k], base[k].float()), k
    # reference init of the additions
    assert sd["blocks.0.cross_attn.k_img.bias"].eq(0).all() and sd["blocks.0.cross_attn.norm_k_img.weight"].eq(1).all()
    assert sd["img_emb.proj.0.weight"].eq(1).all() and sd["img_emb.proj.0.bias"].eq(0).all()
    assert sd["action_encoder.W2.b"].eq(0).all() and 0.01 < sd["action_encoder.W2.W"].std() < 0.03
    w = sd["blocks.0.cross_attn.v_img.weight"]
    bound = math.sqrt(6 / (w.shape[0] + w.shape[1]))
    assert w.abs().max() <= bound and w.std() > bound / 3  # xavier-uniform, not the fill value


def test_wan_base_must_have_clip_branch_for_i2v(tmp_path):
    src = _tiny(model_type="i2v", in_dim=12)
    base = {k: v for k, v in src.state_dict().items() if not k.startswith("img_emb.")}
    torch.save(base, tmp_path / "wan21.pth")
    with pytest.raises(WeightsError, match="img_emb"):
        load_weights(build_model("tiny", model_type="i2v", in_dim=12), tmp_path / "wan21.pth", source="wan")


def test_shape_mismatch_names_key(tmp_path):
    sd = _tiny().state_dict()
    sd["head.head.weight"] = torch.zeros(3, 64)
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightsError, match="bad.safetensors: head.head.weight has shape"):
        load_weights(build_model("tiny"), tmp_path / "bad.safetensors")


def test_missing_and_unexpected_keys_are_named_with_counts(tmp_path):
    sd = _tiny().state_dict()
    del sd["blocks.0.ffn.0.weight"], sd["blocks.1.ffn.0.weight"]
    sd["blocks.0.self_attn.q.base_layer.weight"] = torch.zeros(1)  # an unmerged LoRA's name
    save_file(sd, str(tmp_path / "peft.safetensors"))
    with pytest.raises(WeightsError) as err:
        load_weights(build_model("tiny"), tmp_path / "peft.safetensors")
    assert str(err.value) == (
        f"{tmp_path / 'peft.safetensors'} (export): 2 model keys missing, e.g. ['blocks.0.ffn.0.weight', "
        "'blocks.1.ffn.0.weight']; 1 keys the model does not have, e.g. ['blocks.0.self_attn.q.base_layer.weight']; "
        "PEFT/LoRA names: merge the LoRA into the base weights first"
    )
