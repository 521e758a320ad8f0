"""`python -m train.evaluate` on a real 2-rank torchrun run (its DCP checkpoint and its eval-ready export) and the
trainer's periodic action error (--metrics.action-interval) of the same run."""

from __future__ import annotations


import pytest

from wampipe.errors import UsageError


@pytest.mark.parametrize("flag,value", [("action_interval", -1), ("action_samples", 0)])
def test_bad_action_flags_are_refused(flag, value):
    from wampipe.train.config import Config, MetricsConfig, validate

    with pytest.raises(UsageError, match=f"--metrics.{flag.replace('_', '-')} {value} "):
        validate(Config(metrics=MetricsConfig(**{flag: value})))
