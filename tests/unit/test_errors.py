"""One error type: every error a tool reports in one line is a WampipeError, and an entry point prints its message
alone (no traceback) with its exit status: 1, or 2 for flags that do not go together. The trainer's ranks report a
refusal every rank makes (RunError) once, from rank 0."""

import pickle

import pytest

from wampipe import configs
from wampipe.configs.cli import FlagError, refuse
from wampipe.encoders.weights import WeightsError as EncoderWeightsError
from wampipe.errors import UsageError, WampipeError, entry_point
from wampipe.preprocess.__main__ import main
from wampipe.preprocess.errors import DatasetError, EncoderOutputError, OutOfSpace
from wampipe.preprocess.tasks import ChildDied
from wampipe.preprocess.remote import RemoteError
from wampipe.shardformat.manifest import ShardFormatError
from wampipe.shardformat.schema import SchemaError
from wampipe.errors import RunError
from wampipe.train.runtime import alike, report
from wampipe.train.dit.weights import WeightsError as TrainerWeightsError
from tests.helpers import ROOT


@pytest.mark.parametrize(
    "error",
    [
        DatasetError,
        EncoderOutputError,
        OutOfSpace,
        ChildDied,
        ShardFormatError,
        SchemaError,
        EncoderWeightsError,
        UsageError,
        FlagError,
        RemoteError,
        RunError,
    ],
)
def test_every_domain_error_is_a_wampipe_error(error):
    assert issubclass(error, WampipeError) and not issubclass(error, SystemExit)


def test_one_weights_error_for_the_encoders_and_the_trainer():
    assert TrainerWeightsError is EncoderWeightsError
    parts, line = EncoderWeightsError("vae.pth", "file does not exist"), EncoderWeightsError("--model.init-from x: y")
    assert (str(parts), str(line)) == ("vae.pth: file does not exist", "--model.init-from x: y")
    assert [str(pickle.loads(pickle.dumps(e))) for e in (parts, line)] == [str(parts), str(line)]  # from a worker


def test_a_config_file_that_cannot_be_read_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match=rf"^{tmp_path / 'none.yaml'}: unreadable config \(No such file"):
        configs.read(tmp_path / "none.yaml")
    with pytest.raises(EncoderWeightsError, match=r"not a YAML mapping$"):  # a caller's own type
        (tmp_path / "list.yaml").write_text("- 1\n")
        configs.read(tmp_path / "list.yaml", EncoderWeightsError)


def test_the_entry_point_gives_the_line_and_the_exit_status(capsys):
    with pytest.raises(SystemExit) as stop:
        with entry_point():
            raise UsageError("--steps 0: must be at least 1")
    assert stop.value.code == "--steps 0: must be at least 1" and capsys.readouterr().err == ""  # Python prints it
    with pytest.raises(SystemExit) as stop:  # flags that do not go together: status 2, as for a flag tyro rejects
        with entry_point():
            refuse("--bound-only and --trainer-only exclude each other")
    assert stop.value.code == 2 and capsys.readouterr().err == "--bound-only and --trainer-only exclude each other\n"
    with pytest.raises(KeyError):  # a bug is not the project's error: its traceback stays
        with entry_point():
            raise KeyError("x")


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_a_refusal_every_rank_makes_is_one_line_from_rank_0(rank, capsys):
    """A bad file that every rank reads (`runtime.alike`), or a RunError: rank 0 prints its line and exits 1, the
    other ranks exit 1 in silence; the process's own errors are each rank's line."""
    with pytest.raises(RunError) as refused:
        with alike():
            raise ShardFormatError("shards/x/manifest.json: not JSON")
    assert str(refused.value) == "shards/x/manifest.json: not JSON"
    assert report(refused.value, rank) == 1
    assert capsys.readouterr().err == ("shards/x/manifest.json: not JSON\n" if rank == 0 else "")
    assert report(RunError("step 5: non-finite loss"), rank) == 1
    assert capsys.readouterr().err == ("step 5: non-finite loss\n" if rank == 0 else "")
    assert report(ShardFormatError("shard-000003.tar: sample k: checksum mismatch"), rank) == 1  # this rank's own
    assert capsys.readouterr().err == "shard-000003.tar: sample k: checksum mismatch\n"
    with pytest.raises(RunError) as refused:  # rank 0 keeps the exit status; the others exit 1, as always
        with alike():
            refuse("--a and --b exclude each other")
    assert report(refused.value, rank) == (2 if rank == 0 else 1)
    assert capsys.readouterr().err == ("--a and --b exclude each other\n" if rank == 0 else "")
    assert report(SystemExit(3), rank) == 3 and capsys.readouterr().err == ""
    try:
        {}["x"]
    except KeyError as bug:  # anything else: its traceback, on every rank
        assert report(bug, rank) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_shard_format_error_is_one_line_at_the_entry_point(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(SystemExit) as stop:
        main(["preview", str(tmp_path), "--vae", str(tmp_path / "vae.pth"), "--out", str(tmp_path / "out")])
    assert isinstance(stop.value.code, str) and "\n" not in stop.value.code
    assert stop.value.code.startswith(str(tmp_path / "manifest.json"))


def test_the_preprocess_package_leaves_exit_statuses_to_its_entry_point():
    """Library code raises the project's errors; only `python -m preprocess` (its __main__) ends the process."""
    root = ROOT / "preprocess"
    raising = sorted(p.name for p in root.glob("*.py") if "raise SystemExit" in p.read_text())
    assert raising == ["__main__.py"]


def test_a_bad_flag_is_one_line_at_the_entry_point(tmp_path):
    with pytest.raises(SystemExit) as stop:
        main(["shards", "--src", str(tmp_path), "--episodes", "3,x"])
    assert stop.value.code == "--episodes 3,x: 'x' is not an episode id or a range like 10-19"
    with pytest.raises(SystemExit) as stop:  # refused while the defaults are made, before the flags are parsed
        main(["shards", "--dataset", "libero", "--official-filters", "--src", str(tmp_path)])
    assert stop.value.code == (
        "--official-filters: the libero dataset preset names no official filters "
        "(configs/datasets.yaml); give the filter flags themselves"
    )
