"""`python -m preprocess shards` never mixes two builds in one directory, lets one run own it, skips bad episodes
and refuses bad arguments at start: real processes, signals, datasets and tiny checkpoints."""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import pytest

from wampipe.preprocess.check import check
from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.outdir import INPUTS
from tests.helpers import build, manifest, shards_cmd
from tests.helpers import assert_good_episode_statistics, corrupt_droid
from tests.helpers import refusal, tree

# (extra arguments, the difference the refusal must name); seed: no augmentation, so only the shards differ
OTHER_INPUTS = {
    "anchor_stride": (["--anchor-stride", "8"], "--anchor-stride: 16 -> 8"),
    "model": (["--model", "5b-wan22"], "--model: 5b -> 5b-wan22"),
    "episodes_per_unit": (["--episodes-per-unit", "3"], "--episodes-per-unit: 2 -> 3"),
    "seed": (["--seed", "1"], "--seed: 0 -> 1"),
    "vae_compile": (["--vae-compile", "on"], "--vae-compile: False -> True"),  # other latents (compiled kernels)
}


@pytest.fixture(scope="module")
def bad_build(tmp_path_factory, droid_root, tiny_checkpoints) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """(source, output, the run) of a complete build of the sample DROID dataset with two bad episodes."""
    tmp = tmp_path_factory.mktemp("bad")
    src, out = corrupt_droid(droid_root, tmp / "src"), tmp / "shards"
    return src, out, build(src, out, "droid", tiny_checkpoints)


def test_bad_episodes_are_left_out_of_units_and_statistics(bad_build):
    src, out, result = bad_build
    m = manifest(out)
    assert [(f["episode"], f["reason"]) for f in m["failures"]] == [
        (0, f"{src / 'data/chunk-000/episode_000000.parquet'}: episode 0: column 'observation.state' holds NaN or inf"),
        (3, f"{src / 'data/chunk-000/episode_000003.parquet'}: episode 3: parquet has 123 rows, meta says length 133"),
    ]
    assert m["statistics"]["excluded"] == m["failures"]
    assert m["totals"]["samples"] == 1 and check(out) == []  # episode 2: one window; episode 1 is too short
    assert "FAILED episode 0" in result.stdout and "FAILED episode 3" in result.stdout
    assert_good_episode_statistics(json.loads((out / "metadata.json").read_text()), src, [1, 2])


@pytest.mark.parametrize("name", [*OTHER_INPUTS, "src"])
def test_rerun_with_other_inputs_is_refused_after_a_complete_build(name, bad_build, droid_root, tiny_checkpoints):
    src, out, _ = bad_build
    before = tree(out)
    extra, expected = OTHER_INPUTS.get(name, ([], "--src: sha256 "))
    message = refusal(shards_cmd(droid_root if name == "src" else src, out, "droid", tiny_checkpoints, *extra))
    assert message.startswith(f"{out} holds a build made from other inputs: {expected}")
    assert message.endswith("or use another --out, or --overwrite to delete the old build") and "\n" not in message
    assert tree(out) == before


def test_dataset_error_survives_the_trip_from_a_worker_process():
    err = pickle.loads(pickle.dumps(DatasetError("/data/episode_000003.parquet", 3, "holds NaN")))
    assert isinstance(err, DatasetError) and (err.path, err.episode, err.reason) == (
        Path("/data/episode_000003.parquet"),
        3,
        "holds NaN",
    )
    assert str(err) == "/data/episode_000003.parquet: episode 3: holds NaN"


def test_an_inputs_json_no_build_wrote_is_a_foreign_file(tmp_path):
    """A JSON file at inputs.json without a build's record in it is the user's: refused as foreign, nothing deleted,
    even with --overwrite; a record of an older wampipe that lacks a newer field is a difference, not a KeyError."""
    from wampipe.errors import UsageError
    from wampipe.preprocess.outdir import RECORD_KEYS, claim

    out = tmp_path / "out"
    out.mkdir()
    (out / INPUTS).write_text('{"notes": "my own file"}\n')
    inputs = {key: "x" for key in RECORD_KEYS} | {"augment_variants": 0, "seed": 0}
    for overwrite in (False, True):
        with pytest.raises(
            UsageError,
            match=r"holds files that no wampipe build recorded.*: inputs\.json\. Nothing "
            r"was deleted",
        ):
            claim(out, inputs, overwrite)
    assert (out / INPUTS).read_text() == '{"notes": "my own file"}\n'
    older = {key: "x" for key in RECORD_KEYS}  # no augment_variants, no seed
    (out / INPUTS).write_text(json.dumps(older))
    with pytest.raises(UsageError, match=r"holds a build made from other inputs: --augment-variants: None -> 0"):
        claim(out, inputs, False)
