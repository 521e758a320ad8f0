"""Look at a build: decode the stored latents with the Wan VAE decoder back to the multi-view canvas and write, per
sample, `<key>.mp4` (the decoded window) and `<key>.png` (frames over time, the prompt, embodiment and window, the
state and action rows against time, frame 0 as CLIP consumes it when the shards hold its input pixels; with --src,
the source cameras at the same rows, so a flipped, swapped or shifted view shows).

    python -m preprocess preview shards/droid --vae Wan2.2_VAE.pth --samples 4 --out preview/ --src data/droid
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Iterator

import numpy as np
import tyro

from wampipe.configs.cli import check_at_least
from wampipe.errors import UsageError
from wampipe.preprocess.windows import Window, window_at
from wampipe.shardformat.embodiments import Embodiment, get_embodiment
from wampipe.shardformat.manifest import Manifest
from wampipe.shardformat.storage import STORE_ERRORS

if TYPE_CHECKING:  # torch, the VAE and the reader are imported where used: `--help` without loading torch
    import torch

    from wampipe.encoders.vae import WanVAE
    from wampipe.preprocess.lerobot import Ranges
    from wampipe.shardformat.index import ShardIndex, ShardReader

SHEET_FRAMES = 8  # decoded frames shown per row of the sheet, evenly spaced over the window
# the widths DreamZero's DiT zero-pads state and actions to (its max_state_dim and action_dim), with a valid mask
PADDED_WIDTH = {"state": 64, "action": 32}


@dataclass
class Args:
    shards: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="SHARDS")]]
    """Shard directory (holds manifest.json): a path or a URL (s3://bucket/prefix; S3 settings from AWS_*)."""
    vae: Path
    """The VAE file or Diffusers vae/ folder the shards were built with (its sha256 must equal the manifest's)."""
    samples: int = 4
    """How many samples to preview: the first ones in manifest order (shards in order, keys in tar order)."""
    out: Path = Path("preview")
    """Folder for <key>.mp4 and <key>.png (created)."""
    src: Path | None = None
    """The LeRobot dataset the shards were built from: its camera frames at the same rows go beside the decoded ones
    (through the build's keep ranges: the recorded rows each kept row came from)."""
    keep_ranges: Path | None = None
    """With --src, for a build cut by keep ranges: that file, when it no longer lies where the manifest says (its
    sha256 must be the manifest's)."""
    device: str = "cpu"
    """Where the decoder runs: cpu or cuda."""


def run(args: Args) -> None:
    try:
        preview(args)  # a ShardFormatError, like every WampipeError, is the command's one line already
    except STORE_ERRORS as err:
        raise UsageError(f"{args.shards}: unreadable: {err}") from None


def preview(args: Args) -> None:
    check_at_least(("--samples", args.samples, 1))
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} is a file; give a folder for the previews")
    try:
        import matplotlib  # noqa: F401  (the sheets; asked for before anything is decoded)
    except ImportError:
        raise UsageError("preview sheets need matplotlib: pip install 'wampipe[plot]'") from None
    from wampipe.preprocess.decode import encode_mp4
    from wampipe.shardformat.index import ShardIndex, ShardReader

    index = ShardIndex(args.shards)  # the trainer's view: manifest, statistics and text table checked
    manifest = index.manifest
    if args.src:
        check_source(args.src, manifest, args.shards)
    vae = build_decoder(args.vae, manifest, args.shards, args.device)
    prompts = index.store.read_json(manifest.text_table["prompts"])
    emb = get_embodiment(manifest.embodiment)
    fps = float(manifest.source["fps"])
    args.out.mkdir(parents=True, exist_ok=True)
    for key, meta, tensors in first_samples(ShardReader(index), args.samples):
        frames = to_canvas_frames(vae.decode(tensors["latents"][None]))[0]
        window = window_at(meta["window_start"], emb.window)
        encode_mp4(args.out / f"{key}.mp4", frames, round(fps), "h264")
        prompt = prompts.get(sorted(meta["prompt_ids"].items())[0][1], {}).get("text", "?")
        source = None
        if args.src:
            cut = episode_cut(args.src, manifest, meta["episode"], args.keep_ranges)
            source = source_frames(args.src, emb, meta["episode"], window, frames.shape[1:3], cut)
        write_sheet(
            args.out / f"{key}.png", key, frames, meta, tensors, prompt, index, window, fps, source, emb.cameras
        )
        print(f"wrote {args.out / key}.mp4 and .png")


