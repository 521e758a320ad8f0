import pytest
import torch
import torch.nn.functional as F

from wampipe.encoders.image_encoder import CLIP_MEAN, CLIP_STD, load_image_encoder
from wampipe.encoders.weights import WeightsError, read_state_dict

WAN_FILE = "clip/models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"


def frames(b=3, seed=0):
    return torch.rand(b, 3, 160, 320, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_formats_shapes_batch_invariance(tiny_checkpoints):
    wan = load_image_encoder(tiny_checkpoints / WAN_FILE)
    folder = load_image_encoder(tiny_checkpoints / "clip" / "image_encoder")
    assert len(wan.model.encoder.layers) == 1  # 2 blocks in the file, the last one dropped (penultimate output)
    x = frames()
    out = wan.encode(x)
    assert out.shape == (3, 257, 1280) and out.dtype == torch.bfloat16  # the real model's, which the official DiT takes
    assert torch.equal(out, folder.encode(x))
    torch.testing.assert_close(out.float(), wan.encode(x, batch_size=1).float(), atol=0.05, rtol=0.02)
    assert torch.equal(out, wan.encode(x))


def test_preprocessing_and_penultimate_block(tiny_checkpoints):
    from transformers import CLIPVisionModelWithProjection

    enc = load_image_encoder(tiny_checkpoints / "clip" / "image_encoder", dtype=torch.float32)
    x = frames(b=1)
    pixels = F.interpolate(x, size=(224, 224), mode="bicubic", align_corners=False) * 0.5 + 0.5
    pixels = (pixels - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(enc.preprocess(x), pixels)
    full = CLIPVisionModelWithProjection.from_pretrained(str(tiny_checkpoints / "clip" / "image_encoder")).eval()
    with torch.no_grad():
        hidden = full(pixel_values=pixels, output_hidden_states=True).hidden_states
    torch.testing.assert_close(enc.encode(x), hidden[-2], atol=1e-5, rtol=1e-5)  # after block 1 of 2, no final LN


def test_strict_errors(tiny_checkpoints, tmp_path):
    state = read_state_dict(tiny_checkpoints / WAN_FILE)
    state["visual.transformer.0.attn.to_qkv.bias"] = torch.zeros(7)
    del state["visual.post_norm.bias"]
    state["visual.extra"] = torch.zeros(1)
    torch.save(state, tmp_path / "clip.pth")
    with pytest.raises(WeightsError) as err:
        load_image_encoder(tmp_path / "clip.pth")
    assert str(err.value) == (
        f"{tmp_path / 'clip.pth'}: missing keys: visual.post_norm.bias; unexpected keys: "
        "visual.extra; wrong shapes: visual.transformer.0.attn.to_qkv.bias (7,) != (3840,)"
    )
    with pytest.raises(WeightsError, match="this file is a Wan2.2 VAE38 .* but the image encoder needs"):
        load_image_encoder(tiny_checkpoints / "wan2.2" / "Wan2.2_VAE.pth")
