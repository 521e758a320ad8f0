"""Episode and frame selection (preprocess.selection): DreamZero's DROID filters re-stated from the official code and
compared with what the build keeps, the cut episodes as every stage sees them, and bad filter inputs in one line.

The sample data is the raw DROID layout of devtools/sample_data.py (`raw_plan`): idle stretches with openpi-style
keep ranges, a failed episode, repeated, missing and one-character instructions, an idle-only episode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.helpers import shards_cmd
from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.preprocess.selection import Filters, parse_ids, read_keep_ranges, select, show_ids
from wampipe.preprocess.windows import episode_windows
from wampipe.shardformat.embodiments import get_embodiment

DROID_KEY = "{recording_folderpath}--{file_path}"
LANGUAGE_KEYS = ("language_instruction", "language_instruction_2", "language_instruction_3")


@pytest.fixture(scope="module")
def raw_root(tmp_path_factory) -> Path:
    from devtools.sample_data import write_sample_dataset

    return write_sample_dataset(tmp_path_factory.mktemp("raw") / "droid", "droid-raw", episodes=8)


@pytest.fixture(scope="module")
def ranges_file(raw_root) -> Path:
    from devtools.sample_data import keep_ranges_path

    return keep_ranges_path(raw_root)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def official_selection(root: Path, ranges_file: Path, filter_failed: bool = True) -> dict[int, list]:
    """DreamZero's first pass over DROID (dreamzero0/dreamzero scripts/data/convert_droid.py:448-497), re-stated over
    the LeRobot files read directly: every episode in read order; with --filter-failed an episode whose rewards are
    all zero is filtered; each of the three instructions at step 0 registers in one run-wide table, seeded with "not
    provided", when it is longer than one character and not yet in it, and an episode none of whose instructions
    registered is filtered (the check runs on filtered episodes too); the keep ranges are looked up by
    f"{recording_folderpath}--{file_path}" (a missing key raises) and an empty list filters the episode. Returns the
    kept episodes' ranges, in read order."""
    tasks = {row["task_index"]: row["task"] for row in jsonl(root / "meta/tasks.jsonl")}
    all_tasks = {"not provided": 0}
    all_keep_ranges = json.loads(ranges_file.read_text())
    kept = {}
    for row in jsonl(root / "meta/episodes.jsonl"):
        table = pq.read_table(root / f"data/chunk-000/episode_{row['episode_index']:06d}.parquet")
        filtered = False
        if filter_failed and not np.any(table.column("next.reward").to_numpy() != 0):
            filtered = True
        has_lang = False
        for lang_key in LANGUAGE_KEYS:
            task = tasks[table.column(f"annotation.language.{lang_key}")[0].as_py()]
            if task and len(task) > 1 and task not in all_tasks:
                has_lang = True
                all_tasks[task] = len(all_tasks)
        if not has_lang:
            filtered = True
        keep_ranges = all_keep_ranges[f"{row['recording_folderpath']}--{row['file_path']}"]
        if len(keep_ranges) == 0:
            filtered = True
        if not filtered:
            kept[row["episode_index"]] = keep_ranges
    return kept


def official_rows(ranges) -> np.ndarray:
    """The rows a kept episode keeps (convert_droid.py:253-257, 294-313): each [start, end) slice, concatenated."""
    return np.concatenate([np.arange(start, end) for start, end in ranges])


def official(ranges_file: Path, **overrides) -> Filters:
    return Filters(
        **{
            "keep_ranges": str(ranges_file),
            "keep_ranges_key": DROID_KEY,
            "drop_failed": True,
            "require_language": "official",
            **overrides,
        }
    )


def chosen(root: Path, filters: Filters, episodes: list[int] | None = None):
    ds = LeRobotDataset(root)
    return select(ds, filters, ds.episode_indices if episodes is None else episodes, workers=1)


# ---------------------------------------------------------------- the official rule