def build_decoder(path: Path, manifest: Manifest, shards: str, device: str) -> WanVAE:
    """The strict decoder of the VAE the shards were built with; refuses another file in one line."""
    import torch

    from wampipe.encoders.vae import load_vae
    from wampipe.encoders.weights import weights_sha256

    if not path.exists():
        raise UsageError(f"--vae {path}: not found")
    built_with = manifest.encoders.get("vae")
    if not built_with:
        raise UsageError(f"{shards}: the manifest records no VAE (synthetic shards): nothing to decode with")
    if weights_sha256(path)[0] != built_with["sha256"]:
        raise UsageError(
            f"--vae {path}: not the VAE {shards} was built with ({built_with['path']}, sha256 "
            f"{built_with['sha256'][:12]}): pass that file"
        )
    return load_vae(path, manifest.transform["vae_variant"], device, torch.float32, keep_decoder=True)


def check_source(src: Path, manifest: Manifest, shards: str) -> None:
    """Refuse, in one line, a dataset other than the one the shards were built from: its frames would mislead."""
    from wampipe.preprocess.spec import fingerprint

    if not (src / "meta").is_dir():
        raise UsageError(f"--src {src}: not a LeRobot dataset (no meta/ folder)")
    built_from = manifest.source
    if fingerprint(src) != built_from["fingerprint"]:
        raise UsageError(
            f"--src {src}: not the dataset {shards} was built from ({built_from['root']}, fingerprint "
            f"{built_from['fingerprint'][:12]}): pass that dataset"
        )


def first_samples(reader: ShardReader, n: int) -> Iterator[tuple[str, dict, dict]]:
    """(key, meta, tensors) of the first `n` samples in manifest order (shards in order, keys in tar order), each
    read and checked as the trainer reads them (shardformat.index)."""
    table = reader.index.table
    for shard in range(len(reader.index.manifest.shards)):
        rows = table.shard_rows(shard)
        for row in rows[: max(0, n)]:
            yield table.key(row), *reader.raw_row(row)
        n -= len(rows)
        if n <= 0:
            return


