"""The one error type for bad input data: it always names the file, the episode and the reason."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import TypeGuard

from wampipe.errors import WampipeError


class DatasetError(WampipeError):
    """A dataset file cannot be used. `str(err)` reads `<file>: episode <n>: <reason>`."""

    def __init__(self, path: str | Path | None, episode: int | None, reason: str):
        self.path = None if path is None else Path(path)
        self.episode = episode
        self.reason = reason
        where = [str(self.path) if self.path is not None else "<dataset>"]
        if episode is not None:
            where.append(f"episode {episode}")
        super().__init__(": ".join(where + [reason]))

    def __reduce__(self):
        # rebuilt from its parts when raised in a worker process (the default would call it with the message only)
        return DatasetError, (self.path, self.episode, self.reason)


class EncoderOutputError(WampipeError, RuntimeError):
    """The frozen encoders gave a non-finite output: the build stops in one line (every later batch would be the
    same), instead of storing NaN."""


FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a used-up quota


class OutOfSpace(WampipeError, RuntimeError):
    """The output's disk (or quota) is full. Every write is atomic, so nothing half-written counts: the same command
    run again once there is space resumes from the finished units."""

    @classmethod
    def from_os_error(cls, err: OSError, where: str = "") -> "OutOfSpace":
        place = f"{err.filename}: " if err.filename else ""
        return cls(
            f"{where}{place}{err.strerror or 'no space left on device'}: free space (or raise the quota) and "
            f"run the same command again; finished units are kept"
        )


def out_of_space(err: BaseException) -> TypeGuard[OSError]:
    return isinstance(err, OSError) and err.errno in FULL