def test_the_official_filters_keep_what_dreamzero_keeps(raw_root, ranges_file):
    expected = official_selection(raw_root, ranges_file)
    selection = chosen(raw_root, official(ranges_file))
    assert {e: [list(r) for r in ranges or ()] for e, ranges in selection.kept.items()} == expected
    assert list(expected) == [0, 5, 7]  # the sample's cases all occur
    # episode 6's only instruction was registered by the failed episode 1: the official rule drops it
    assert selection.dropped == {1: "failed", 2: "language", 3: "language", 4: "no_ranges", 6: "language"}
    lengths = {e: LeRobotDataset(raw_root).episode_info(e).length for e in range(8)}
    kept_rows = sum(len(official_rows(r)) for r in expected.values())
    assert selection.counts == {
        "episodes": {"in": 8, "kept": 3, "dropped": {"failed": 1, "language": 3, "no_ranges": 1}},
        "frames": {
            "in": sum(lengths.values()),
            "kept": kept_rows,
            "cut": sum(lengths[e] for e in expected) - kept_rows,
            "dropped": {
                "failed": lengths[1],
                "language": lengths[2] + lengths[3] + lengths[6],
                "no_ranges": lengths[4],
            },
        },
    }


def test_without_failed_filter_the_failed_episode_is_kept_and_its_instructions_still_count_once(raw_root, ranges_file):
    expected = official_selection(raw_root, ranges_file, filter_failed=False)
    selection = chosen(raw_root, official(ranges_file, drop_failed=False))
    assert list(selection.kept) == list(expected) == [0, 1, 5, 7]


def test_language_any_keeps_repeated_instructions_but_not_missing_ones(raw_root):
    selection = chosen(raw_root, Filters(require_language="any"))
    assert selection.dropped == {3: "language"}  # "not provided" and "x" only
    assert all(cut is None for cut in selection.kept.values())  # no keep ranges: whole episodes


def test_a_success_field_of_meta_episodes_decides_failure(raw_root):
    selection = chosen(raw_root, Filters(drop_failed=True, reward_field="success"))
    assert selection.dropped == {1: "failed"}


def test_episode_lists_and_minimum_length(raw_root, ranges_file, tmp_path):
    listing = tmp_path / "ids.txt"
    listing.write_text("# the moving ones\n0, 5\n6-7\n")
    selection = chosen(
        raw_root,
        official(ranges_file, episodes=parse_ids(str(listing), "--episodes"), exclude_episodes=(7,), min_length=121),
    )
    # 5 keeps 140 rows, 0 keeps 120: under the minimum; the first reason that applies is the one recorded
    assert selection.kept == {5: ((12, 72), (102, 182))}
    assert selection.dropped == {
        0: "short",
        1: "not_listed",
        2: "not_listed",
        3: "not_listed",
        4: "not_listed",
        6: "language",
        7: "excluded",
    }
    assert show_ids(parse_ids("7,3,4,5,10-12", "--episodes")) == "3-5,7,10-12"


# ---------------------------------------------------------------- the cut episode, as every stage sees it


def test_a_cut_episode_is_the_concatenation_of_its_ranges(raw_root, ranges_file):
    kept = chosen(raw_root, official(ranges_file)).kept
    whole, cut = LeRobotDataset(raw_root), LeRobotDataset(raw_root, kept)
    assert cut.episode_indices == [0, 5, 7] and len(cut) == 3
    rows = official_rows(kept[5])
    full = whole.episode(5, ["observation.state"], cameras=True)
    part = cut.episode(5, ["observation.state"], cameras=True)
    assert part.length == cut.length(5) == len(rows) == 140
    np.testing.assert_array_equal(part.columns["observation.state"], full.columns["observation.state"][rows])
    assert part.instructions == full.instructions
    # a window across the seam (kept row 59 is recorded row 71, kept row 60 recorded row 102): frames skip the idle
    # stretch
    pattern = get_embodiment("oxe_droid").window
    window = next(w for w in episode_windows(part.length, pattern) if w.video_rows[0] < 60 < w.video_rows[-1])
    camera = "exterior_image_1_left"
    np.testing.assert_array_equal(
        part.cameras[camera].read(window.video_rows), full.cameras[camera].read(rows[window.video_rows])
    )
    assert {69, 102} <= set(rows[window.video_rows]) and not set(range(72, 102)) & set(rows[window.video_rows])


