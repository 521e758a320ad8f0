"""Sample keys: `<dataset>-e<episode:06d>-s<window start:05d>-v<variant>`.

Keys are dot-free, so WebDataset (and wids) split a member name `key.latents.npy` at its first dot. The variants of
one window share the key up to `-v`: that prefix is the window's name.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_KEY = re.compile(r"(?P<dataset>[A-Za-z0-9_]+)-e(?P<episode>\d{6,})-s(?P<start>\d{5,})-v(?P<variant>\d+)")


class SampleKey(NamedTuple):
    dataset: str
    episode: int
    start: int
    variant: int


def sample_key(dataset: str, episode: int, start: int, variant: int) -> str:
    key = f"{dataset}-e{episode:06d}-s{start:05d}-v{variant}"
    parse_key(key)  # a dataset name with '.', '-' or '/' would break the member-name split
    return key


def parse_key(key: str) -> SampleKey:
    match = _KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"sample key {key!r} is not <dataset>-e<episode:06d>-s<start:05d>-v<variant>")
    return SampleKey(match["dataset"], int(match["episode"]), int(match["start"]), int(match["variant"]))


def window_name(key: str) -> str:
    """`droid-e000012-s00034-v1` -> `droid-e000012-s00034`."""
    parse_key(key)
    return key.rpartition("-v")[0]