def to_canvas_frames(video_bcthw: torch.Tensor) -> np.ndarray:
    """Decoded video in [-1, 1] -> uint8 [B, T, H, W, 3], the inverse of the farm's /255 then Normalize(0.5, 0.5)."""
    import torch

    x = ((video_bcthw.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 4, 1).cpu().numpy()


def episode_cut(src: Path, manifest: Manifest, episode: int, override: Path | None) -> Ranges | None:
    """The keep ranges the build cut `episode` to (None: it kept every row), from the keep-ranges file the manifest
    names (or `override`), refused in one line unless its sha256 is the manifest's."""
    from wampipe.preprocess.selection import Filters, read_facts, read_keep_ranges
    from wampipe.shardformat.files import sha256_file

    stated = manifest.selection.get("filters", {}).get("keep_ranges")
    if not stated:
        return None
    path = Path(override or stated["path"])
    if not path.is_file() or sha256_file(path) != stated["sha256"]:
        raise UsageError(
            f"--src: the build cut its episodes to the keep ranges of {stated['path']} (sha256 "
            f"{stated['sha256'][:12]}), {'missing' if not path.is_file() else 'changed'} at {path}: "
            f"pass that file with --keep-ranges"
        )
    facts = read_facts(str(src), Filters(keep_ranges=str(path), keep_ranges_key=stated["key"]), [episode])[0]
    if facts.error is not None or facts.key is None:
        raise UsageError(facts.error or f"--src {src}: episode {episode} has no key")
    return read_keep_ranges(path).get(facts.key, ())


def source_frames(
    src: Path, emb: Embodiment, episode: int, window: Window, hw: tuple[int, int], cut: Ranges | None = None
) -> np.ndarray:
    """The source cameras at the window's video rows (of the episode cut to `cut`, as the build saw it), raw (no
    crop, no canvas), side by side in the embodiment's camera order, each resized to the decoded canvas's height:
    uint8 [T, H, W', 3]."""
    import torch

    from wampipe.preprocess.lerobot import LeRobotDataset

    views = LeRobotDataset(src, None if cut is None else {episode: cut}).episode(episode).cameras
    out = []
    for camera in emb.cameras:
        x = torch.from_numpy(views[camera].read(window.video_rows)).permute(0, 3, 1, 2).float()
        size = (hw[0], round(x.shape[-1] * hw[0] / x.shape[-2]))
        out.append(torch.nn.functional.interpolate(x, size=size, mode="bilinear", antialias=True))
    return torch.cat(out, dim=-1).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def write_sheet(
    path: Path,
    key: str,
    frames: np.ndarray,
    meta: dict,
    tensors: dict,
    prompt: str,
    index: ShardIndex,
    window: Window,
    fps: float,
    source: np.ndarray | None,
    cameras: tuple[str, ...] = (),
) -> None:
    import matplotlib
    import torch

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = np.linspace(0, len(frames) - 1, min(SHEET_FRAMES, len(frames))).round().astype(int)
    image_rows = [("decoded", frames)] + ([("source", source)] if source is not None else [])
    pixels = clip_input_image(tensors.get("clip_pixels"))
    heights = [2.2 * video.shape[1] / video.shape[2] + 0.3 for _, video in image_rows] + [3.5]
    fig = plt.figure(figsize=(2.2 * len(shown), sum(heights) + 0.8), layout="constrained")
    grid = fig.add_gridspec(len(image_rows) + 1, len(shown), height_ratios=heights)
    for r, (label, video) in enumerate(image_rows):
        for c, i in enumerate(shown):
            ax = fig.add_subplot(grid[r, c])
            ax.imshow(video[i])
            ax.set_axis_off()
            ax.set_title(f"{label} row {window.video_rows[i]} ({window.video_rows[i] / fps:.2f} s)", fontsize=7)
    plots = grid[-1, :].subgridspec(1, 3 if pixels is not None else 2)
    manifest = index.manifest
    for c, name in enumerate(("state", "action")):
        rows = window.state_rows if name == "state" else window.action_rows
        width = PADDED_WIDTH[name]
        plot_rows(
            fig.add_subplot(plots[0, c]),
            name,
            torch.from_numpy(np.asarray(tensors[name], np.float32)),
            rows / fps,
            index.q01[name],
            index.q99[name],
            width,
            manifest.modality_keys[name],
        )
    if pixels is not None:
        ax = fig.add_subplot(plots[0, 2])
        ax.imshow(pixels)
        ax.set_axis_off()
        ax.set_title("clip_pixels (frame 0 as CLIP consumes it)", fontsize=8)
    fig.suptitle(
        f"{key}: {meta['embodiment']}, {manifest.model}, episode {meta['episode']}, window rows "
        f"{window.video_rows[0]}-{window.video_rows[-1]}, variant {meta['variant']}"
        + (f"; source cameras left to right: {', '.join(cameras)}" if source is not None else "")
        + f"\n{wrap(prompt)}",
        fontsize=8,
    )
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_rows(
    ax, name: str, raw: torch.Tensor, seconds: np.ndarray, q01: np.ndarray, q99: np.ndarray, width: int, keys: list[str]
) -> None:
    """Every dimension against time as the trainer feeds it to the model: q99-normalized with the build's statistics,
    clamped to [-1, 1], zero-padded to the model's width with a valid mask. Grey: masked (padding) and dims the
    statistics leave unnormalized (q01 == q99)."""
    from wampipe.shardformat.stats import normalize_q99, pad_with_mask

    values, mask = pad_with_mask(normalize_q99(raw, q01, q99), width)
    constant = np.asarray(q01) == np.asarray(q99)
    for d in range(raw.shape[1]):
        ax.plot(
            seconds,
            values[:, d],
            marker="." if name == "state" else None,
            lw=1,
            color="0.6" if constant[d] else None,
            label=f"{d}" + (" (q01 = q99)" if constant[d] else ""),
        )
    if not mask.all():
        ax.plot(
            seconds,
            values[:, raw.shape[1]],
            color="0.8",
            ls="--",
            lw=1,
            label=f"{raw.shape[1]}-{width - 1}: padding, masked",
        )
    ax.set_title(
        f"{name} [{raw.shape[0]}x{raw.shape[1]}] ({', '.join(keys)}), normalized, {int(mask[0].sum())} of "
        f"{width} dims valid",
        fontsize=8,
    )
    ax.set_xlabel("seconds into the episode", fontsize=7)
    ax.set_ylim(-1.1, 1.1)
    ax.tick_params(labelsize=6)
    ax.legend(fontsize=5, ncol=4)


def clip_input_image(pixels: torch.Tensor | None) -> np.ndarray | None:
    """clip_pixels [3, S, S] (CLIP mean/std) -> uint8 [S, S, 3], or None when the shards hold CLIP's features."""
    if pixels is None:
        return None
    import torch

    from wampipe.encoders.image_encoder import CLIP_MEAN, CLIP_STD

    x = pixels.float() * torch.tensor(CLIP_STD).view(3, 1, 1) + torch.tensor(CLIP_MEAN).view(3, 1, 1)
    return (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def wrap(text: str, width: int = 160) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)[:4])


def main() -> None:
    run(tyro.cli(Args, description=__doc__))


if __name__ == "__main__":
    main()