# ---------------------------------------------------------------- bad filter inputs: one line each


def write(tmp_path: Path, content) -> Path:
    path = tmp_path / "ranges.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize(
    "content, says",
    [
        ("{not json", "unreadable keep-ranges JSON"),
        ([[0, 10]], "a JSON list, not an object"),
        ({"a--b": [[0, 10], [5, 20]]}, "entry 'a--b': range [5, 20) overlaps or precedes the one before it"),
        ({"a--b": [[10, 10]]}, "entry 'a--b': range [10, 10) is empty or negative"),
        ({"a--b": [[0, "9"]]}, "entry 'a--b': [[0, \"9\"]] is not a list of [start, end] row ranges"),
        ({"a--b": {"0": 9}}, "entry 'a--b': {\"0\": 9} is not a list"),
    ],
)
def test_a_malformed_keep_ranges_file_is_one_line_naming_file_and_entry(tmp_path, content, says):
    path = write(tmp_path, content)
    with pytest.raises(DatasetError) as err:
        read_keep_ranges(path)
    assert str(err.value).startswith(f"{path}: ") and says in str(err.value) and "\n" not in str(err.value)


def test_keep_ranges_that_do_not_fit_the_dataset_are_refused(raw_root, ranges_file, tmp_path):
    good = json.loads(ranges_file.read_text())
    key = next(iter(good))
    past = write(tmp_path, {**good, key: [[0, 10_000]]})
    with pytest.raises(
        DatasetError,
        match=rf"^{past}: entry '{key}': range \[0, 10000\) reaches past the 130 rows "
        rf"of episode 0$",
    ):
        chosen(raw_root, official(past))
    extra = write(tmp_path, {**good, "gs://elsewhere--trajectory.h5": [[0, 10]]})
    with pytest.raises(DatasetError, match=rf"^{extra}: entry 'gs://elsewhere--trajectory.h5' names no episode"):
        chosen(raw_root, official(extra))
    with pytest.raises(DatasetError, match="no episode's key is in the file"):
        chosen(raw_root, official(ranges_file, keep_ranges_key="{episode_index}"))
    # a trial over the first episodes may use a file of the whole dataset
    assert list(chosen(raw_root, official(ranges_file), episodes=[0, 1, 2]).kept) == [0]


def test_a_key_field_the_dataset_lacks_is_one_line(raw_root, ranges_file):
    with pytest.raises(DatasetError, match="--keep-ranges-key: no field 'uuid' in meta/episodes or the parquet"):
        chosen(raw_root, official(ranges_file, keep_ranges_key="{uuid}"))
    with pytest.raises(DatasetError, match="--reward-field: no field 'reward' in meta/episodes"):
        chosen(raw_root, Filters(drop_failed=True, reward_field="reward"))


def test_bad_filter_flags_stop_the_build_in_one_line_before_any_unit(raw_root, ranges_file, tiny_checkpoints, tmp_path):
    """The CLI's entry point, in this process: each case stops before any unit with its one line."""
    from wampipe.preprocess.__main__ import main

    good = json.loads(ranges_file.read_text())
    key = next(iter(good))
    overlapping = write(tmp_path, {**good, key: [[0, 50], [40, 90]]})
    cases = {
        ("--official-filters",): "--official-filters: also give --keep-ranges",
        (
            "--official-filters",
            "--keep-ranges",
            str(overlapping),
        ): f"{overlapping}: entry '{key}': range [40, 90) overlaps or precedes the one before it",
        ("--episodes", "3,x"): "--episodes 3,x: 'x' is not an episode id or a range like 10-19",
        ("--keep-ranges", str(ranges_file), "--keep-ranges-key", "{0}"): "--keep-ranges-key '{0}': give fields",
    }
    for flags, says in cases.items():
        out = tmp_path / "out"
        with pytest.raises(SystemExit) as stop:
            main(shards_cmd(raw_root, out, "droid", tiny_checkpoints, *flags)[3:])  # drop `python -m preprocess`
        assert isinstance(stop.value.code, str) and stop.value.code.startswith(says), (flags, stop.value.code)
        assert not (out / "work").exists(), flags
