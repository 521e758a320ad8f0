"""Which episodes of a LeRobot dataset a build uses, and which rows of each: DreamZero's DROID filters
(docs/REFERENCE.md#1-source-datasets) and a user's own episode lists.

The selection runs once per build, before any unit, over the episodes the build considers (the dataset's, or its
first --max-episodes) in index order. An episode left out is left out for one reason, the first of REASONS that
applies; keep ranges cut a kept episode to its listed rows, concatenated in order, and every later stage (windows,
statistics, preview) sees the shortened episode, as DreamZero's converted dataset holds it. The language rule is
the official one over the whole read order: an instruction counts only the first time any episode shows it,
whether that episode is kept or not.

The result names episodes, never samples (a few MB for all of DROID): `OUT/work/selection.json`, written before the
units and checked against the sha256 the build spec carries by every process that reads it.
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Literal, Mapping

import numpy as np
from tqdm import tqdm

from wampipe.errors import WampipeError
from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.lerobot import LeRobotDataset, Ranges
from wampipe.shardformat.files import atomic_write_bytes, canonical_json
from wampipe.shardformat.layout import SELECTION

if TYPE_CHECKING:
    from wampipe.preprocess.spec import BuildSpec

LANGUAGE = ("official", "any", "off")
NOT_PROVIDED = "not provided"  # what DreamZero's conversion writes for a missing instruction (tasks.jsonl index 0)
# Why an episode is left out, in the order they are tested: the first that applies is the one recorded.
REASONS = {
    "unreadable": "its files cannot be read",
    "not_listed": "not in --episodes",
    "excluded": "in --exclude-episodes",
    "failed": "failed: its reward is zero at every row (--drop-failed)",
    "language": "no instruction that counts (--require-language)",
    "no_ranges": "no keep ranges (--keep-ranges)",
    "short": "shorter than --min-length after the cut",
}
MAX_RANGES_BYTES = 1 << 30  # far above DROID's file (all 92k episodes); refused before parsing above it
MAX_IDS_BYTES = 1 << 26


@dataclass(frozen=True)
class Filters:
    """The selection flags of preprocess.shards.Args, resolved (their help says what each does)."""

    keep_ranges: str | None = None
    keep_ranges_key: str = "{episode_index}"
    drop_failed: bool = False
    reward_field: str = "next.reward"
    require_language: Literal["official", "any", "off"] = "off"
    episodes: tuple[int, ...] | None = None
    exclude_episodes: tuple[int, ...] = ()
    min_length: int | None = None

    @property
    def active(self) -> bool:
        return (
            self.keep_ranges is not None
            or self.drop_failed
            or self.require_language != "off"
            or self.episodes is not None
            or bool(self.exclude_episodes)
            or self.min_length is not None
        )


# ---------------------------------------------------------------- flags


def parse_ids(value: str, flag: str) -> tuple[int, ...]:
    """Episode ids of `--episodes` / `--exclude-episodes`: a comma list with ranges (3,10-19) or, when the value is
    a file, the ids it holds (separated by commas, spaces or newlines; `#` starts a comment)."""
    text, where = value, f"{flag} {value}"
    if not set(value) <= set("0123456789,- ") and Path(value).is_file():
        path = Path(value)
        if path.stat().st_size > MAX_IDS_BYTES:
            raise DatasetError(path, None, f"{flag}: more than {MAX_IDS_BYTES} bytes, not a list of episode ids")
        try:
            text = " ".join(line.split("#")[0] for line in path.read_text().splitlines())
        except (OSError, UnicodeDecodeError) as err:
            raise DatasetError(path, None, f"{flag}: unreadable: {err}") from None
        where = f"{flag} {path}"
    ids: set[int] = set()
    for part in text.replace(",", " ").split():
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise WampipeError(f"{where}: {part!r} is not an episode id or a range like 10-19")
        ids.update(range(int(first), int(last if dash else first) + 1))
    if not ids:
        raise WampipeError(f"{where}: names no episode")
    return tuple(sorted(ids))


def show_ids(ids: Iterable[int]) -> str:
    """Ids as the shortest comma list with ranges (0-3,7): the form a build records."""
    parts, run = [], []
    for i in sorted(ids):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def key_fields(template: str) -> list[str]:
    """The field names of a --keep-ranges-key format string; one line when it is not one."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise WampipeError(f"--keep-ranges-key {template!r}: not a format string ({err})") from None
    # named fields only, each a whole value: no positional {0}, no attribute or index
    if not names or any(not n or n.isdigit() or "." in n or "[" in n for n in names):
        raise WampipeError(
            f"--keep-ranges-key {template!r}: give fields in braces, like {{episode_index}} or "
            f"{{recording_folderpath}}--{{file_path}}"
        )
    return names


