"""One error type: every error a tool reports in one line is a WampipeError, and an entry point prints its message
alone (no traceback) with exit status 1."""

from pathlib import Path

import pytest

from wampipe.encoders.weights import WeightsError as EncoderWeightsError
from wampipe.errors import UsageError, WampipeError
from wampipe.preprocess.__main__ import main
from wampipe.preprocess.errors import DatasetError, EncoderOutputError, OutOfSpace
from wampipe.preprocess.tasks import ChildDied
from wampipe.preprocess.remote import RemoteError
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.schema import SchemaError
from wampipe.train.weights import WeightsError as TrainerWeightsError


@pytest.mark.parametrize("error", [DatasetError, EncoderOutputError, OutOfSpace, ChildDied, ShardFormatError,
                                   SchemaError, EncoderWeightsError, TrainerWeightsError, UsageError, RemoteError])
def test_every_domain_error_is_a_wampipe_error(error):
    assert issubclass(error, WampipeError)


def test_a_shard_format_error_is_one_line_at_the_entry_point(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(SystemExit) as stop:
        main(["preview", str(tmp_path), "--vae", str(tmp_path / "vae.pth"), "--out", str(tmp_path / "out")])
    assert isinstance(stop.value.code, str) and "\n" not in stop.value.code
    assert stop.value.code.startswith(str(tmp_path / "manifest.json"))


def test_the_preprocess_package_leaves_exit_statuses_to_its_entry_point():
    """Library code raises the project's errors; only `python -m preprocess` (its __main__) ends the process."""
    root = Path(__file__).resolve().parents[1] / "preprocess"
    raising = sorted(p.name for p in root.glob("*.py") if "raise SystemExit" in p.read_text())
    assert raising == ["__main__.py"]


def test_a_bad_flag_is_one_line_at_the_entry_point(tmp_path):
    with pytest.raises(SystemExit) as stop:
        main(["shards", "--src", str(tmp_path), "--episodes", "3,x"])
    assert stop.value.code == "--episodes 3,x: 'x' is not an episode id or a range like 10-19"
    with pytest.raises(SystemExit) as stop:  # refused while the defaults are made, before the flags are parsed
        main(["shards", "--dataset", "libero", "--official-filters", "--src", str(tmp_path)])
    assert stop.value.code == ("--official-filters: the libero dataset preset names no official filters "
                               "(configs/datasets.yaml); give the filter flags themselves")
