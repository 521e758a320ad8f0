"""A quiet start: the command-line tools print nothing on stderr that the user did not cause (no library-load
failures, deprecation warnings or import notices of libraries), in `--help` and in a real build."""

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# what a build may print on stderr: tqdm's progress bars (carriage-return redrawn lines)
PROGRESS = re.compile(r"^[\w ]*:\s+\d+%\|")


def unexpected(stderr: str) -> list[str]:
    lines = [part.strip() for line in stderr.splitlines() for part in line.split("\r")]
    return [line for line in lines if line and not PROGRESS.match(line)]


@pytest.mark.parametrize("argv", [
    ["-m", "preprocess", "--help"],
    *[["-m", "preprocess", command, "--help"] for command in ("shards", "check", "stats", "inspect", "preview")],
    ["train/main.py", "--help"],
], ids=lambda argv: " ".join(argv[-2:]))
def test_help_prints_nothing_on_stderr(argv):
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout and unexpected(done.stderr) == []


def test_a_build_prints_only_its_progress_on_stderr(droid_shards):
    # diffusers imports torchao when installed (the dev and fp8 extras), and a torchao built for another torch
    # printed library-load failures and torch deprecation warnings in every process that loaded the VAE
    assert unexpected((droid_shards.parent / "build-stderr.txt").read_text()) == []