# ---------------------------------------------------------------- the keep-ranges file


def read_keep_ranges(path: str | Path) -> dict[str, tuple[tuple[int, int], ...]]:
    """The keep-ranges file: a JSON object from episode key to a list of [start, end) row ranges, ascending and
    disjoint (an empty list is allowed: it leaves the episode out). One line naming the file and entry otherwise."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_RANGES_BYTES:
            raise DatasetError(path, None, f"more than {MAX_RANGES_BYTES} bytes: not a keep-ranges file")
        raw = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise DatasetError(path, None, f"unreadable keep-ranges JSON: {err}") from None
    if not isinstance(raw, dict):
        raise DatasetError(
            path, None, f"a JSON {type(raw).__name__}, not an object from episode key to [[start, end], ...] row ranges"
        )
    out = {}
    for key, ranges in raw.items():
        out[key] = _ranges(ranges, path, key)
    return out


def _ranges(ranges, path: Path, key: str) -> tuple[tuple[int, int], ...]:
    def whole(v) -> bool:
        return type(v) is int

    if not isinstance(ranges, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(map(whole, r)) for r in ranges
    ):
        raise DatasetError(path, None, f"entry {key!r}: {_short(ranges)} is not a list of [start, end] row ranges")
    previous_end = 0
    for start, end in ranges:
        if start < 0 or end <= start:
            raise DatasetError(path, None, f"entry {key!r}: range [{start}, {end}) is empty or negative")
        if start < previous_end:
            raise DatasetError(
                path,
                None,
                f"entry {key!r}: range [{start}, {end}) overlaps or precedes the one "
                f"before it (ranges must be ascending and disjoint)",
            )
        previous_end = end
    return tuple((start, end) for start, end in ranges)


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- what each episode says


@dataclass(frozen=True)
class Facts:
    """What the filters need of one recorded episode (None: not needed, or unreadable)."""

    length: int
    key: str | None = None
    failed: bool | None = None
    instructions: tuple[str, ...] = ()
    error: str | None = None


def needs_parquet(ds: LeRobotDataset, filters: Filters) -> list[str]:
    """The parquet columns the filters read (a field of meta/episodes is read from there). One line for a field that
    is in neither meta/episodes nor the parquet's features."""
    some = ds.episode_info(ds.episode_indices[0]).fields if len(ds) else {}
    columns, wanted = [], []
    if filters.keep_ranges is not None:
        wanted += [f for f in key_fields(filters.keep_ranges_key) if f != "episode_index"]
    if filters.drop_failed:
        wanted.append(filters.reward_field)
    for name in dict.fromkeys(wanted):
        if name in some:
            continue
        if name in ds.features:
            columns.append(name)
        else:
            flag = "--reward-field" if name == filters.reward_field and filters.drop_failed else "--keep-ranges-key"
            raise DatasetError(
                ds.root / "meta",
                None,
                f"{flag}: no field {name!r} in meta/episodes or the parquet features of this dataset",
            )
    return columns


def read_facts(root: str, filters: Filters, episodes: list[int]) -> list[Facts]:
    """Facts of `episodes` of the dataset at `root` (a task of tasks.run_tasks, which opens the dataset's meta/ once
    per task)."""
    ds = LeRobotDataset(root)
    return facts_of(ds, filters, episodes, needs_parquet(ds, filters))


def facts_of(ds: LeRobotDataset, filters: Filters, episodes: Iterable[int], columns: list[str]) -> list[Facts]:
    """Facts of `episodes` of `ds`, reading `columns` (needs_parquet) of each when the filters need any row."""
    read_rows = bool(columns) or filters.require_language != "off"
    return [_facts(ds, filters, index, columns, read_rows) for index in episodes]


def _facts(ds: LeRobotDataset, filters: Filters, index: int, columns: list[str], read_rows: bool) -> Facts:
    info = ds.episode_info(index)
    try:
        episode = ds.episode(index, columns, cameras=False) if read_rows else None
    except DatasetError as err:
        return Facts(info.length, error=str(err))
    values = {**({c: episode.columns[c] for c in columns} if episode else {}), **info.fields, "episode_index": index}
    names = key_fields(filters.keep_ranges_key) if filters.keep_ranges is not None else []
    absent = [n for n in [*names, *[filters.reward_field] * filters.drop_failed] if n not in values]
    if absent:
        return Facts(
            info.length,
            error=str(
                DatasetError(info.data_path, index, f"no field {absent[0]!r} in its meta/episodes row or parquet")
            ),
        )
    key = filters.keep_ranges_key.format_map({n: _first(values[n]) for n in names}) if names else None
    failed = None
    if filters.drop_failed:
        reward = np.asarray(values[filters.reward_field])
        if reward.dtype.kind not in "biuf":
            return Facts(
                info.length,
                error=str(
                    DatasetError(
                        info.data_path,
                        index,
                        f"--reward-field {filters.reward_field!r} holds {reward.dtype} values, not numbers or bools",
                    )
                ),
            )
        failed = not bool(np.any(reward != 0))  # the official test, over every row before any cut
    instructions = tuple(episode.instructions.values()) if episode and filters.require_language != "off" else ()
    return Facts(info.length, key, failed, instructions)


