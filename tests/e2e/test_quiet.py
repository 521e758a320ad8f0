"""A quiet start: the command-line tools print nothing on stderr that the user did not cause (no library-load
failures, deprecation warnings or import notices of libraries), in `--help` and in a real build; and `--help` gives
every flag its help, flowing as sentences."""

import subprocess
import sys

import pytest

from tests.helpers import HELP_ENV, PROJECT, ROOT, check_help, console_script, unexpected

pytestmark = pytest.mark.e2e  # every test runs the tools in processes of their own


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "preprocess", "--help"],
        *[["-m", "preprocess", command, "--help"] for command in ("shards", "check", "stats", "inspect", "preview")],
        ["train/main.py", "--help"],
        # every console script but wampipe-train, whose help is torchrun's and then train/main.py's
        *[["-c", console_script(name), "--help"] for name in PROJECT["scripts"] if name != "wampipe-train"],
    ],
    ids=lambda argv: " ".join(argv[-2:]) if argv[0] != "-c" else argv[1].split("'")[1],
)
def test_help_prints_every_flag_and_nothing_on_stderr(argv):
    check_help(
        subprocess.run([sys.executable, *argv], cwd=ROOT, env=HELP_ENV, capture_output=True, text=True, timeout=300)
    )


def test_a_build_prints_only_its_progress_on_stderr(droid_shards):
    # diffusers imports torchao when installed (the dev and fp8 extras), and a torchao built for another torch
    # printed library-load failures and torch deprecation warnings in every process that loaded the VAE
    assert unexpected((droid_shards.parent / "build-stderr.txt").read_text()) == []


@pytest.mark.parametrize("command", ["shards", "check", "stats", "inspect", "preview"])
def test_preprocess_help_does_not_load_torch(command):
    """`--help` stays quick: torch (a second of imports) is loaded by the commands' work, not by their flags."""
    code = (
        "import sys\nfrom wampipe.preprocess.__main__ import main\ntry:\n    main([sys.argv[1], '--help'])\n"
        "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch loaded'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, command], cwd=ROOT, env=HELP_ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
