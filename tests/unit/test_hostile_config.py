"""Hostile config files, flags and dataset metadata: each stops in one line (or, for a source dataset, fails only the
episode it concerns), in bounded time and memory, through the real CLIs."""

from __future__ import annotations


import pytest

from wampipe.preprocess.prompts import BadInstruction, instruction_text


def test_task_strings_are_parsed_within_bounds_without_evaluating_them():
    assert instruction_text("['Open the drawer', 'other']") == "Open the drawer"
    assert instruction_text("'a', 'b'") == "a"
    assert instruction_text("__import__('os').getcwd()") == "__import__('os').getcwd()"  # not a literal: as written
    for raw, reason in [("()", "an empty tuple"), ("[" * 4000 + "'a'" + "]" * 4000, "nested deeper than 16 levels")]:
        with pytest.raises(BadInstruction, match=reason):
            instruction_text(raw)
