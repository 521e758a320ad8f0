"""The Wan VAE decoder against the official decoder, and `python -m preprocess preview` on a real build.

tests/assets/wan_vae_decode.safetensors holds, per variant, bf16 latents [1, C, 3, 2, 3] (seeded normal) and what the
official Wan code decodes from them on the tiny VAE weights this project writes (devtools.tiny_checkpoints, seed 0),
in float32 on CPU: Wan2.1 `wan/modules/vae.py` and Wan2.2 `wan/modules/vae2_2.py`, `_video_vae(pth).decode(z, [mean,
1 / std])` then `.float().clamp_(-1, 1)` as their `WanVAE.decode` / `Wan2_2_VAE.decode` do, loading the original-layout
`.pth` strictly.
"""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from wampipe.encoders.vae import load_vae
from wampipe.preprocess.preview import clip_input_image
from tests.helpers import ASSETS

REFERENCE = ASSETS / "wan_vae_decode.safetensors"
VAE_FILES = {"wan2.1": "wan2.1/Wan2.1_VAE.pth", "wan2.2": "wan2.2/Wan2.2_VAE.pth"}


@pytest.mark.parametrize(
    "variant,where", [("wan2.1", "pth"), ("wan2.1", "folder"), ("wan2.2", "pth"), ("wan2.2", "folder")]
)
def test_decoder_equals_the_official_decoder(tiny_checkpoints, variant, where):
    path = tiny_checkpoints / (VAE_FILES[variant] if where == "pth" else f"{variant}/vae")
    reference = load_file(REFERENCE)
    vae = load_vae(path, variant, dtype=torch.float32, keep_decoder=True)
    video = vae.decode(reference[f"{variant}.latents"])
    torch.testing.assert_close(video, reference[f"{variant}.video"], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="loaded without its decoder"):
        load_vae(path, variant).decode(reference[f"{variant}.latents"])


def test_clip_pixels_are_shown_as_the_frame_clip_consumes(tiny_checkpoints):
    from wampipe.encoders.image_encoder import load_image_encoder

    clip = load_image_encoder(tiny_checkpoints / "clip" / "image_encoder", dtype=torch.float32)
    size = clip.image_size  # the stored pixels' size: bicubic to it is the identity here
    ramp = np.linspace(0, 255, size).round().astype(np.uint8)
    image = np.stack(
        [np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size)), np.full((size, size), 40, np.uint8)], axis=-1
    )  # red: left to right, green: top to bottom, blue: flat
    frame = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 127.5 - 1
    stored = clip.preprocess(frame)[0].bfloat16()  # as a bf16 GPU build stores clip_pixels
    shown = clip_input_image(stored)
    assert shown is not None
    assert shown.shape == image.shape and shown.dtype == np.uint8
    assert np.abs(shown.astype(int) - image).max() <= 1  # bf16 rounding


def test_the_sheet_pads_as_the_model_does():
    from wampipe.preprocess.preview import PADDED_WIDTH
    from wampipe.train.dit.model import DiTConfig

    assert PADDED_WIDTH == {"state": DiTConfig().max_state_dim, "action": DiTConfig().action_dim}
