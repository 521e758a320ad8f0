"""Open-loop action error of a trained DiT on a shard directory (docs/EVALUATION.md, Open-loop action error): the
model of a run's checkpoint or of an eval-ready export, the sampler (train/evaluation/sample.py) drawing the first
action chunk of each window from the observation alone, and the report `python -m train.evaluate` writes."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import tyro

from wampipe.configs.cli import check_at_least
from wampipe.errors import UsageError
from wampipe.shardformat.index import ShardIndex
from wampipe.shardformat.stats import unnormalize_q99
from wampipe.train.data import data_dims
from wampipe.train.dit.model import CausalWanModel, DiTConfig
from wampipe.train.evaluation.sample import SamplerConfig, action_error, eval_batches
from wampipe.train.dit.text import pad_text


@dataclass
class Args:
    """Open-loop action error of a run's checkpoint or an eval-ready export on a shard directory."""

    source: tyro.conf.Positional[Path]
    """A run directory (--checkpoint.dir of a training run) or an eval-ready export folder."""
    shards: str
    """Shard directory (path or URL) to evaluate on, e.g. a held-out split."""
    samples: int = 64
    """Windows evaluated: the first N of the manifest (all if fewer)."""
    out: Path = Path("open-loop")
    """Output directory: open_loop.json and open_loop.png."""
    step: int | None = None
    """Checkpoint step of a run directory (default: its newest complete one)."""
    batch_size: int = 4
    """Samples per DiT call."""
    plot_samples: int = 4
    """Samples drawn in open_loop.png (0: no plot)."""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """Device to sample on."""
    negative_text: Path | None = None
    """umT5 output of the negative prompt (a safetensors file of one [tokens, text_dim] tensor): guides the video
    prediction with --sampler.cfg-scale, as the reference does; shards carry no negative prompt, so none by default."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)


def _dit_config(values: dict, where: str) -> DiTConfig:
    names = {f.name for f in fields(DiTConfig)}
    try:
        return DiTConfig(**{k: v for k, v in values.items() if k in names})
    except TypeError as err:
        raise UsageError(f"{where}: not a DiT configuration ({err})") from None


def load_checkpoint(run: Path, step: int | None, dims: dict, shards: str) -> tuple[CausalWanModel, str]:
    """The DiT of a run directory's checkpoint, read on this one process (DCP without a process group)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from wampipe.train.checkpoint import DataOnlyPlanner, DataOnlyReader, complete_checkpoints

    found = dict(complete_checkpoints(run))
    if not found or (step is not None and step not in found):
        have = f"complete steps {sorted(found)}" if found else "no complete checkpoint"
        raise UsageError(
            f"{run}: {'no checkpoint of step ' + str(step) if step is not None else 'nothing to load'} "
            f"({have}); pass a run directory with a saved step, or its export folder"
        )
    path = found[step if step is not None else max(found)]
    recorded = json.loads((path / "rank-00000.json").read_text())["model"]
    if recorded.get("lora"):
        raise UsageError(
            f"{path}: a LoRA checkpoint holds the adapters only; evaluate the run's export folder "
            f"(merged weights) instead"
        )
    model = CausalWanModel(_dit_config(recorded, str(path / "rank-00000.json")))
    check_fits(model.cfg, dims, str(path), shards)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP's note that it loads in this one process: the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(state, storage_reader=DataOnlyReader(path), planner=DataOnlyPlanner())
    model.load_state_dict(state["model"])
    return model, str(path)


def load_export(folder: Path, dims: dict, shards: str) -> tuple[CausalWanModel, str]:
    """The DiT of an eval-ready export: its widths from config.json, the CLIP widths (not in the official config)
    from the shards it is evaluated on; weights read strictly."""
    from wampipe.train.dit.weights import load_weights

    config = folder / "config.json"
    if not config.is_file():
        raise UsageError(
            f"{folder}: no config.json, so no DiT configuration; evaluate the run directory, or export "
            f"with --checkpoint.export-base"
        )
    try:
        dit = json.loads(config.read_text())["action_head_cfg"]["config"]["diffusion_model_cfg"]
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        raise UsageError(f"{config}: no action_head_cfg.config.diffusion_model_cfg ({err})") from None
    clip = {k: v for k, v in dims.items() if k in ("image_dim", "image_len")}
    model = CausalWanModel(_dit_config(dit | clip, str(config)))
    check_fits(model.cfg, dims, str(folder), shards)
    load_weights(model, folder)  # a WeightsError names the file and the keys
    return model, str(folder)


def load(source: Path, dims: dict, shards: str, step: int | None = None) -> tuple[CausalWanModel, str]:
    """A run directory's checkpoint or an export folder's weights, as a plain model on the CPU, once its DiT is known
    to fit the shards of `data_dims` `dims`."""
    if not source.is_dir():
        raise UsageError(f"{source}: not a directory; pass a run directory or an eval-ready export folder")
    if (source / "config.json").is_file():
        return load_export(source, dims, shards)
    return load_checkpoint(source, step, dims, shards)


