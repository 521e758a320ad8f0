"""Tiny random-init frozen-encoder checkpoints in every on-disk format the loaders accept.

Layout written under OUT (CLI: scripts/make_tiny_checkpoints.py):

OUT/
  wan2.1/Wan2.1_VAE.pth  wan2.1/vae/            Wan2.1 VAE: original key layout and Diffusers folder (same weights)
  wan2.2/Wan2.2_VAE.pth  wan2.2/vae/            Wan2.2 VAE38, likewise
  umt5/models_t5_umt5-xxl-enc-bf16.pth          umT5 encoder, Wan layout (bf16)
  umt5/text_encoder/                            same weights, transformers layout, sharded with an index
  umt5/tokenizer/                               a small SentencePiece unigram tokenizer trained on the sample prompts
  clip/models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth   CLIP, Wan open-clip layout (+ a dummy text tower)
  clip/image_encoder/                           same vision weights, transformers CLIPVisionModelWithProjection

Same architectures and key names as the released weights, small widths (latent channels, patch 14 and image 224
stay real so normalization constants and preprocessing paths are the real ones). The CLIP keeps ViT-H/14's width,
1280 x 257 features, so a DiT trained on its shards loads in the official code. Deterministic.

size="full" writes the VAEs and CLIP at their released widths instead (random weights, for throughput
benchmarks of the real loading and encoding code; ~3 GB); the umT5 encoder stays small, since the unit stage
never runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from devtools.sample_data import DROID_TASKS, LIBERO_TASKS
from wampipe.encoders.image_encoder import VIT_H_14, hf_clip_to_wan
from wampipe.encoders.text_encoder import TIED, UMT5_XXL, wan_umt5_key
from wampipe.encoders.vae import VARIANTS, diffusers_vae_class, wan_vae_key

DROID_TEMPLATE = (
    "A multi-view video shows that a robot {i} The video is split into three views: The top view shows "
    "the camera view from the robot's wrist, the bottom-left view shows the camera view from the left "
    "exterior camera, and the bottom-right view shows the camera view from the right exterior camera. "
    "During training, one of the two bottom exterior views may be a black screen (dropped view). "
    "The robot {i}"
)
LIBERO_TEMPLATE = (
    "A multi-view video shows that a robot {i} The video is split into two horizontal views: the left "
    "view shows the exterior camera and the right view shows the wrist camera. The robot {i}"
)


def sample_prompts() -> list[str]:
    tasks = [t.lower() for t in DROID_TASKS + LIBERO_TASKS + ["not provided"]]
    return [DROID_TEMPLATE.format(i=t) for t in tasks] + [LIBERO_TEMPLATE.format(i=t) for t in tasks] + tasks


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm gains around 1) so a wrong key mapping changes the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_gain = name.endswith(
                (
                    "gamma",
                    "norm.weight",
                    "layer_norm.weight",
                    "norm1.weight",
                    "norm2.weight",
                    "layrnorm.weight",
                    "layernorm.weight",
                    "layer_norm1.weight",
                    "layer_norm2.weight",
                )
            )
            p.copy_(1 + 0.1 * noise if is_gain else noise * min(0.2, p[0].numel() ** -0.5 if p.ndim > 1 else 0.1))


def write_vae(out: Path, variant: str, seed: int, full: bool = False) -> None:
    AutoencoderKLWan = diffusers_vae_class()  # noqa: N806
    dims = {} if full else dict(base_dim=8) if variant == "wan2.1" else dict(base_dim=8, decoder_base_dim=12)
    model = AutoencoderKLWan(**{**VARIANTS[variant], **dims})
    randomize(model, seed)
    folder = out / variant
    model.save_pretrained(folder / "vae", safe_serialization=True)
    state = {wan_vae_key(k, variant): v.contiguous() for k, v in model.state_dict().items()}
    torch.save(state, folder / ("Wan2.1_VAE.pth" if variant == "wan2.1" else "Wan2.2_VAE.pth"))


def write_tokenizer(folder: Path) -> int:
    import sentencepiece as spm
    from transformers import T5Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(sample_prompts()) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "spiece"),
        vocab_size=160,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        character_coverage=1.0,
        hard_vocab_limit=False,
        num_threads=1,
        seed_sentencepiece_size=10000,
        minloglevel=2,
    )
    corpus.unlink()
    (folder / "spiece.vocab").unlink()
    tok = T5Tokenizer.from_pretrained(str(folder), extra_ids=0, legacy=False)
    tok.model_max_length = 512
    tok.save_pretrained(str(folder))
    return len(tok)


def write_umt5(out: Path, seed: int) -> None:
    from transformers import UMT5Config, UMT5EncoderModel

    folder = out / "umt5"
    vocab = write_tokenizer(folder / "tokenizer")
    config = UMT5Config(
        **{
            **UMT5_XXL,
            "vocab_size": max(256, vocab),
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 48,
            "num_layers": 2,
            "num_heads": 4,
        }
    )
    model = UMT5EncoderModel(config)
    randomize(model, seed)
    # Wan ships the encoder in bf16; functools.wraps on transformers' .to hides from pyright that it is a method
    model = model.to(torch.bfloat16)  # pyright: ignore[reportArgumentType]
    model.save_pretrained(folder / "text_encoder", safe_serialization=True, max_shard_size="20KB")
    state = {wan_umt5_key(k): v.contiguous() for k, v in model.state_dict().items() if k not in TIED}
    torch.save(state, folder / "models_t5_umt5-xxl-enc-bf16.pth")


def write_clip(out: Path, seed: int, full: bool = False) -> None:
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    folder = out / "clip"
    # ViT-H/14's width, patch, image and head count (the official DiT projects 257 x 1280 features; Wan's file
    # implies 16 heads), two blocks so the kept one runs, a narrow MLP and projection: ~16 M parameters
    small = {"intermediate_size": 320, "num_hidden_layers": 2, "projection_dim": 24}
    config = CLIPVisionConfig(**{**VIT_H_14, **({} if full else small)})
    model = CLIPVisionModelWithProjection(config)
    randomize(model, seed)
    model.save_pretrained(folder / "image_encoder", safe_serialization=True)
    state = hf_clip_to_wan({k: v for k, v in model.state_dict().items() if not k.endswith("position_ids")})
    gen = torch.Generator().manual_seed(seed + 1)  # the xlm-roberta text tower: present in the file, unused
    state.update(
        {
            "textual.token_embedding.weight": torch.randn(16, 8, generator=gen),
            "textual.head.0.weight": torch.randn(8, 8, generator=gen),
            "log_scale": torch.tensor(2.6592),
        }
    )
    torch.save(
        {k: v.contiguous() for k, v in state.items()},
        folder / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth",
    )


def write_tiny_checkpoints(out: Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write every encoder under `out` (created); returns `out`."""
    full = size == "full"
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    write_vae(out, "wan2.1", seed + 1, full)
    write_vae(out, "wan2.2", seed + 2, full)
    write_umt5(out, seed + 3)
    write_clip(out, seed + 4, full)
    (out / "README.json").write_text(json.dumps({"tiny": not full, "size": size, "seed": seed}) + "\n")
    return out


def tiny_checkpoint_paths(tiny: Path, vae_variant: str) -> dict[str, Path]:
    """Where `write_tiny_checkpoints` puts each encoder (original-format files), by preprocess shards flag."""
    return {
        "vae": tiny / vae_variant / ("Wan2.2_VAE.pth" if vae_variant == "wan2.2" else "Wan2.1_VAE.pth"),
        "text_encoder": tiny / "umt5" / "models_t5_umt5-xxl-enc-bf16.pth",
        "tokenizer": tiny / "umt5" / "tokenizer",
        "image_encoder": tiny / "clip" / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth",
    }
