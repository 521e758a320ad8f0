"""Episode and frame selection (preprocess.selection): DreamZero's DROID filters re-stated from the official code and
compared with what the build keeps, the cut episodes as every stage sees them, and bad filter inputs in one line.

The sample data is the raw DROID layout of devtools/sample_data.py (`raw_plan`): idle stretches with openpi-style
keep ranges, a failed episode, repeated, missing and one-character instructions, an idle-only episode."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import official_filters, official_rows, official_selection, select_episodes, shards_cmd, write_ranges
from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.lerobot import LeRobotDataset
from wampipe.preprocess.selection import Filters, parse_ids, read_keep_ranges, show_ids
from wampipe.preprocess.windows import episode_windows
from wampipe.shardformat.embodiments import get_embodiment


# ---------------------------------------------------------------- the official rule


def test_the_official_filters_keep_what_dreamzero_keeps(raw_root, ranges_file):
    expected = official_selection(raw_root, ranges_file)
    selection = select_episodes(raw_root, official_filters(ranges_file))
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
    selection = select_episodes(raw_root, official_filters(ranges_file, drop_failed=False))
    assert list(selection.kept) == list(expected) == [0, 1, 5, 7]


def test_language_any_keeps_repeated_instructions_but_not_missing_ones(raw_root):
    selection = select_episodes(raw_root, Filters(require_language="any"))
    assert selection.dropped == {3: "language"}  # "not provided" and "x" only
    assert all(cut is None for cut in selection.kept.values())  # no keep ranges: whole episodes


def test_a_success_field_of_meta_episodes_decides_failure(raw_root):
    selection = select_episodes(raw_root, Filters(drop_failed=True, reward_field="success"))
    assert selection.dropped == {1: "failed"}


def test_episode_lists_and_minimum_length(raw_root, ranges_file, tmp_path):
    listing = tmp_path / "ids.txt"
    listing.write_text("# the moving ones\n0, 5\n6-7\n")
    selection = select_episodes(
        raw_root,
        official_filters(
            ranges_file, episodes=parse_ids(str(listing), "--episodes"), exclude_episodes=(7,), min_length=121
        ),
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
    kept = select_episodes(raw_root, official_filters(ranges_file)).kept
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
    path = write_ranges(tmp_path, content)
    with pytest.raises(DatasetError) as err:
        read_keep_ranges(path)
    assert str(err.value).startswith(f"{path}: ") and says in str(err.value) and "\n" not in str(err.value)


def test_keep_ranges_that_do_not_fit_the_dataset_are_refused(raw_root, ranges_file, tmp_path):
    good = json.loads(ranges_file.read_text())
    key = next(iter(good))
    past = write_ranges(tmp_path, {**good, key: [[0, 10_000]]})
    with pytest.raises(
        DatasetError,
        match=rf"^{past}: entry '{key}': range \[0, 10000\) reaches past the 130 rows "
        rf"of episode 0$",
    ):
        select_episodes(raw_root, official_filters(past))
    extra = write_ranges(tmp_path, {**good, "gs://elsewhere--trajectory.h5": [[0, 10]]})
    with pytest.raises(DatasetError, match=rf"^{extra}: entry 'gs://elsewhere--trajectory.h5' names no episode"):
        select_episodes(raw_root, official_filters(extra))
    with pytest.raises(DatasetError, match="no episode's key is in the file"):
        select_episodes(raw_root, official_filters(ranges_file, keep_ranges_key="{episode_index}"))
    # a trial over the first episodes may use a file of the whole dataset
    assert list(select_episodes(raw_root, official_filters(ranges_file), episodes=[0, 1, 2]).kept) == [0]


def test_a_key_field_the_dataset_lacks_is_one_line(raw_root, ranges_file):
    with pytest.raises(DatasetError, match="--keep-ranges-key: no field 'uuid' in meta/episodes or the parquet"):
        select_episodes(raw_root, official_filters(ranges_file, keep_ranges_key="{uuid}"))
    with pytest.raises(DatasetError, match="--reward-field: no field 'reward' in meta/episodes"):
        select_episodes(raw_root, Filters(drop_failed=True, reward_field="reward"))


def test_bad_filter_flags_stop_the_build_in_one_line_before_any_unit(raw_root, ranges_file, tiny_checkpoints, tmp_path):
    """The CLI's entry point, in this process: each case stops before any unit with its one line."""
    from wampipe.preprocess.__main__ import main

    good = json.loads(ranges_file.read_text())
    key = next(iter(good))
    overlapping = write_ranges(tmp_path, {**good, key: [[0, 50], [40, 90]]})
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