def check_fits(model_cfg: DiTConfig, dims: dict, source: str, shards: str) -> None:
    """Stop in one line when the shards were built for another DiT (widths, latent grid, longest prompt)."""
    wrong = [
        f"{k}: model {getattr(model_cfg, k)}, shards {v}"
        for k, v in dims.items()
        if k not in ("text_len", "num_action_per_block") and getattr(model_cfg, k) != v
    ]
    if dims["text_len"] > model_cfg.text_len:
        wrong.append(f"longest prompt {dims['text_len']} tokens > text_len {model_cfg.text_len}")
    if wrong:
        raise UsageError(f"{shards} does not fit the DiT of {source}: {', '.join(wrong)}")


def plot(pred: np.ndarray, target: np.ndarray, out: Path) -> None:
    """Predicted (solid) and recorded (dashed) raw actions of a few samples, one panel per action dim."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("open_loop.png needs matplotlib: pip install 'wampipe[plot]' (or pass --plot-samples 0)")
    n, horizon, dims = pred.shape
    cols = min(dims, 4)
    rows = -(-dims // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.6 * rows), squeeze=False)
    for d, ax in enumerate(axes.flat):
        if d >= dims:
            ax.set_visible(False)
            continue
        for s in range(n):
            (line,) = ax.plot(pred[s, :, d], lw=1)
            ax.plot(target[s, :, d], "--", lw=1, color=line.get_color())
        ax.set_title(f"action dim {d}", fontsize=9)
        ax.set_xlabel("action step", fontsize=7)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"open loop: predicted (solid) vs recorded (dashed), {n} samples, {horizon} steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def read_negative_text(path: Path, model_cfg: DiTConfig) -> torch.Tensor:
    """[1, text_len, text_dim]: the one tensor of `path`, zero-padded as prompts are."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = list(load_file(path).values())
    except (OSError, SafetensorError) as err:
        raise UsageError(f"--negative-text {path}: not readable as safetensors ({err})") from None
    shape = tuple(tensors[0].shape) if len(tensors) == 1 else None
    if shape is None or len(shape) != 2 or shape[1] != model_cfg.text_dim or shape[0] > model_cfg.text_len:
        raise UsageError(
            f"--negative-text {path}: needs one [tokens <= {model_cfg.text_len}, {model_cfg.text_dim}] "
            f"tensor (the umT5 output of the negative prompt), has {[tuple(t.shape) for t in tensors]}"
        )
    return pad_text([tensors[0].float()], model_cfg.text_len)


def check_args(args: Args) -> None:
    """Refuse a bad flag in one line before a checkpoint or a shard is opened."""
    check_at_least(
        ("--samples", args.samples, 1), ("--batch-size", args.batch_size, 1), ("--plot-samples", args.plot_samples, 0)
    )
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} is a file; give a directory for open_loop.json and open_loop.png")
    try:
        torch.device(args.device)
    except RuntimeError as err:
        raise UsageError(f"--device {args.device}: {err}") from None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA device is visible")


def evaluate(args: Args) -> dict:
    check_args(args)
    try:
        args.sampler.step_mask()
    except ValueError as err:
        raise UsageError(str(err)) from None
    index = ShardIndex(args.shards)  # a ShardFormatError names the file
    if index.manifest.image_features != "encoded":
        raise UsageError(
            f"{args.shards}: holds CLIP's input pixels, not its features; evaluate on shards built "
            f"with --image-features encoded"
        )
    dims = data_dims(index)
    model, source = load(args.source, dims, args.shards, args.step)
    device = torch.device(args.device)
    model.to(device)
    negative = None if args.negative_text is None else read_negative_text(args.negative_text, model.cfg).to(device)
    q01, q99 = index.q01["action"], index.q99["action"]
    shown: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(pred, target, mask):
        if sum(len(p) for p, _ in shown) < args.plot_samples:
            shown.append((pred.cpu(), target.cpu()))

    batches = eval_batches(index, model.cfg, args.samples, args.batch_size, device)
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        errors = action_error(model, batches, q01, q99, args.sampler, negative, on_sample=keep)
    report = {
        "source": source,
        "shards": str(args.shards),
        "embodiment": index.manifest.embodiment,
        "samples": int(errors.counts[1].max()),
        "action_dims": len(q01),
        "sampler": asdict(args.sampler),
        "guided": negative is not None and args.sampler.cfg_scale != 1.0,
        **errors.report(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "open_loop.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.plot_samples and shown:
        pred, target = (torch.cat(t)[: args.plot_samples, :, : len(q01)].double() for t in zip(*shown))
        plot(
            unnormalize_q99(pred, q01, q99).numpy(),
            unnormalize_q99(target, q01, q99).numpy(),
            args.out / "open_loop.png",
        )
    return report
