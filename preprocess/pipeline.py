"""One work unit: episodes -> windows -> views (CPU), then the frozen encoders over batches (GPU), then the spill.

The two halves are separate callables so they can run on separate resources: `unit_samples` decodes each episode
once and yields `WindowSample`s whose videos are already at model resolution; `encode_samples` batches them through
`Encoders` (VAE latents, CLIP features or CLIP's input pixels, the 14B's y) into tar members. `process_unit` chains
them for one unit.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from wampipe.preprocess import write
from wampipe.preprocess.errors import DatasetError, EncoderOutputError
from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.preprocess.prompts import prompt_id, window_prompts
from wampipe.preprocess.selection import source
from wampipe.preprocess.spec import VAE_OF_MODEL, BuildSpec
from wampipe.preprocess.state_action import columns_for, slice_keys, window_state_action
from wampipe.preprocess.views import episode_canvas, episode_model_video, eval_params, sample_video
from wampipe.preprocess.windows import episode_windows
from wampipe.shardformat.embodiments import Embodiment, get_embodiment
from wampipe.shardformat.keys import sample_key
from wampipe.shardformat.layout import ACTION, CLIP, CLIP_PIXELS, IMAGE_MEMBER, LATENTS, STATE, Y
from wampipe.shardformat.members import encode_sample


@dataclass
class Launched:
    """A batch `Encoders.launch` queued: its codes' pinned host tensors (filled once `done` has passed; None on a
    CPU, where they are filled already), the device outputs they copy from (referenced so their memory is not reused
    before the copies ran) and the batch's clip count."""

    host: dict[str, torch.Tensor]
    device: dict[str, torch.Tensor]
    done: torch.cuda.Event | None
    batch: int


@dataclass
class WindowSample:
    """One window x augmentation variant of an episode, ready for the encoders."""

    key: str
    video: torch.Tensor  # [3, T, h, w] at model resolution, in [-1, 1]
    tensors: dict[str, np.ndarray]  # raw state and action
    meta: dict
    prompts: dict[str, str]  # annotation column -> prompt text