def _first(value) -> str:
    """A key field as the official conversion formats it: the string at the episode's first row."""
    if isinstance(value, np.ndarray):
        value = value.reshape(len(value), -1)[0, 0] if len(value) else ""
    return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------- the selection


@dataclass
class Selection:
    """Kept episodes (index -> keep ranges, None = whole), left-out ones (index -> reason of REASONS, with the error
    of an unreadable one) and the counts."""

    kept: dict[int, Ranges | None]
    dropped: dict[int, str]
    errors: dict[int, str] = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    filters: dict = field(default_factory=dict)  # as the manifest states them

    def to_bytes(self) -> bytes:
        return canonical_json(
            {
                "filters": self.filters,
                "counts": self.counts,
                "kept": [[e, None if r is None else [list(x) for x in r]] for e, r in self.kept.items()],
                "dropped": [[e, reason] for e, reason in self.dropped.items()],
                "errors": [[e, text] for e, text in self.errors.items()],
            }
        )

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes) -> Selection:
        raw = json.loads(data)
        return cls(
            {e: None if r is None else tuple(tuple(x) for x in r) for e, r in raw["kept"]},
            {e: reason for e, reason in raw["dropped"]},
            {e: text for e, text in raw["errors"]},
            raw["counts"],
            raw["filters"],
        )

    def summary(self) -> dict:
        """The manifest's selection block: the filters, the counts and each unreadable episode with its reason."""
        return {
            "filters": self.filters,
            "counts": self.counts,
            "unreadable": [{"episode": e, "reason": text} for e, text in self.errors.items()],
        }


