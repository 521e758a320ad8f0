"""The project's one error type. `str(err)` is the whole report: one line naming the file (and episode, flag or
process) and the reason. Library code raises a subclass (a dataset's fault, a shard directory's, a weight file's, a
child process that died, a full disk, a training run's own refusal); only the entry points turn one into an exit
status, printing that line (`entry_point`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class WampipeError(Exception):
    """Base of every error the tools report in one line, without a traceback."""

    exit_status = 1
    """The status a command exits with after printing the line."""


class UsageError(WampipeError):
    """A flag, argument or file given to a command that cannot be used (a value out of range, a missing file, another
    build's directory): the message names it and says what to give instead."""


class RunError(WampipeError):
    """A training run's own refusal, which every rank raises alike once the process group is up (a checkpoint of
    another model, non-finite weights, a run directory in use, a failed save or export): the trainer's entry points
    print its line on rank 0 only and the other ranks exit with status 1 in silence (train/runtime.py `report`), so a
    run stops with one line, not one copy per rank. Without a process group (before it exists, or in
    `python -m train.evaluate`) the process prints it."""


@contextmanager
def entry_point() -> Iterator[None]:
    """A command's entry point (its `main`): a WampipeError raised inside leaves the process with its one line on
    stderr and its exit status, no traceback. At status 1 the line is the SystemExit's message (Python prints it, and
    a caller of `main` reads it as the exit's code); at another status it is printed here first."""
    try:
        yield
    except WampipeError as err:
        if err.exit_status == 1:
            raise SystemExit(str(err)) from None
        print(err, file=sys.stderr)
        raise SystemExit(err.exit_status) from None
