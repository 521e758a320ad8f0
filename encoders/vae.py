"""Wan VAE encoder (Wan2.1: 16 channels, 8x; Wan2.2 "VAE38": 48 channels, 16x) through diffusers' AutoencoderKLWan.

Output = what DreamZero's head feeds its DiT (docs/REFERENCE.md#6-frozen-encoder-outputs): the posterior
mean of an untiled encode in bf16, normalized per channel as `(mu - mean_c) * (1 / std_c)` with both constants cast to
bf16 first, exactly like the reference's `VideoVAE_.encode(x, scale)` with `scale = [mean, 1.0 / std]`. The 14B
first-frame input `y` = [4-channel mask ; VAE([frame 0, zeros])].

Loads the original Wan `.pth` files (keys renamed here) and Diffusers `vae/` folders; both are checked key by key.
With `keep_decoder`, `decode` turns stored latents back into video as the reference decoder does (`preprocess preview`).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from wampipe.encoders.weights import (
    WeightsError,
    assign_loaded,
    check_keys,
    expect_kind,
    folder_config,
    load_strict,
    on_meta,
    read_state_dict,
)

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    from diffusers.models.autoencoders.vae import DecoderOutput
    from diffusers.models.modeling_outputs import AutoencoderKLOutput

# Per-channel latent statistics of the released VAEs (the reference's WanVideoVAE / WanVideoVAE38 constants).
WAN21_MEAN = [
    -0.7571,
    -0.7089,
    -0.9113,
    0.1075,
    -0.1745,
    0.9653,
    -0.1517,
    1.5508,
    0.4134,
    -0.0715,
    0.5517,
    -0.3632,
    -0.1922,
    -0.9497,
    0.2503,
    -0.2921,
]
WAN21_STD = [
    2.8184,
    1.4541,
    2.3275,
    2.6558,
    1.2196,
    1.7708,
    2.6052,
    2.0743,
    3.2687,
    2.1526,
    2.8652,
    1.5579,
    1.6382,
    1.1253,
    2.8251,
    1.9160,
]
WAN22_MEAN = [
    -0.2289,
    -0.0052,
    -0.1323,
    -0.2339,
    -0.2799,
    0.0174,
    0.1838,
    0.1557,
    -0.1382,
    0.0542,
    0.2813,
    0.0891,
    0.1570,
    -0.0098,
    0.0375,
    -0.1825,
    -0.2246,
    -0.1207,
    -0.0698,
    0.5109,
    0.2665,
    -0.2108,
    -0.2158,
    0.2502,
    -0.2055,
    -0.0322,
    0.1109,
    0.1567,
    -0.0729,
    0.0899,
    -0.2799,
    -0.1230,
    -0.0313,
    -0.1649,
    0.0117,
    0.0723,
    -0.2839,
    -0.2083,
    -0.0520,
    0.3748,
    0.0152,
    0.1957,
    0.1433,
    -0.2944,
    0.3573,
    -0.0548,
    -0.1681,
    -0.0667,
]
WAN22_STD = [
    0.4765,
    1.0364,
    0.4514,
    1.1677,
    0.5313,
    0.4990,
    0.4818,
    0.5013,
    0.8158,
    1.0344,
    0.5894,
    1.0901,
    0.6885,
    0.6165,
    0.8454,
    0.4978,
    0.5759,
    0.3523,
    0.7135,
    0.6804,
    0.5833,
    1.4146,
    0.8986,
    0.5659,
    0.7069,
    0.5338,
    0.4889,
    0.4917,
    0.4069,
    0.4999,
    0.6866,
    0.4093,
    0.5709,
    0.6065,
    0.6415,
    0.4944,
    0.5726,
    1.2042,
    0.5458,
    1.6887,
    0.3971,
    1.0600,
    0.3943,
    0.5537,
    0.5444,
    0.4089,
    0.7468,
    0.7744,
]

# diffusers configs of the released VAEs; `base_dim`/`decoder_base_dim` are read from the file (tiny checkpoints).
VARIANTS = {
    "wan2.1": dict(
        base_dim=96,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=WAN21_MEAN,
        latents_std=WAN21_STD,
    ),
    "wan2.2": dict(
        base_dim=160,
        decoder_base_dim=256,
        z_dim=48,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=WAN22_MEAN,
        latents_std=WAN22_STD,
        in_channels=12,
        out_channels=12,
        is_residual=True,
        patch_size=2,
        scale_factor_spatial=16,
    ),
}
KIND_OF_VARIANT = {"wan2.1": "wan2.1-vae", "wan2.2": "wan2.2-vae"}

# inductor settings of the compiled encoder: keep eager's bf16 rounding between the ops it fuses. Measured with
# scripts/check_vae_variation.py: the compiled latents' distance from eager's fell from 1.2-1.7x the eager encoder's
# own spread over batch sizes to 1.03x (Wan2.2) and 1.4x (Wan2.1) of it; with the RMS norms' normalize left to eager's
# kernels too (`rms_normalize`), Wan2.1's encoder gives eager's own bits (docs/PERFORMANCE.md)
COMPILE_OPTIONS: dict = {"emulate_precision_casts": True}

# How each VAE's compiled encoder runs: variant -> (RMS norms fused, channels-last). Chosen with
# scripts/check_vae_variation.py (docs/PERFORMANCE.md). Wan2.2's fuses its norms in channels-last: 1.45x the clips/s
# of eager norms in the default layout, and its latents' error against a float32 copy of the encoder lies inside the
# range the eager encoder's own batch sizes give. Wan2.1's keeps the norms on eager's kernels in the default layout,
# which gives eager's own bits; its faster layouts land up to 1.39x eager's batch-size spread away from them.
COMPILED_LAYOUT = {"wan2.1": (False, False), "wan2.2": (True, True)}


def compiled_kernels(variant: str) -> str | None:
    """The name of the compiled encoder's kernels for `variant` where they are not the first compiled encoder's (the
    norms on eager's kernels, the default layout), else None: what a build records beside --vae-compile, so units
    encoded by other kernels never resume into one build."""
    fuse_norms, channels_last = COMPILED_LAYOUT[variant]
    name = "-".join(["fused-norms"] * fuse_norms + ["channels-last"] * channels_last)
    return name or None


@torch.library.custom_op("wampipe::rms_normalize", mutates_args=())
def rms_normalize(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The normalize step of the VAE's RMS norms as diffusers' WanRMS_norm runs it (in fp32, rounded back once), as
    an op the compiler calls but cannot fuse: its fused reduction sums in another order, and that alone moved the
    compiled encoder's latents as far from eager's as another batch size moves eager's."""
    return torch.nn.functional.normalize(x.float(), dim=dim).to(x.dtype)


@rms_normalize.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("wampipe::rms_normalize_in_eager_order", mutates_args=())
def rms_normalize_in_eager_order(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`rms_normalize` of a tensor in any memory layout, summed in the order eager's kernel sums a contiguous one:
    the input goes to fp32 in the default (channels-first) layout, is normalized there, and comes back in its own
    layout. For a channels-last encoder, whose norms would otherwise reduce over contiguous channels."""
    out = torch.empty_like(x)
    out.copy_(torch.nn.functional.normalize(x.to(torch.float32, memory_format=torch.contiguous_format), dim=dim))
    return out


@rms_normalize_in_eager_order.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.empty_like(x)


def _eager_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return rms_normalize(x, 1 if self.channel_first else -1) * self.scale * self.gamma + self.bias


def _eager_order_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return rms_normalize_in_eager_order(x, 1 if self.channel_first else -1) * self.scale * self.gamma + self.bias


def rms_norms(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The WanRMS_norm modules of `module`, in module order (22 in either released encoder; the first 4 at the
    input's full resolution)."""
    return [m for m in module.modules() if type(m).__name__ == "WanRMS_norm"]


def normalize_eagerly(module: torch.nn.Module, in_eager_order: bool = False, norms: slice = slice(None)) -> None:
    """Have the WanRMS_norms of `module` (those `norms` selects, in module order) normalize through `rms_normalize`
    (the rest of the norm stays fusable); `in_eager_order`: through `rms_normalize_in_eager_order`."""
    forward = _eager_order_rms_norm_forward if in_eager_order else _eager_rms_norm_forward
    for m in rms_norms(module)[norms]:
        m.forward = forward.__get__(m)


def compile_options() -> dict:
    """COMPILE_OPTIONS, plus inductor's deterministic mode where the installed torch has it: kernels are picked by
    heuristics, not by timing them on the device, so each encoder process of a build (one per GPU) runs the same
    reduction kernels, and a clip's bits do not depend on which GPU encoded it."""
    import torch._inductor.config as inductor

    return {**COMPILE_OPTIONS, **({"deterministic": True} if hasattr(inductor, "deterministic") else {})}


def use_compile_cache(path: str | Path) -> None:
    """Keep the compiler's cache (inductor's graphs and Triton's kernels) in `path` (made private to the user: the
    cache holds code this process loads). A warm cache turns ~1 min of compiling at an encoder's start into seconds;
    on a cluster, a folder in the shared home serves every node."""
    import os

    Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(path).resolve())


def variant_of_config(config: dict) -> str:
    return "wan2.2" if config.get("patch_size") == 2 or config.get("z_dim") == 48 else "wan2.1"


def wan_vae_key(key: str, variant: str, num_res_blocks: int = 2) -> str:
    """The original Wan checkpoint name of a diffusers AutoencoderKLWan key."""
    nrb = num_res_blocks
    k = re.sub(r"^quant_conv\.", "conv1.", key)
    k = re.sub(r"^post_quant_conv\.", "conv2.", k)
    k = re.sub(r"^(encoder|decoder)\.conv_in\.", r"\1.conv1.", k)
    k = re.sub(r"^(encoder|decoder)\.norm_out\.", r"\1.head.0.", k)
    k = re.sub(r"^(encoder|decoder)\.conv_out\.", r"\1.head.2.", k)
    k = re.sub(r"\.mid_block\.resnets\.0\.", ".middle.0.", k)
    k = re.sub(r"\.mid_block\.attentions\.0\.", ".middle.1.", k)
    k = re.sub(r"\.mid_block\.resnets\.1\.", ".middle.2.", k)
    if variant == "wan2.1":
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.", r"encoder.downsamples.\1.", k)
        k = re.sub(
            r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.",
            lambda m: f"decoder.upsamples.{int(m[1]) * (nrb + 2) + int(m[2])}.",
            k,
        )
        k = re.sub(
            r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
            lambda m: f"decoder.upsamples.{int(m[1]) * (nrb + 2) + nrb + 1}.",
            k,
        )
    else:
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.downsamples.\1.downsamples.\2.", k)
        k = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsampler\.", rf"encoder.downsamples.\1.downsamples.{nrb}.", k)
        k = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.", r"decoder.upsamples.\1.upsamples.\2.", k)
        k = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsampler\.", rf"decoder.upsamples.\1.upsamples.{nrb + 1}.", k)
    # inside residual blocks (never matches the renamed top-level/head names above)
    if re.search(r"\.(middle\.[02]|(down|up)samples\.\d+(\.(down|up)samples\.\d+)?)\.", k):
        k = re.sub(r"\.norm1\.gamma$", ".residual.0.gamma", k)
        k = re.sub(r"\.conv1\.(weight|bias)$", r".residual.2.\1", k)
        k = re.sub(r"\.norm2\.gamma$", ".residual.3.gamma", k)
        k = re.sub(r"\.conv2\.(weight|bias)$", r".residual.6.\1", k)
        k = re.sub(r"\.conv_shortcut\.", ".shortcut.", k)
    return k


def _config_from_wan_state(state: dict[str, torch.Tensor], variant: str) -> dict:
    """The diffusers config of an original-layout state dict: released dims, widths read from the tensors."""
    config = dict(VARIANTS[variant])
    config["base_dim"] = int(state["encoder.conv1.weight"].shape[0])
    if variant == "wan2.2":
        config["decoder_base_dim"] = int(state["decoder.head.2.weight"].shape[1])
    return config


@dataclass
class VaeInfo:
    """What a loaded VAE is, for shard metadata."""

    variant: str  # "wan2.1" | "wan2.2"
    z_dim: int
    spatial: int  # pixels per latent cell
    temporal: int  # frames per latent frame after the first
    path: str


class WanVAE:
    """Frozen Wan VAE encoder. `encode(videos_bcthw)` -> normalized posterior mean, bf16 [B, C, 1+(T-1)/4, H/s, W/s]."""

    def __init__(
        self,
        model: AutoencoderKLWan,
        info: VaeInfo,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ):
        # plain Module.to: diffusers' own .to() warns about fp32-pinned modules, which AutoencoderKLWan has none of.
        # It works in place and returns the module it was given, so `model` itself is kept, with its own type.
        torch.nn.Module.to(model, device=device, dtype=dtype)
        self.model = model.eval().requires_grad_(False)
        self.model.disable_tiling()  # reference: tiled=False
        self.info = info
        self.device = torch.device(device)
        self.dtype = dtype
        mean = torch.tensor(model.config["latents_mean"], dtype=torch.float32)
        inv_std = 1.0 / torch.tensor(model.config["latents_std"], dtype=torch.float32)
        # the reference casts mean and 1/std (computed in fp32) to the latent dtype before normalizing
        self.mean = mean.to(device=self.device, dtype=dtype).view(1, -1, 1, 1, 1)
        self.inv_std = inv_std.to(device=self.device, dtype=dtype).view(1, -1, 1, 1, 1)
        self.padded_batch = 0  # set by compile()
        self.memory_format = torch.contiguous_format  # of the weights and inputs of the convolutions (compile())
        self.graphs: dict[tuple[int, ...], tuple] = {}  # padded shape -> (CUDA graph, its input, its output)

    @torch.no_grad()
    def encode(self, videos_bcthw: torch.Tensor, batch_size: int = 0) -> torch.Tensor:
        """Videos in [-1, 1], T = 1 + 4k, H and W multiples of the spatial factor. `batch_size` 0 = all at once."""
        b, c, t, h, w = videos_bcthw.shape
        s = self.info.spatial
        if c != 3 or (t - 1) % 4 or h % s or w % s:
            raise ValueError(
                f"VAE input must be [B, 3, 1+4k, H, W] with H, W multiples of {s}; got {list(videos_bcthw.shape)}"
            )
        step = self.padded_batch or batch_size or b
        out = []
        for i in range(0, b, step):
            x = videos_bcthw[i : i + step].to(device=self.device, dtype=self.dtype)
            n = x.shape[0]
            if n < self.padded_batch:  # the compiled shape; the padding clips' latents are dropped
                x = torch.cat([x, x.new_zeros(self.padded_batch - n, *x.shape[1:])])
            mu = self._posterior_mean(x.contiguous(memory_format=self.memory_format))[:n]
            out.append(((mu - self.mean) * self.inv_std).contiguous())  # stored in the default layout either way
        return torch.cat(out)

    @torch.no_grad()
    def decode(self, latents_bcthw: torch.Tensor) -> torch.Tensor:
        """Stored (normalized) latents -> video in [-1, 1], float32 [B, 3, 1+4(T'-1), h*s, w*s]. The reference
        decoder's numerics: `z / (1 / std_c) + mean_c` with both constants computed in fp32 and cast to the decode
        dtype, the causal decoder chunk by chunk, then its clamp."""
        if self.model.decoder is None:
            raise ValueError("this VAE was loaded without its decoder: load_vae(..., keep_decoder=True)")
        z = latents_bcthw.to(device=self.device, dtype=self.dtype)
        mean = torch.tensor(self.model.config["latents_mean"], dtype=torch.float32)
        inv_std = 1.0 / torch.tensor(self.model.config["latents_std"], dtype=torch.float32)
        shape = (1, -1, 1, 1, 1)
        z = z / inv_std.to(z).view(shape) + mean.to(z).view(shape)
        # decode gives its output object: diffusers' type also allows return_dict=False's tuple
        return cast("DecoderOutput", self.model.decode(z)).sample.float().clamp_(-1, 1)

    def _posterior_mean(self, x: torch.Tensor) -> torch.Tensor:
        graph = self.graphs.get(tuple(x.shape))
        if graph is None:  # encode gives its output object: diffusers' type also allows return_dict=False's tuple
            return cast("AutoencoderKLOutput", self.model.encode(x)).latent_dist.mean
        replay, static_in, static_out = graph
        static_in.copy_(x)
        replay.replay()
        return static_out  # overwritten by the next replay: the caller derives a new tensor from it first

    def set_memory_format(self, memory_format: torch.memory_format) -> None:
        """Lay out the convolutions' weights (and, in `encode`, the input) in `memory_format`: channels_last_3d has
        cuDNN run its channels-last kernels without the transposes around each convolution, and the compiler fuse
        the ops between them in that layout. The latents come back in the default layout."""
        for param in self.model.parameters():
            if param.dim() == 5:  # the 3-D convolutions' weights (the norms' gains broadcast in any layout)
                param.data = param.data.contiguous(memory_format=memory_format)
        self.memory_format = memory_format

    def compile(
        self,
        batch_size: int,
        options: dict | None = None,
        fuse_norms: bool | None = None,
        channels_last: bool | None = None,
    ) -> None:
        """torch.compile the encoder (fuses the activations, the norms and the cache copies between its
        convolutions: on an H200 as a CUDA graph 1.9x eager's clips/s for Wan2.2, 1.34x for Wan2.1,
        docs/PERFORMANCE.md). Every call is padded to `batch_size` clips and compiled for that one static shape
        (`dynamic=False`): three graphs in all (first chunk, second chunk, the rest), and the bits of a clip never
        depend on how many others share its batch or which shapes came first, so reruns and executors stay
        byte-identical. `options`: inductor settings
        (default `compile_options()`: eager's bf16 roundings kept). The RMS norms normalize through eager's kernels
        (`rms_normalize`) unless `fuse_norms`. `channels_last`: weights and inputs in channels_last_3d
        (`set_memory_format`). Either left None: the variant's COMPILED_LAYOUT (Wan2.2 both on, Wan2.1 both off,
        which gives eager's bits)."""
        import torch._dynamo.config

        default_fuse, default_channels_last = COMPILED_LAYOUT[self.info.variant]
        fuse_norms = default_fuse if fuse_norms is None else fuse_norms
        channels_last = default_channels_last if channels_last is None else channels_last

        # a new shape past the limit would fall back to eager and silently change the bits
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
        if channels_last:
            self.set_memory_format(torch.channels_last_3d)
        if not fuse_norms:
            normalize_eagerly(self.model.encoder)
        compiled = torch.compile(
            self.model.encoder, dynamic=False, options=compile_options() if options is None else dict(options)
        )
        # the compiled module stands in for the encoder and calls it; torch.compile's type is a plain callable
        self.model.encoder = compiled  # pyright: ignore[reportAttributeAccessIssue]
        self.padded_batch = batch_size

    @torch.no_grad()
    def capture(self, frames: int, height: int, width: int) -> None:
        """Record the whole encode of one padded batch as a CUDA graph; `encode` then replays it. Why: the encoder is
        thousands of small kernels, and in the farm its process shares the cores with the decoding workers, so
        launching them one by one from Python left the GPU idle a fifth of the time. A replay runs the same kernels,
        so the bits are those of the same encoder without the graph. Needs `compile` (the padded batch) and CUDA."""
        if not self.padded_batch or self.device.type != "cuda":
            return
        shape = (self.padded_batch, 3, frames, height, width)
        # recorded on the encoder's own device and stream: torch's default capture stream belongs to the device that
        # was current at the first capture, and an encoder on cuda:1 in a process whose current device is cuda:0
        # failed there with cudaErrorStreamCaptureInvalidated
        with torch.cuda.device(self.device):
            static_in = torch.zeros(shape, device=self.device, dtype=self.dtype).contiguous(
                memory_format=self.memory_format
            )  # the layout `encode` gives it
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # compile, and let cuDNN/cuBLAS set up their workspaces, before recording
                for _ in range(2):
                    self.model.encode(static_in)
            torch.cuda.current_stream(self.device).wait_stream(side)
            replay = torch.cuda.CUDAGraph()
            with torch.cuda.graph(replay, stream=side):
                static_out = cast("AutoencoderKLOutput", self.model.encode(static_in)).latent_dist.mean
        self.graphs[shape] = (replay, static_in, static_out)

    def warm_up(self, frames: int, height: int, width: int) -> None:
        """Compile now, on padded batches of black clips, instead of on the first real batch (a streaming encoder
        process does it while the CPU workers decode their first episodes), and on CUDA record the encode as a graph.
        The graphs depend on shapes only, so the latents of real clips are the same bits either way."""
        if self.padded_batch:
            if self.device.type == "cuda":
                self.capture(frames, height, width)
            else:
                self.encode(torch.zeros(1, 3, frames, height, width, device=self.device, dtype=self.dtype))

    @torch.no_grad()
    def encode_first_frame(self, frame0_bchw: torch.Tensor, num_frames: int, batch_size: int = 0) -> torch.Tensor:
        """The 14B i2v input `y`: [mask (4 ch, 1 on latent frame 0) ; VAE([frame 0, zeros x (T-1)])]
        -> [B, 4+C, T', h, w]. Zeros are mid-grey in [-1, 1] space, as in the reference."""
        b, c, h, w = frame0_bchw.shape
        clip = torch.zeros(b, c, num_frames, h, w, dtype=self.dtype, device=frame0_bchw.device)
        clip[:, :, 0] = frame0_bchw.to(self.dtype)
        y = self.encode(clip, batch_size)
        mask = torch.zeros(b, 4, *y.shape[2:], dtype=y.dtype, device=y.device)
        mask[:, :, 0] = 1
        return torch.cat([mask, y], dim=1)


def diffusers_vae_class() -> type[AutoencoderKLWan]:
    """diffusers' AutoencoderKLWan, imported with torchao and peft out of sight. Why: diffusers imports both whenever
    they are installed, and the VAE uses neither. A torchao built for another torch prints library-load failures and
    deprecation warnings in every process that loads a VAE (the farm never quantizes); peft's import alone took 2.4 s
    of an encoder process's start on a GPU node's image. A later import of either in the same process works, but
    diffusers (and transformers, if first imported here) keep them for missing: their LoRA and quantization paths
    stay off in a process that loaded a VAE this way, as the encoder processes and the trainer's preview need."""
    hidden = [name for name in ("torchao", "peft") if name not in sys.modules]
    for name in hidden:
        # importlib.util.find_spec reports it missing (typeshed's sys.modules holds modules only)
        sys.modules[name] = None  # pyright: ignore[reportArgumentType]
    try:
        # the module defining it: `from diffusers import AutoencoderKLWan` loads the same modules, but the package
        # exports its names lazily, which pyright cannot see
        from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return AutoencoderKLWan


def load_vae(
    path: str | Path,
    variant: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    keep_decoder: bool = False,
) -> WanVAE:
    """Load `Wan2.1_VAE.pth` / `Wan2.2_VAE.pth` (or `.safetensors`) or a Diffusers `vae/` folder, strictly.
    `variant` ("wan2.1" | "wan2.2") is checked against the file when given. The decoder is checked, then dropped
    unless `keep_decoder` (offline encoding never decodes)."""
    vae_class = diffusers_vae_class()

    path = Path(path)
    if variant not in (None, "wan2.1", "wan2.2"):
        raise ValueError(f"unknown VAE variant {variant!r}; expected 'wan2.1' or 'wan2.2'")
    if path.is_dir():
        config = folder_config(
            path, "_class_name", ("AutoencoderKLWan",), "a Diffusers VAE folder (pass the vae/ folder itself)"
        )
        found = variant_of_config(config)
        state = read_state_dict(path)
        expect_kind(path, state, ("diffusers-vae",), "VAE")
        # from_config gives (model, unused kwargs) only when asked to (return_unused_kwargs)
        model = on_meta(lambda: cast("AutoencoderKLWan", vae_class.from_config(config)))
        if variant and found != variant:
            raise WeightsError(path, f"this is a {_describe(found)}, but a {_describe(variant)} was asked for")
        load_strict(model, path, state)
    else:
        state = read_state_dict(path)
        kind = expect_kind(path, state, ("wan2.1-vae", "wan2.2-vae", "diffusers-vae"), "VAE")
        if kind == "diffusers-vae":
            raise WeightsError(path, "a Diffusers-layout VAE file needs its config.json: pass the vae/ folder")
        found = "wan2.2" if kind == "wan2.2-vae" else "wan2.1"
        if variant and found != variant:
            raise WeightsError(path, f"this is a {_describe(found)}, but a {_describe(variant)} was asked for")
        model = on_meta(lambda: vae_class(**_config_from_wan_state(state, found)))
        table = {wan_vae_key(k, found): k for k in model.state_dict()}
        check_keys(path, state, {wk: model.state_dict()[dk].shape for wk, dk in table.items()})
        assign_loaded(model, path, {dk: state[wk] for wk, dk in table.items()})
    if model.config["z_dim"] != VARIANTS[found]["z_dim"]:
        raise WeightsError(
            path, f"{model.config['z_dim']} latent channels; a {_describe(found)} has {VARIANTS[found]['z_dim']}"
        )
    if not keep_decoder:  # None drops a submodule (Module.__setattr__); diffusers types these as always present
        model.decoder = None  # pyright: ignore[reportAttributeAccessIssue]
        model.post_quant_conv = None  # pyright: ignore[reportAttributeAccessIssue]
    spatial = 16 if found == "wan2.2" else 8
    return WanVAE(model, VaeInfo(found, model.config["z_dim"], spatial, 4, str(path)), device, dtype)


def _describe(variant: str) -> str:
    return {"wan2.1": "Wan2.1 VAE (16 latent channels, 8x)", "wan2.2": "Wan2.2 VAE38 (48 latent channels, 16x)"}[
        variant
    ]
