"""Curves of a run's metrics.jsonl (train/evaluation/curves.py, scripts/plot_metrics.py): one PNG with the four panels,
resumed steps de-duplicated."""

import json

import pytest
from PIL import Image

from wampipe.train.evaluation.curves import plot_run, read_metrics


def _row(step: int, loss: float) -> dict:
    # the fields train/metrics.py writes
    return {
        "step": step,
        "loss": loss,
        "loss_dynamics": 0.9 * loss,
        "loss_action": 0.1 * loss,
        "grad_norm": 1.0,
        "lr": 1e-4 * min(1, step / 4),
        "samples_per_s_per_gpu": 3.0 + step % 3,
        "data_wait_pct": 0.5,
        "time": 1.0e9 + step,
    }


@pytest.mark.e2e
def test_writes_a_png_and_the_resumed_run_wins(tmp_path):
    rows = [_row(s, 2.0 / s) for s in range(1, 11)] + [_row(s, 5.0) for s in (9, 10, 11)]  # resumed at step 8
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in read] == list(range(1, 12))
    assert [r["loss"] for r in read[-3:]] == [5.0, 5.0, 5.0] and read[0]["loss"] == 2.0
    out = plot_run(tmp_path)
    assert out == tmp_path / "metrics.png"
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1210, 770)
