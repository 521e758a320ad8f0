"""Curves of a run's metrics.jsonl (train/evaluation/curves.py, scripts/plot_metrics.py): one PNG with the four panels,
resumed steps de-duplicated."""

import json

import pytest
from PIL import Image

from wampipe.errors import UsageError
from wampipe.train.evaluation.curves import panels_of, plot_run, read_metrics
from tests.helpers import metrics_row


@pytest.fixture(scope="session", autouse=True)
def font_cache():
    """matplotlib lists the system fonts with fc-list the first time it draws on a machine; that process is the
    library's setup, not the code under test, so it runs as session setup, which the no-process checks leave out."""
    from matplotlib import font_manager

    font_manager.findfont("DejaVu Sans")


def test_missing_or_broken_metrics_name_the_file(tmp_path):
    with pytest.raises(UsageError, match="metrics.jsonl: missing"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\n{"step": 2, "lo\n')
    with pytest.raises(UsageError, match=r"metrics.jsonl:2: not a JSON row"):
        plot_run(tmp_path)


def read_rows(rows: list[dict], tmp_path) -> list[dict]:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_metrics(tmp_path / "metrics.jsonl")


def test_the_validation_loss_and_the_action_error_get_their_panels(tmp_path):
    rows = [
        metrics_row(s, 1.0) | {"loss/a": 1.0, "loss/b": 2.0, "samples_seen/a": s, "samples_seen/b": s} for s in (1, 2)
    ]
    rows[1] |= {"val_loss": 1.5, "val_loss/a": 1.4, "val_loss/b": 1.6}  # train/validate.py, on its steps
    fields = {title: f for title, f, _ in panels_of(rows)}
    assert "val_loss" in fields["loss"] and {"val_loss/a", "val_loss/b"} <= set(fields["loss per set"])
    assert "open-loop action MSE (normalised)" not in fields  # logged by no row
    rows.append({"step": 2, "action_mse/a": 0.3, "action_mse_raw/a": 0.02})  # the action error's own row (5 panels)
    fields = {title: f for title, f, _ in panels_of(read_rows(rows, tmp_path))}
    assert fields["open-loop action MSE (normalised)"] == ("action_mse/a",)
    assert fields["open-loop action MSE (raw units)"] == ("action_mse_raw/a",)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with Image.open(plot_run(tmp_path)) as image:
        assert image.format == "PNG"
