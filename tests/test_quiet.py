"""A quiet start: the command-line tools print nothing on stderr that the user did not cause (no library-load
failures, deprecation warnings or import notices of libraries), in `--help` and in a real build; and `--help` gives
every flag its help, flowing as sentences."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import PROJECT, ROOT, console_script

pytestmark = pytest.mark.e2e  # every test runs the tools in processes of their own

# what a build may print on stderr: tqdm's progress bars (carriage-return redrawn lines; their names may hold a
# dataset folder's, any character but a colon)
PROGRESS = re.compile(r"^[^:]*:\s+\d+%\|")
HELP_SUFFIX = re.compile(r"\s*\((default: .*|required|fixed to: .*)\)$")  # what tyro adds to a field's own help
# below 130 columns tyro lays the help boxes out in one column, whose rows `flag_help` reads
HELP_ENV = {**os.environ, "COLUMNS": "100"}


def unexpected(stderr: str) -> list[str]:
    lines = [part.strip() for line in stderr.splitlines() for part in line.split("\r")]
    return [line for line in lines if line and not PROGRESS.match(line)]


def flag_help(stdout: str) -> dict[str, list[tuple[str, int]]]:
    """Each flag row of tyro's help boxes -> its help lines, each with the room its box had for it."""
    flags, current = {}, None
    for line in stdout.splitlines():
        if not (line.startswith("│") and line.endswith("│")):
            current = None
            continue
        inner = line[2:-2]  # inside the border and its one-space padding
        text = inner.rstrip()
        indent = len(text) - len(text.lstrip())
        if indent == 0:  # a flag row (its help beside it or on the lines below), a positional or a group's text
            row = re.match(r"(-\S.*?)(?:\s{2,}(\S.*))?$", text)
            current = flags.setdefault(row.group(1), []) if row else None
            if row and row.group(2):
                assert current is not None  # the row's entry, set just above
                current.append((row.group(2), len(inner) - row.start(2)))
        elif current is not None:
            current.append((text.lstrip(), len(inner) - indent))
    return flags


def help_problems(stdout: str) -> list[str]:
    """Flags without help of their own, and help lines broken where the next word would have fit (a source line's
    end kept in the help: a sentence cut in two)."""
    found = []
    for flag, lines in flag_help(stdout).items():
        if not HELP_SUFFIX.sub("", " ".join(text for text, _ in lines)).strip():
            found.append(f"{flag}: no help")
        for (text, room), (following, _) in zip(lines, lines[1:]):
            if following and len(text) + 1 + len(following.split()[0]) < room:
                found.append(f"{flag}: a line break after {text[-30:]!r}")
    return found


def check_help(done: subprocess.CompletedProcess) -> None:
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-2000:]
    assert "--help" in done.stdout and help_problems(done.stdout) == []


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
