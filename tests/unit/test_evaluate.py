"""The evaluation flags of the trainer: a bad action-error setting stops with one line before anything runs (the
evaluation of a trained run is in tests/e2e/test_evaluate.py)."""

from __future__ import annotations


import pytest

from wampipe.errors import UsageError


@pytest.mark.parametrize("flag,value", [("action_interval", -1), ("action_samples", 0)])
def test_bad_action_flags_are_refused(flag, value):
    from wampipe.train.config import Config, MetricsConfig, validate

    with pytest.raises(UsageError, match=f"--metrics.{flag.replace('_', '-')} {value} "):
        validate(Config(metrics=MetricsConfig(**{flag: value})))
