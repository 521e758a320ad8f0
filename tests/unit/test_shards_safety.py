"""`python -m preprocess shards` never mixes two builds in one directory, lets one run own it, skips bad episodes
and refuses bad arguments at start: real processes, signals, datasets and tiny checkpoints."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.outdir import INPUTS


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
