from typing import TYPE_CHECKING, cast

import pytest
import torch

from wampipe.encoders.vae import VARIANTS, load_vae
from wampipe.encoders.weights import WeightsError, read_state_dict

if TYPE_CHECKING:  # annotations only: importing diffusers first would defeat load_vae's hiding of torchao
    from diffusers.models.modeling_outputs import AutoencoderKLOutput

FILES = {"wan2.1": "wan2.1/Wan2.1_VAE.pth", "wan2.2": "wan2.2/Wan2.2_VAE.pth"}


def clip(b=2, t=9, h=16, w=32, seed=0):
    return torch.rand(b, 3, t, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.mark.parametrize("variant,channels,factor", [("wan2.1", 16, 8), ("wan2.2", 48, 16)])
def test_both_formats_same_latents(tiny_checkpoints, variant, channels, factor):
    pth = load_vae(tiny_checkpoints / FILES[variant], variant)
    folder = load_vae(tiny_checkpoints / variant / "vae", variant)
    assert pth.info.variant == folder.info.variant == variant and pth.info.spatial == factor
    x = clip(b=1, t=33)  # DreamZero's clip length: 33 frames -> 9 latent frames
    z = pth.encode(x)
    assert z.shape == (1, channels, 9, 16 // factor, 32 // factor) and z.dtype == torch.bfloat16
    assert torch.equal(z, folder.encode(x))
    assert torch.equal(z, pth.encode(x))  # deterministic
    assert pth.model.decoder is None  # dropped after the strict check


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norms_normalizing_through_the_opaque_op_give_the_librarys_bits(tiny_checkpoints, variant, dtype):
    """The compiled encoder's RMS norms normalize through `rms_normalize` (an op the compiler cannot fuse); run
    eagerly, that encoder must give the bits of diffusers' own norms, in bf16 (GPUs) and fp32 (CPU)."""
    from wampipe.encoders.vae import normalize_eagerly

    vae = load_vae(tiny_checkpoints / FILES[variant], variant)
    x = clip(b=2).to(dtype)
    vae.model.to(dtype)
    own = cast("AutoencoderKLOutput", vae.model.encode(x)).latent_dist.mean  # return_dict=True
    normalize_eagerly(vae.model.encoder)
    norms = [m for m in vae.model.encoder.modules() if type(m).__name__ == "WanRMS_norm"]
    assert norms and all("forward" in m.__dict__ for m in norms)  # every norm of the encoder goes through the op
    assert torch.equal(cast("AutoencoderKLOutput", vae.model.encode(x)).latent_dist.mean, own)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norms_in_eager_order_give_the_contiguous_bits_in_any_layout(dtype):
    """`rms_normalize_in_eager_order` of a channels-last tensor: the bits eager's normalize gives the same values laid
    out channels-first, in the input's own layout (a channels-last reduction sums in another order)."""
    from wampipe.encoders.vae import rms_normalize_in_eager_order

    x = torch.randn(2, 64, 3, 8, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    eager = torch.nn.functional.normalize(x.float(), dim=1).to(dtype)
    cl = x.contiguous(memory_format=torch.channels_last_3d)
    out = rms_normalize_in_eager_order(cl, 1)
    assert out.is_contiguous(memory_format=torch.channels_last_3d) and torch.equal(out, eager)
    assert torch.equal(rms_normalize_in_eager_order(x, 1), eager) and rms_normalize_in_eager_order(x, 1).is_contiguous()


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2"])
def test_channels_last_encoder_stores_the_default_layout_whatever_the_batch_company(tiny_checkpoints, variant):
    """Weights and input channels-last (`set_memory_format`, what `compile(channels_last=True)` sets), every call
    padded to one batch as `compile` pads it: a clip's latents are the same bits alone, among others or at another
    position, stored in the default layout; the conv weights are channels-last, the norms' gains untouched."""
    vae = load_vae(tiny_checkpoints / FILES[variant], variant)
    vae.set_memory_format(torch.channels_last_3d)
    vae.padded_batch = 4
    convs = [p for p in vae.model.parameters() if p.dim() == 5]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last_3d) for p in convs)
    x = clip(b=3)
    together = vae.encode(x)
    assert together.is_contiguous() and together.shape[0] == 3
    assert torch.equal(together, torch.cat([vae.encode(x[i : i + 1]) for i in range(3)]))
    assert torch.equal(together, vae.encode(x.flip(0)).flip(0))
    vae.set_memory_format(torch.contiguous_format)  # back: the default layout's latents, in bf16 tolerance
    assert all(p.is_contiguous() for p in convs)
    torch.testing.assert_close(vae.encode(x).float(), together.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2"])
def test_normalization_and_batch_invariance(tiny_checkpoints, variant):
    vae = load_vae(tiny_checkpoints / FILES[variant], variant)
    x = clip(b=3)
    z = vae.encode(x)
    one = torch.cat([vae.encode(x[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(z.float(), one.float(), atol=0.05, rtol=0.02)  # bf16 tolerance
    assert torch.equal(vae.encode(x, batch_size=1), one)
    mu = cast("AutoencoderKLOutput", vae.model.encode(x.bfloat16())).latent_dist.mean
    mean = torch.tensor(VARIANTS[variant]["latents_mean"]).bfloat16().view(1, -1, 1, 1, 1)
    inv_std = (1.0 / torch.tensor(VARIANTS[variant]["latents_std"])).bfloat16().view(1, -1, 1, 1, 1)
    assert torch.equal(z, (mu - mean) * inv_std)


@pytest.mark.parametrize("variant,channels", [("wan2.1", 16), ("wan2.2", 48)])
def test_first_frame_y(tiny_checkpoints, variant, channels):
    vae = load_vae(tiny_checkpoints / FILES[variant], variant)
    x = clip(b=2)
    y = vae.encode_first_frame(x[:, :, 0], num_frames=9)
    s = vae.info.spatial
    assert y.shape == (2, 4 + channels, 3, 16 // s, 32 // s) and y.dtype == torch.bfloat16
    assert torch.all(y[:, :4, 0] == 1) and torch.all(y[:, :4, 1:] == 0)
    expected = vae.encode(torch.cat([x[:, :, :1], torch.zeros_like(x[:, :, 1:])], dim=2))
    assert torch.equal(y[:, 4:], expected)
    # latent frame 0 depends on pixel frame 0 only (causal VAE): equals the video latents' frame 0
    torch.testing.assert_close(y[:, 4:, 0].float(), vae.encode(x)[:, :, 0].float(), atol=0.05, rtol=0.02)


def test_wrong_variant_is_recognized(tiny_checkpoints):
    with pytest.raises(WeightsError) as err:
        load_vae(tiny_checkpoints / FILES["wan2.1"], "wan2.2")
    assert str(err.value) == (
        f"{tiny_checkpoints / FILES['wan2.1']}: this is a Wan2.1 VAE (16 latent channels, 8x), "
        "but a Wan2.2 VAE38 (48 latent channels, 16x) was asked for"
    )
    with pytest.raises(WeightsError, match="this is a Wan2.2 VAE38 .* but a Wan2.1 VAE"):
        load_vae(tiny_checkpoints / "wan2.2" / "vae", "wan2.1")
    with pytest.raises(WeightsError, match="this file is a umT5 encoder, Wan layout .* but the VAE needs"):
        load_vae(tiny_checkpoints / "umt5" / "models_t5_umt5-xxl-enc-bf16.pth")


def test_missing_unexpected_and_misshaped_keys(tiny_checkpoints, tmp_path):
    state = read_state_dict(tiny_checkpoints / FILES["wan2.1"])
    bad = dict(state)
    del bad["encoder.middle.1.proj.bias"]
    bad["encoder.extra.weight"] = torch.zeros(1)
    bad["conv1.bias"] = torch.zeros(5)
    torch.save(bad, tmp_path / "Wan2.1_VAE.pth")
    with pytest.raises(WeightsError) as err:
        load_vae(tmp_path / "Wan2.1_VAE.pth")
    assert str(err.value) == (
        f"{tmp_path / 'Wan2.1_VAE.pth'}: missing keys: encoder.middle.1.proj.bias; "
        "unexpected keys: encoder.extra.weight; wrong shapes: conv1.bias (5,) != (32,)"
    )


def eager_encoders(tiny_checkpoints, model: str, dtype: str):
    """The farm's `Encoders` (eager, on the CPU) of the tiny checkpoints for `model`."""
    from types import SimpleNamespace

    from wampipe.preprocess.pipeline import Encoders

    spec = SimpleNamespace(
        vae=str(tiny_checkpoints / FILES["wan2.1" if model == "14b" else "wan2.2"]),
        model=model,
        device="cpu",
        dtype=dtype,
        image_features="encoded",
        vae_compile=False,
        batch_size=2,
        compile_cache="",
        image_encoder=str(tiny_checkpoints / "clip" / "image_encoder"),
    )
    return Encoders(spec)  # pyright: ignore[reportArgumentType]  # a stand-in: the fields Encoders reads


def test_a_batch_cast_by_the_worker_encodes_as_one_cast_by_the_encoder(tiny_checkpoints):
    """The stream's workers send their clips already in the encoders' compute dtype (half the bytes in bf16) and
    frame 0 unrounded for CLIP: the encoders' outputs must be those of the uncast clips, cast where they run."""
    from wampipe.preprocess.pipeline import stack_clips

    clips = list(clip(b=2, t=33, h=32, w=64))
    encoders = eager_encoders(tiny_checkpoints, "5b", "bfloat16")
    batch = stack_clips(clips, torch.bfloat16)
    assert batch["videos"].dtype == torch.bfloat16 and batch["frame0"].dtype == torch.float32
    assert torch.equal(batch["videos"], torch.stack(clips).to(torch.bfloat16))
    assert torch.equal(batch["frame0"], torch.stack(clips)[:, :, 0])
    uncast = {"videos": torch.stack(clips), "frame0": torch.stack(clips)[:, :, 0]}
    with torch.inference_mode():
        sent, here = encoders(batch), encoders(uncast)
    assert sent.keys() == here.keys() and all(torch.equal(sent[k], here[k]) for k in sent)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's import
@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2"])
def test_compile_runs_each_variants_measured_kernels_unless_told(tiny_checkpoints, variant):
    """`compile` with no layout given takes the variant's COMPILED_LAYOUT: Wan2.2 fuses its norms in channels-last
    (its error against a float32 encoder inside eager's own range), Wan2.1 keeps the norms on eager's kernels in the
    default layout (eager's bits); a build records the kernels by `compiled_kernels`' name. Given flags win."""
    from wampipe.encoders.vae import COMPILED_LAYOUT, compiled_kernels, rms_norms

    def compiled(**flags):
        vae = load_vae(tiny_checkpoints / FILES[variant], variant)
        vae.compile(4, **flags)
        eager_norms = all("forward" in m.__dict__ for m in rms_norms(vae.model))
        return not eager_norms, vae.memory_format == torch.channels_last_3d

    assert compiled() == COMPILED_LAYOUT[variant] == {"wan2.1": (False, False), "wan2.2": (True, True)}[variant]
    assert compiled(fuse_norms=False, channels_last=False) == (False, False)
    assert compiled(fuse_norms=True, channels_last=True) == (True, True)
    assert compiled_kernels(variant) == {"wan2.1": None, "wan2.2": "fused-norms-channels-last"}[variant]


def test_batches_launched_ahead_finish_with_the_codes_one_at_a_time_gives(tiny_checkpoints):
    """The streaming encoder launches a batch before it finishes the previous one: each batch's codes (latents,
    CLIP features, the 14B's y) are those the batch gets alone, and a non-finite output is still refused."""
    from wampipe.preprocess.errors import EncoderOutputError
    from wampipe.preprocess.pipeline import stack_clips

    encoders = eager_encoders(tiny_checkpoints, "14b", "float32")
    first, second = (encoders.prepare(stack_clips(list(clip(b=2, seed=s)), torch.float32)) for s in (1, 2))
    with torch.inference_mode():
        alone = [encoders.run(first), encoders.run(second)]
        launched = [encoders.launch(first), encoders.launch(second)]
        ahead = [encoders.finish(x) for x in launched]
        for one, other in zip(alone, ahead):
            assert one.keys() == other.keys() == {"latents", "clip", "y"}
            assert all(torch.equal(one[k], other[k]) and one[k].dtype == torch.bfloat16 for k in one)
        broken = {**first, "videos": first["videos"].clone().fill_(float("nan"))}
        with pytest.raises(EncoderOutputError, match="latents of a batch of 2 clips hold NaN"):
            encoders.finish(encoders.launch(broken))
