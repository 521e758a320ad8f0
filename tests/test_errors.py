"""One error type: every error a tool reports in one line is a WampipeError, and an entry point prints its message
alone (no traceback) with exit status 1."""

import pytest

from wampipe.encoders.weights import WeightsError as EncoderWeightsError
from wampipe.errors import WampipeError
from wampipe.preprocess.__main__ import main
from wampipe.preprocess.errors import DatasetError, EncoderOutputError, OutOfSpace
from wampipe.preprocess.executors import ChildDied
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.schema import SchemaError
from wampipe.train.weights import WeightsError as TrainerWeightsError


@pytest.mark.parametrize("error", [DatasetError, EncoderOutputError, OutOfSpace, ChildDied, ShardFormatError,
                                   SchemaError, EncoderWeightsError, TrainerWeightsError])
def test_every_domain_error_is_a_wampipe_error(error):
    assert issubclass(error, WampipeError)


def test_a_shard_format_error_is_one_line_at_the_entry_point(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(SystemExit) as stop:
        main(["preview", str(tmp_path), "--vae", str(tmp_path / "vae.pth"), "--out", str(tmp_path / "out")])
    assert isinstance(stop.value.code, str) and "\n" not in stop.value.code
    assert stop.value.code.startswith(str(tmp_path / "manifest.json"))
