"""scripts/plot_metrics.py on a run's metrics.jsonl: one PNG with the four panels, resumed steps de-duplicated."""

import importlib.util
import json
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "scripts" / "plot_metrics.py")
plot_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_metrics)


def _row(step: int, loss: float) -> dict:
    # the fields train/metrics.py writes
    return {"step": step, "loss": loss, "loss_dynamics": 0.9 * loss, "loss_action": 0.1 * loss, "grad_norm": 1.0,
            "lr": 1e-4 * min(1, step / 4), "samples_per_s_per_gpu": 3.0 + step % 3, "data_wait_pct": 0.5,
            "time": 1.0e9 + step}


def test_writes_a_png_and_the_resumed_run_wins(tmp_path):
    rows = [_row(s, 2.0 / s) for s in range(1, 11)] + [_row(s, 5.0) for s in (9, 10, 11)]  # resumed at step 8
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = plot_metrics.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in read] == list(range(1, 12))
    assert [r["loss"] for r in read[-3:]] == [5.0, 5.0, 5.0] and read[0]["loss"] == 2.0
    out = plot_metrics.main([str(tmp_path)])
    assert out == tmp_path / "metrics.png"
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1210, 770)


def test_missing_or_broken_metrics_name_the_file(tmp_path):
    with pytest.raises(SystemExit, match="metrics.jsonl: missing"):
        plot_metrics.main([str(tmp_path)])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\n{"step": 2, "lo\n')
    with pytest.raises(SystemExit, match=r"metrics.jsonl:2: not a JSON row"):
        plot_metrics.main([str(tmp_path)])