def select(
    ds: LeRobotDataset,
    filters: Filters,
    episodes: list[int],
    workers: int = 1,
    sha256: dict[str, str | None] | None = None,
) -> Selection:
    """The selection of `episodes` (in index order) of `ds`: read what the filters need of each (`workers`
    processes), then apply the rules in order. `sha256`: of each file a filter read (the manifest states it)."""
    from wampipe.preprocess.tasks import auto_workers, run_tasks

    ranges = read_keep_ranges(filters.keep_ranges) if filters.keep_ranges is not None else None
    columns = needs_parquet(ds, filters)  # a missing field stops here, not in every task
    workers = auto_workers(workers, len(episodes) // 32)  # auto: one process per ~1 000 episodes (at most 8)
    if workers <= 1:  # here, with the dataset already open
        facts = facts_of(ds, filters, tqdm(episodes, desc="selecting episodes", unit="episode"), columns)
    else:  # a few tasks per process: each task opens the dataset's meta/ again
        size = -(-len(episodes) // (4 * workers))
        chunks = [episodes[i : i + size] for i in range(0, len(episodes), size)]
        results = dict(
            run_tasks(read_facts, [(str(ds.root), filters, chunk) for chunk in chunks], workers, "selecting episodes")
        )
        facts = [fact for i in range(len(chunks)) for fact in results[i]]
    by_episode = dict(zip(episodes, facts))
    if ranges is not None:
        assert filters.keep_ranges is not None
        check_ranges(Path(filters.keep_ranges), ranges, by_episode, whole_dataset=len(episodes) == len(ds))
    kept, dropped, errors = {}, {}, {}
    listed = None if filters.episodes is None else set(filters.episodes)
    excluded = set(filters.exclude_episodes)
    counted = _language(by_episode, filters.require_language)
    for index, fact in by_episode.items():
        cut = None if ranges is None or fact.key is None else ranges.get(fact.key, ())
        length = fact.length if cut is None else sum(end - start for start, end in cut)
        reason = next(
            (
                r
                for r, applies in (
                    ("unreadable", fact.error is not None),
                    ("not_listed", listed is not None and index not in listed),
                    ("excluded", index in excluded),
                    ("failed", bool(fact.failed)),
                    ("language", not counted.get(index, True)),
                    ("no_ranges", cut == ()),
                    ("short", filters.min_length is not None and length < filters.min_length),
                )
                if applies
            ),
            None,
        )
        if reason is None:
            kept[index] = cut
        else:
            dropped[index] = reason
            if fact.error is not None:
                errors[index] = fact.error
    return Selection(kept, dropped, errors, _counts(by_episode, kept, dropped), _stated(filters, sha256 or {}))


def _language(facts: dict[int, Facts], rule: str) -> dict[int, bool]:
    """Whether each episode has an instruction that counts. official: a string longer than one character not seen
    in any earlier episode (the set starts with "not provided"; every episode adds its strings, kept or not, as
    convert_droid.py's first pass); any: a string longer than one character other than "not provided"."""
    if rule == "off":
        return {}
    seen, out = {NOT_PROVIDED}, {}
    for index, fact in facts.items():
        if fact.error is not None:
            continue
        strings = [s for s in fact.instructions if s and len(s) > 1]
        if rule == "any":
            out[index] = any(s != NOT_PROVIDED for s in strings)
            continue
        new = [s for s in strings if s not in seen]
        seen.update(new)
        out[index] = bool(new)
    return out


def check_ranges(path: Path, ranges: Mapping[str, Ranges], facts: dict[int, Facts], whole_dataset: bool) -> None:
    """The keep-ranges file fits the dataset: its ranges end inside their episodes, some episode's key is in it and
    (when every episode is considered) every key it names is an episode's. One line naming the file and entry."""
    keys = {fact.key: index for index, fact in facts.items() if fact.key is not None}
    for key, index in keys.items():
        for start, end in ranges.get(key, ()):
            if end > facts[index].length:
                raise DatasetError(
                    path,
                    None,
                    f"entry {key!r}: range [{start}, {end}) reaches past the "
                    f"{facts[index].length} rows of episode {index}",
                )
    if keys and not keys.keys() & ranges.keys():
        example = next(iter(ranges), "(none)")
        raise DatasetError(
            path,
            None,
            f"no episode's key is in the file: this dataset's keys look like "
            f"{next(iter(keys))!r}, the file's like {example!r} (--keep-ranges-key)",
        )
    if whole_dataset:
        absent = [k for k in ranges if k not in keys]
        if absent:
            raise DatasetError(
                path,
                None,
                f"entry {absent[0]!r} names no episode of the dataset"
                f"{f' ({len(absent)} entries do not)' if len(absent) > 1 else ''}: "
                f"a file for another dataset, or another --keep-ranges-key",
            )


def _counts(facts: dict[int, Facts], kept: dict[int, Ranges | None], dropped: dict[int, str]) -> dict:
    def rows(index: int) -> int:
        cut = kept[index]
        return facts[index].length if cut is None else sum(end - start for start, end in cut)

    by_reason = {r: [e for e, why in dropped.items() if why == r] for r in REASONS}
    kept_rows = sum(rows(e) for e in kept)
    return {
        "episodes": {"in": len(facts), "kept": len(kept), "dropped": {r: len(es) for r, es in by_reason.items() if es}},
        "frames": {
            "in": sum(f.length for f in facts.values()),
            "kept": kept_rows,
            "cut": sum(facts[e].length for e in kept) - kept_rows,
            "dropped": {r: sum(facts[e].length for e in es) for r, es in by_reason.items() if es},
        },
    }


def _stated(filters: Filters, sha256: dict[str, str | None]) -> dict:
    out: dict = {}
    if filters.keep_ranges is not None:
        out["keep_ranges"] = {
            "path": filters.keep_ranges,
            "sha256": sha256.get("keep_ranges"),
            "key": filters.keep_ranges_key,
        }
    if filters.drop_failed:
        out["drop_failed"] = {"reward_field": filters.reward_field}
    if filters.require_language != "off":
        out["require_language"] = filters.require_language
    if filters.episodes is not None:
        out["episodes"] = show_ids(filters.episodes)
    if filters.exclude_episodes:
        out["exclude_episodes"] = show_ids(filters.exclude_episodes)
    if filters.min_length is not None:
        out["min_length"] = filters.min_length
    return out


# ---------------------------------------------------------------- the build's copy


def write_selection(out: Path, selection: Selection) -> None:
    path = out / SELECTION
    data = selection.to_bytes()
    if not path.is_file() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)


@lru_cache(maxsize=2)
def read_selection(out: str, sha256: str) -> Selection:
    """The build's selection, refused in one line unless it is the one the spec was made with."""
    path = Path(out) / SELECTION
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DatasetError(path, None, f"the build's episode selection is unreadable: {err}") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise DatasetError(
            path,
            None,
            "sha256 differs from the one this run selected (edited, or written by "
            "another run): run the same command again to write it anew",
        )
    return Selection.from_bytes(data)


def source(spec: BuildSpec) -> LeRobotDataset:
    """The build's source dataset as its units and statistics see it: narrowed to the selection, if any."""
    if spec.selection is None:
        return LeRobotDataset(spec.src)
    return LeRobotDataset(spec.src, kept=read_selection(spec.out, spec.selection).kept)
