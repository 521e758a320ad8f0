"""A training run's curves from its metrics.jsonl: loss terms (with the validation loss where logged), learning
rate, throughput and data wait, and for a mixture each set's loss (and validation loss) and samples seen, as one PNG
(CLI: scripts/plot_metrics.py). Where a resumed run logged a step again, the later row wins."""

from __future__ import annotations

import json
from pathlib import Path

from wampipe.errors import UsageError

PANELS = (  # (title, metrics.jsonl fields, y scale)
    ("loss", ("loss", "loss_dynamics", "loss_action", "val_loss", "val_loss_dynamics", "val_loss_action"), "log"),
    ("learning rate", ("lr",), "linear"),
    ("samples/s per GPU", ("samples_per_s_per_gpu",), "linear"),
    ("data wait (% of time)", ("data_wait_pct",), "linear"),
)
# per set, by field prefix: a mixture's loss and samples seen, every run's open-loop action error
# (train/evaluation/sample.py)
SET_PANELS = (
    ("loss per set", ("loss/", "val_loss/"), "log"),
    ("samples seen per set", ("samples_seen/",), "linear"),
    ("open-loop action MSE (normalised)", ("action_mse/",), "log"),
    ("open-loop action MSE (raw units)", ("action_mse_raw/",), "log"),
)


def read_metrics(path: Path) -> list[dict]:
    """Rows of metrics.jsonl ordered by step, one per step: the rows of a step merged, a later value winning (the
    training row and the action error's are separate rows)."""
    by_step: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{path}:{n}: not a JSON row ({err.msg})") from None
        by_step[int(row["step"])] = by_step.get(int(row["step"]), {}) | row
    return [by_step[s] for s in sorted(by_step)]


def panels_of(rows: list[dict]) -> tuple:
    """(title, fields, y scale) of each panel: PANELS, then those of SET_PANELS with fields logged."""
    per_set = [
        (name, tuple(sorted({f for r in rows for f in r if f.startswith(prefixes)})), scale)
        for name, prefixes, scale in SET_PANELS
    ]
    return PANELS + tuple(panel for panel in per_set if panel[1])


def plot(rows: list[dict], out: Path, title: str) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("plotting curves needs matplotlib: pip install 'wampipe[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    panels = panels_of(rows)
    rows_of_panels = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows_of_panels, 2, figsize=(11, 3.5 * rows_of_panels), sharex=True, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (name, fields, scale) in zip(axes.flat, panels):
        for field in fields:
            points = [(r["step"], r[field]) for r in rows if field in r]
            if points:
                ax.plot(*zip(*points), label=field, marker="." if len(points) < 50 else None)
        ax.set_title(name)
        ax.set_yscale(scale if all(r.get(f, 1) > 0 for r in rows for f in fields) else "linear")
        ax.grid(alpha=0.3)
        if len(fields) > 1:
            ax.legend()
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """RUN_DIR/metrics.jsonl -> `out` (default RUN_DIR/metrics.png); a missing or empty file stops with one line."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{path}: missing (is {run_dir} a training run directory?)")
    rows = read_metrics(path)
    if not rows:
        raise UsageError(f"{path}: no rows yet (the trainer logs every --metrics.interval steps)")
    return plot(rows, out or run_dir / "metrics.png", f"{run_dir} ({len(rows)} logged steps)")
