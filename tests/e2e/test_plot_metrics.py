"""Curves of a run's metrics.jsonl (train/evaluation/curves.py, scripts/plot_metrics.py): one PNG with the four panels,
resumed steps de-duplicated."""

import json

import pytest
from PIL import Image

from wampipe.train.evaluation.curves import plot_run, read_metrics
from tests.helpers import metrics_row


@pytest.mark.e2e
def test_writes_a_png_and_the_resumed_run_wins(tmp_path):
    rows = [metrics_row(s, 2.0 / s) for s in range(1, 11)] + [
        metrics_row(s, 5.0) for s in (9, 10, 11)
    ]  # resumed at step 8
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in read] == list(range(1, 12))
    assert [r["loss"] for r in read[-3:]] == [5.0, 5.0, 5.0] and read[0]["loss"] == 2.0
    out = plot_run(tmp_path)
    assert out == tmp_path / "metrics.png"
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1210, 770)
