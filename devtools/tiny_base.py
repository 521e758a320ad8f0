"""A random-weight DreamZero checkpoint folder in the official layout, for `--model.init-from` and
`--checkpoint.export-base` in tests, `make demo` and the load benchmark. CLI: scripts/make_tiny_base.py.

out/config.json                          VLAConfig-shaped: every field the official constructors read
                                         (diffusion_model_cfg of the DiT, window), encoder paths, load flags
out/model-0000i-of-0000N.safetensors     action_head.model.* (the DiT), then tiny stand-ins for the frozen encoders
out/model.safetensors.index.json         (action_head.{text_encoder,image_encoder,vae}.*: bf16, fp32, a 0-d
                                         log_scale), cut into files of at most --max-shard-mb as transformers does
out/experiment_cfg/conf.yaml             the sections the loaders read (model target, the embodiment's transforms and
                                         modality_configs): a skeleton with the official names, not a released file
out/experiment_cfg/metadata.json         the shards' statistics (with --shards)

DiT values: the reference init (seeded) when the fp32 model fits in 2 GiB, else N(0, 0.02) per tensor, generated
one file at a time (the load benchmark needs bytes, not a trainable model). With --shards the DiT is the one the
trainer builds for those shards (the tiny preset takes its widths from them).
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
import yaml
from safetensors.torch import save_file

from wampipe.shardformat.embodiments import get_embodiment
from wampipe.train.config import Config, DataConfig, ModelConfig
from wampipe.train.dit.export import eval_config, shard_statistics
from wampipe.train.builder import model_config
from wampipe.train.dit.model import CausalWanModel, DiTConfig, preset
from wampipe.train.dit.weights import DREAMZERO_PREFIX, shard_file_names, shard_groups, write_index

GROOT = "groot.vla.model.dreamzero"
# frozen-encoder stand-ins: a few keys of each Wan layout, tiny shapes, the dtypes a released checkpoint mixes
ENCODERS = {
    "action_head.text_encoder.token_embedding.weight": ((64, 32), torch.bfloat16),
    "action_head.text_encoder.blocks.0.attn.q.weight": ((32, 32), torch.bfloat16),
    "action_head.text_encoder.norm.weight": ((32,), torch.bfloat16),
    "action_head.image_encoder.model.log_scale": ((), torch.float32),
    "action_head.image_encoder.model.visual.patch_embedding.weight": ((16, 3, 14, 14), torch.float32),
    "action_head.vae.model.encoder.conv1.weight": ((8, 3, 3, 3, 3), torch.float32),
    "action_head.vae.model.decoder.head.2.bias": ((3,), torch.bfloat16),
}


@dataclass
class Args:
    out: Path
    """Folder to write (replaced if it exists)."""
    preset: Literal["tiny", "libero-5b", "droid-5b", "droid-14b"] = "tiny"
    """DiT preset of train/dit/model.py."""
    shards: Path | None = None
    """Shard directory: the DiT fits it as the trainer's does; conf.yaml's embodiment and metadata.json come from it."""
    embodiment: str = "oxe_droid"
    """Embodiment tag of conf.yaml and of config.json's window fields (num_frames, action_horizon) when no --shards
    are given."""
    also: tuple[str, ...] = ()
    """Further embodiment tags conf.yaml configures (the other sets of a mixture, for an eval-ready export)."""
    num_layers: int = 0
    """Override the preset's block count (0 = the preset's)."""
    max_shard_mb: float = 5000.0
    """Largest weight file in MB (transformers' default 5 GB); a small value cuts the tiny model into several files."""
    seed: int = 0
    """Seed of the random weights."""


def dit_config(args: Args) -> DiTConfig:
    if args.shards is not None:
        return model_config(
            Config(
                data=DataConfig(shards=str(args.shards)),  # the string --data.shards gives
                model=ModelConfig(name=args.preset, num_layers=args.num_layers or "auto"),
            )
        )
    cfg = preset(args.preset)
    return replace(cfg, num_layers=args.num_layers) if args.num_layers else cfg


def official_config(cfg: DiTConfig, tags: list[str]) -> dict:
    """config.json as VLA.save_pretrained writes it, reduced to the fields the loaders read, for the DiT `cfg`
    trained on embodiments `tags` (the DiT and window fields as an export writes them, `eval_config`)."""
    wan = "Wan2.2-TI2V-5B" if cfg.model_type == "ti2v" else "Wan2.1-I2V-14B-480P"
    vae = (
        {
            "_target_": f"{GROOT}.modules.wan_video_vae.WanVideoVAE38",
            "z_dim": 48,
            "dim": 160,
            "vae_pretrained_path": f"{wan}/Wan2.2_VAE.pth",
        }
        if cfg.model_type == "ti2v"
        else {"_target_": f"{GROOT}.modules.wan_video_vae.WanVideoVAE", "vae_pretrained_path": f"{wan}/Wan2.1_VAE.pth"}
    )
    head = {
        "_target_": f"{GROOT}.action_head.wan_flow_matching_action_tf.WANPolicyHeadConfig",
        "_recursive_": False,
        "diffusion_model_cfg": {
            "_target_": f"{GROOT}.modules.wan_video_dit_action_casual_chunk.CausalWanModel",
            "diffusion_model_pretrained_path": wan,
        },
        "text_encoder_cfg": {
            "_target_": f"{GROOT}.modules.wan_video_text_encoder.WanTextEncoder",
            "text_encoder_pretrained_path": f"{wan}/models_t5_umt5-xxl-enc-bf16.pth",
        },
        "image_encoder_cfg": {
            "_target_": f"{GROOT}.modules.wan_video_image_encoder.WanImageEncoder",
            "image_encoder_pretrained_path": f"{wan}/models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth",
        },
        "vae_cfg": vae,
    }
    config = {
        "model_type": "vla",
        "architectures": ["VLA"],
        "model_dtype": "bfloat16",
        "backbone_cfg": {"_target_": f"{GROOT}.backbone.identity.IdentityBackbone"},
        "action_head_cfg": {
            "_target_": f"{GROOT}.action_head.wan_flow_matching_action_tf.WANPolicyHead",
            "_convert_": "object",
            "config": head,
        },
    }
    return eval_config(config, cfg, tags)


def official_conf(tag: str, cfg: DiTConfig) -> dict:
    """experiment_cfg/conf.yaml: the sections the official loader reads for embodiment `tag`."""
    emb = get_embodiment(tag)
    video = [f"video.{c}" for c in emb.cameras]
    state = [f"state.{k}" for k in emb.state_keys]
    action = [f"action.{k}" for k in emb.action_keys]
    transform = "groot.vla.data.transform"
    return {
        "model": {"_target_": f"{GROOT}.base_vla.VLA"},
        "save_lora_only": False,
        "eval_bf16": True,
        "relative_action": bool(emb.relative_action_keys),
        "relative_action_per_horizon": False,
        "relative_action_keys": list(emb.relative_action_keys),
        "modality_configs": {
            tag: {
                "video": {
                    "delta_indices": list(emb.window.video_offsets),
                    "eval_delta_indices": list(emb.window.video_offsets),
                    "modality_keys": video,
                },
                "state": {"delta_indices": [0], "modality_keys": state},
                "action": {"delta_indices": list(range(emb.window.action_horizon)), "modality_keys": action},
            }
        },
        "transforms": {
            tag: {
                "_target_": f"{transform}.ComposedModalityTransform",
                "transforms": [
                    {"_target_": f"{transform}.state_action.StateActionToTensor", "apply_to": state + action},
                    {
                        "_target_": f"{transform}.state_action.StateActionTransform",
                        "apply_to": state + action,
                        "normalization_modes": {k: "q99" for k in state + action},
                    },
                    {
                        "_target_": f"{transform}.concat.ConcatTransform",
                        "video_concat_order": video,
                        "state_concat_order": state,
                        "action_concat_order": action,
                    },
                    {
                        "_target_": f"{GROOT}.transform.dreamzero_cotrain.DreamTransform",
                        "tokenizer_path": "google/umt5-xxl",
                        "max_state_dim": cfg.max_state_dim,
                        "max_action_dim": cfg.action_dim,
                        "embodiment_tag_mapping": {tag: emb.embodiment_id},
                    },
                ],
            }
        },
    }


def dit_tensors(cfg: DiTConfig, seed: int):
    """(shapes, value of key) of the DiT under the official prefix."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalWanModel(cfg).state_dict().items()}
    if sum(torch.Size(s).numel() for s in shapes.values()) * 4 < 2 << 30:
        torch.manual_seed(seed)
        sd = CausalWanModel(cfg).state_dict()
        return shapes, lambda k: sd[k]

    def random(k):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(k.encode()))
        return torch.randn(shapes[k], generator=gen).mul_(0.02)

    return shapes, random


def write_base(args: Args) -> Path:
    cfg = dit_config(args)
    shapes, dit_value = dit_tensors(cfg, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    encoders = {k: torch.randn(shape, generator=gen).to(dtype) for k, (shape, dtype) in ENCODERS.items()}
    layout = {DREAMZERO_PREFIX + k: (torch.Size(s).numel() * 2) for k, s in shapes.items()}  # bf16
    layout.update({k: v.numel() * v.element_size() for k, v in encoders.items()})
    groups = shard_groups(layout, int(args.max_shard_mb * 1e6))
    names = shard_file_names(len(groups))
    shutil.rmtree(args.out, ignore_errors=True)
    (args.out / "experiment_cfg").mkdir(parents=True)
    total = 0
    for name, keys in zip(names, groups):
        sd = {
            k: encoders[k] if k in encoders else dit_value(k[len(DREAMZERO_PREFIX) :]).to(torch.bfloat16) for k in keys
        }
        save_file(sd, str(args.out / name), metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in sd.values())
    if len(groups) > 1:
        write_index(args.out, {k: name for name, keys in zip(names, groups) for k in keys}, total)
    tag = args.embodiment
    if args.shards is not None:
        statistics, tag = shard_statistics(args.shards)
        shutil.copyfile(statistics, args.out / "experiment_cfg" / "metadata.json")
    # the primary embodiment's window: a mixture's differ in action_horizon, and the official head has one
    (args.out / "config.json").write_text(json.dumps(official_config(cfg, [tag]), indent=2) + "\n")
    conf = json.loads(json.dumps(official_conf(tag, cfg)))  # distinct lists: no YAML anchors
    for other in args.also:
        extra = json.loads(json.dumps(official_conf(other, cfg)))
        for section in ("modality_configs", "transforms"):
            conf[section] |= extra[section]
    (args.out / "experiment_cfg" / "conf.yaml").write_text(yaml.safe_dump(conf, sort_keys=False))
    return args.out
