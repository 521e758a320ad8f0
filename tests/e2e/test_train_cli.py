"""The trainer's command line: `python -m train.main --help` exits 0 and gives every flag its help as flowing
sentences (the field docstrings, whose line breaks must not show), without loading torch for it."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.e2e  # every test runs the tools in processes of their own

WIDTH = 80


def flag_help(text: str) -> dict[str, list[str]]:
    """{flag: its help lines} of tyro's boxed --help: a flag line `│ --name ...│`, then its help indented below."""
    helps, flag = {}, None
    for line in text.splitlines():
        boxed = re.match(r"^│ (.*?) ?│$", line)
        inner = boxed.group(1) if boxed else ""
        if inner.startswith("-"):
            flag = inner.split()[0].rstrip(",")
            helps[flag] = []
        elif flag and inner.startswith("      "):
            helps[flag].append(inner.rstrip())
        else:
            flag = None
    return helps


def test_help_gives_every_flag_flowing_help():
    env = {**os.environ, "COLUMNS": str(WIDTH)}
    done = subprocess.run(
        [sys.executable, "-m", "train.main", "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    helps = flag_help(done.stdout)
    assert {"--steps", "--data.shards", "--parallel.global-batch-size", "--lora.rank", "--loss.shift"} <= set(helps)
    text_width = max(len(line) for line in done.stdout.splitlines() if line.startswith("│")) - 4
    for flag, lines in helps.items():
        words = re.sub(r"\(default: .*\)$", "", " ".join(line.strip() for line in lines)).split()
        assert words, f"{flag} has no help"
        # wrapped to the width only: a line the next word would still have fit on is a docstring's line break
        for line, after in zip(lines, lines[1:]):
            assert len(line) + 1 + len(after.split()[0]) > text_width, f"{flag}: a break after {line.strip()!r}"


def test_help_does_without_torch():
    code = (
        "import sys\nfrom wampipe.train.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