def _variant_seed(*parts: int) -> int:
    """One augmentation draw per (seed, episode, window, variant), independent of unit cuts and workers."""
    return int.from_bytes(hashlib.sha256("-".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


# ---------------------------------------------------------------- CPU: decode, windows, views


def episode_samples(spec: BuildSpec, ds: LeRobotDataset, emb: Embodiment, index: int) -> Iterator[WindowSample]:
    """Every window x variant of one episode (none if it is shorter than a window); raises DatasetError."""
    state_cols = columns_for(ds.modality.state, emb.state_keys)
    action_cols = columns_for(ds.modality.action, emb.action_keys)
    episode = ds.episode(index, columns=list(dict.fromkeys(state_cols + action_cols)))
    windows = episode_windows(episode.length, emb.window, spec.anchor_stride)
    if not windows:
        return
    data_path = ds.episode_info(index).data_path
    states = slice_keys(episode, ds.modality.state, emb.state_keys, data_path)
    actions = slice_keys(episode, ds.modality.action, emb.action_keys, data_path)
    needed = np.unique(np.concatenate([w.video_rows for w in windows]))
    position = np.full(episode.length, -1, np.int64)
    position[needed] = np.arange(len(needed))
    views = [episode.cameras[c].read(needed, backend=spec.decode_backend) for c in emb.cameras]
    if len({v.shape for v in views}) > 1:  # every camera of an episode at one frame size (the canvas stacks them)
        sizes = ", ".join(f"{c} {v.shape[1]}x{v.shape[2]}" for c, v in zip(emb.cameras, views))
        raise DatasetError(episode.cameras[emb.cameras[0]].path, index, f"cameras differ in frame size: {sizes}")
    frames = np.stack(views)
    height, width = frames.shape[2:4]
    model_video = None
    if not spec.augment_variants:  # one deterministic, per-frame transform: apply it to each frame once per episode
        params = eval_params(height, width)
        canvas = episode_canvas(frames, emb, spec.model, params)
        model_video = episode_model_video(canvas, emb.preset(spec.model).target_hw)
    for window in windows:
        state, action = window_state_action(states, actions, window, emb)
        prompts = window_prompts(episode, window.start, emb)
        rows = position[window.video_rows]
        for variant in range(max(1, spec.augment_variants)):
            if model_video is not None:
                video = model_video[:, rows]
            else:
                generator = torch.Generator().manual_seed(_variant_seed(spec.seed, index, window.start, variant))
                video, _, params = sample_video(list(frames[:, rows]), emb, spec.model, generator=generator)
            meta = {
                "dataset": spec.dataset,
                "embodiment": emb.tag,
                "episode": index,
                "window_start": window.start,
                "anchor_multiplicity": window.weight,
                "variant": variant,
                "augmentation": params,
                "prompt_ids": {c: prompt_id(p) for c, p in prompts.items()},
                "model": spec.model,
            }
            yield WindowSample(
                sample_key(spec.dataset, index, window.start, variant),
                video,
                {STATE: state, ACTION: action},
                meta,
                prompts,
            )


def unit_samples(spec: BuildSpec, episodes: list[int], report: dict) -> Iterator[WindowSample]:
    """The samples of a unit's episodes. A bad episode is left out (unless --fail-fast) and, like one shorter than
    a window, recorded with its reason in `report`, which also collects the encoded episodes and their prompts."""
    ds, emb = source(spec), get_embodiment(spec.embodiment)
    for index in episodes:
        try:
            produced = list(episode_samples(spec, ds, emb, index))  # whole episodes only: a failure leaves no part
        except Exception as err:  # any fault of one episode is its failure, not the build's end (unless --fail-fast)
            if spec.fail_fast:
                raise
            reason = (
                str(err)
                if isinstance(err, DatasetError)
                else " ".join(f"{ds.root}: episode {index}: {type(err).__name__}: {err}".split())
            )
            report["failures"].append({"episode": index, "reason": reason})
            continue
        if not produced:
            length = ds.length(index)
            report["skipped"].append(
                {
                    "episode": index,
                    "reason": f"shorter than one window ({length} rows, a full window needs {emb.window.extent + 1})",
                }
            )
            continue
        report["encoded"].append(index)
        for sample in produced:
            report["prompts"].update({prompt_id(p): p for p in sample.prompts.values()})
            yield sample


# ---------------------------------------------------------------- GPU: frozen encoders


@contextlib.contextmanager
def timed(spent: dict[str, float], what: str) -> Iterator[None]:
    """Adds the seconds the block took to `spent[what]` (the encoders' start split, the encoder loop's time)."""
    start = time.perf_counter()
    yield
    spent[what] = spent.get(what, 0.0) + time.perf_counter() - start


class Encoders:
    """The unit-side frozen encoders (VAE, CLIP) on the spec's device. With `--image-features pixels` only CLIP's
    preprocessing runs: its output, the exact tensor the tower consumes, is stored in the compute dtype."""

    def __init__(self, spec: BuildSpec, on_imported: Callable[[], None] = lambda: None):
        """`on_imported` is called once diffusers is imported, before any weight is read (the stream starts its CPU
        workers then)."""
        from wampipe.encoders.image_encoder import load_image_encoder
        from wampipe.encoders.vae import diffusers_vae_class, load_vae, use_compile_cache

        self.device, self.dtype = torch.device(spec.device), getattr(torch, spec.dtype)
        self.start_seconds: dict[str, float] = {}  # where the start went (the stream's "ready" line says it)
        if self.device.type == "cuda":  # the CUDA context, made by the first allocation: apart from the weights
            with timed(self.start_seconds, "CUDA start"):
                torch.empty(0, device=self.device)
        with timed(self.start_seconds, "diffusers import"):  # most of a warm start where many packages are installed
            diffusers_vae_class()
        on_imported()
        with timed(self.start_seconds, "VAE weights"):
            self.vae = load_vae(spec.vae, variant=VAE_OF_MODEL[spec.model], device=spec.device, dtype=self.dtype)
        self.compiled_graphs = ""  # how many of the compiled graphs the compile cache held (the "ready" line)
        if spec.vae_compile:
            from torch._dynamo.utils import counters

            # the counters are the process's: a local-pool worker builds these encoders once per unit
            hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
            with timed(self.start_seconds, "compiling" + " and recording" * (self.device.type == "cuda")):
                if spec.compile_cache:
                    use_compile_cache(spec.compile_cache)
                self.vae.compile(spec.batch_size)
                emb = get_embodiment(spec.embodiment)
                self.vae.warm_up(emb.window.num_frames, *emb.preset(spec.model).target_hw)
            cached = counters["inductor"]["fxgraph_cache_hit"] - hits
            made = counters["inductor"]["fxgraph_cache_miss"] - misses
            self.compiled_graphs = f"{cached} of {cached + made} graphs from the compile cache"
        self.image_member = IMAGE_MEMBER[spec.image_features]
        with timed(self.start_seconds, "CLIP weights"):
            tower_device = spec.device if self.image_member == CLIP else "meta"  # pixels: no CLIP weight is needed
            self.clip = load_image_encoder(spec.image_encoder, device=tower_device, dtype=self.dtype)
        self.needs_y = VAE_OF_MODEL[spec.model] == "wan2.1"
        # CLIP runs on a stream of its own beside the VAE: its matmuls take the SMs that the VAE's memory-bound
        # kernels leave idle; the kernels, and so the bits, are the same
        runs_clip_on_gpu = self.device.type == "cuda" and self.image_member == CLIP
        self.clip_stream = torch.cuda.Stream(self.device) if runs_clip_on_gpu else None

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.run(self.prepare(batch))

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The host half of a batch of `stack_clips`: CLIP's resize of frame 0 (on the host, as every executor does
        it), then the videos and pixels on the device in the compute dtype, copied from pinned memory on the current
        stream (a streaming encoder prepares the next batch on a side stream while the device runs this one)."""
        pixels = self.clip.preprocess(batch["frame0"])
        videos = batch["videos"]
        device, dtype = self.device, self.dtype
        if device.type == "cuda":
            videos, pixels = videos.pin_memory(), pixels.pin_memory()
        return {
            "videos": videos.to(device=device, dtype=dtype, non_blocking=True),
            "pixels": pixels.to(device=device, dtype=dtype, non_blocking=True),
        }

    def run(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The device half: VAE latents, CLIP features (and the 14B's y) as bf16 on the host; or, in place of the
        features, CLIP's input pixels on the host in the compute dtype."""
        return self.finish(self.launch(inputs))

    def launch(self, inputs: dict[str, torch.Tensor]) -> Launched:
        """`run` up to its wait: the encoders' work and the copies of their outputs to pinned host memory queued on
        the device; `finish` waits for them. A streaming encoder launches the next batch before it finishes this
        one, so the device never waits while the host checks and sends a batch's codes."""
        videos = inputs["videos"]
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        # what made the inputs: CLIP's stream waits for it, not for the VAE
        inputs_ready = None
        if current is not None and self.clip_stream is not None:
            inputs_ready = torch.cuda.Event()
            inputs_ready.record(current)
        out = {LATENTS: self.vae.encode(videos)}
        if self.image_member == CLIP:
            out[CLIP] = self._features(inputs["pixels"], inputs_ready)
        if self.needs_y:
            out[Y] = self.vae.encode_first_frame(videos[:, :, 0], videos.shape[2])
        if self.image_member == CLIP_PIXELS:
            out[CLIP_PIXELS] = inputs["pixels"]
        host = {}
        for name, value in out.items():
            dtype = value.dtype if name == CLIP_PIXELS else torch.bfloat16
            host[name] = torch.empty(value.shape, dtype=dtype, pin_memory=current is not None)
            host[name].copy_(value, non_blocking=current is not None)
        done = None
        if current is not None:  # on the encoders' device's stream, which ran the copies (not the current device's)
            done = torch.cuda.Event()
            done.record(current)
        return Launched(host, out, done, len(videos))

    def _features(self, pixels: torch.Tensor, inputs_ready: torch.cuda.Event | None) -> torch.Tensor:
        """CLIP's features; on a GPU run on CLIP's stream once `inputs_ready` has passed, the current stream then
        waiting for them."""
        if self.clip_stream is None or inputs_ready is None:
            return self.clip.encode_pixels(pixels)
        self.clip_stream.wait_event(inputs_ready)
        with torch.cuda.stream(self.clip_stream):
            features = self.clip.encode_pixels(pixels)
        current = torch.cuda.current_stream(self.device)
        pixels.record_stream(self.clip_stream)  # its memory is not reused before CLIP has read it
        features.record_stream(current)  # nor the features' before the current stream has copied them
        current.wait_stream(self.clip_stream)
        return features

    def finish(self, launched: Launched) -> dict[str, torch.Tensor]:
        """Wait for a `launch`'s copies; its codes on the host, checked: a broken encoder must not fill a build with
        NaN."""
        if launched.done is not None:
            launched.done.synchronize()
        out = launched.host
        for name, value in out.items():  # as stored
            if name != CLIP_PIXELS and not torch.isfinite(value).all():
                raise EncoderOutputError(
                    f"the encoders' {name} of a batch of {launched.batch} clips hold NaN or inf (as "
                    f"bf16): check the {'VAE' if name in (LATENTS, Y) else 'image encoder'}'s "
                    f"weights and --dtype"
                )
        return out


def encode_samples(
    encoders: Encoders, samples: Iterable[WindowSample], batch_size: int, compress: str
) -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """(key, tar members) per sample, encoded in batches of `batch_size` in arrival order."""
    batch: list[WindowSample] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == batch_size:
            yield from _encode_batch(encoders, batch, compress)
            batch = []
    if batch:
        yield from _encode_batch(encoders, batch, compress)


def stack_clips(videos: list[torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A batch of clips ([3, T, H, W] in [-1, 1], float32) as an encoder takes it: the clips in the encoders' compute
    dtype, and frame 0 in float32 for CLIP's resize (which the reference runs on the unrounded frame). A worker of the
    stream casts before sending: in bf16 that halves the bytes the encoder process pins and copies per batch (324 MB
    -> 162 MB at the 5B's clip), and the device would round them the same way (to nearest even)."""
    return {"videos": torch.stack([v.to(dtype) for v in videos]), "frame0": torch.stack([v[:, 0] for v in videos])}


def _encode_batch(encoders: Encoders, batch: list[WindowSample], compress: str):
    with torch.inference_mode():
        outputs = encoders(stack_clips([s.video for s in batch], encoders.dtype))
    for i, s in enumerate(batch):
        yield s.key, encode_sample(s.key, {**s.tensors, **{k: v[i] for k, v in outputs.items()}}, s.meta, compress)


# ---------------------------------------------------------------- one unit


def unit_report(spec: BuildSpec, episodes: list[int]) -> dict:
    """A unit's JSON record before its samples: `unit_samples` fills in what became of each episode."""
    return {
        "episodes": episodes,
        "failures": [],
        "skipped": [],
        "prompts": {},
        "encoded": [],
        "inputs": BuildSpec.unit_inputs(spec.inputs()),
    }


def process_unit(spec: BuildSpec, unit: int, episodes: list[int]) -> dict:
    """Decode, transform and encode the unit's episodes; spill its samples. Returns the unit's JSON record."""
    torch.set_num_threads(spec.threads_per_worker)
    report = unit_report(spec, episodes)
    samples = encode_samples(Encoders(spec), unit_samples(spec, episodes, report), spec.batch_size, spec.compress)
    # write_unit stores `report` after draining `samples`, so it holds the outcome of every episode
    return write.write_unit(Path(spec.out), unit, samples, report)
