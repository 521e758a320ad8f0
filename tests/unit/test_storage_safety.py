"""`python -m preprocess shards` deletes or replaces only what a build of it wrote, never follows a planted link, and
object storage fails at start and in one line: real files, real processes, the real local S3 server (moto's) and
real sockets that refuse or never answer."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest
from s3fs import S3FileSystem

from wampipe.errors import UsageError
from wampipe.preprocess import outdir
from wampipe.preprocess.remote import staging_dir
from wampipe.shardformat.storage import s3_options_from_env
from tests.helpers import FOREIGN, FOREIGN_REFUSAL, refusal, shards_cmd, tree

# Another tool's shard directory: files at the names a build writes, none of them recorded by a build.


def test_the_default_staging_folder_is_private_to_the_user_and_a_planted_one_is_refused(tmp_path, monkeypatch):
    url = "s3://bucket/shards/droid"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "shared"))
    (tmp_path / "shared").mkdir()
    staging = staging_dir(url)
    assert staging == staging_dir(url)  # the same folder for every run of this URL: a build resumes
    private = staging.parent
    assert private == tmp_path / "shared" / f"wampipe-staging-{os.getuid()}"
    assert stat.S_IMODE(private.lstat().st_mode) & 0o077 == 0 and private.lstat().st_uid == os.getuid()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    plants = {"link": lambda path: path.symlink_to(elsewhere), "open": lambda path: (path.mkdir(), path.chmod(0o777))}
    for name, plant in plants.items():
        (tmp_path / name).mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / name))
        planted = tmp_path / name / f"wampipe-staging-{os.getuid()}"
        plant(planted)
        with pytest.raises(UsageError) as exc:
            staging_dir(url)
        assert str(exc.value) == (
            f"{planted}: not a private folder of this user (a link, another user's, or open to "
            f"others), so the default staging folder cannot be used: remove it, or pass "
            f"--staging-dir"
        )
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(
    "names,overwrite", [(tuple(FOREIGN), False), (tuple(FOREIGN), True), (("metadata.json", "shard-000000.tar"), False)]
)
def test_foreign_files_at_build_names_are_refused_and_kept_with_or_without_overwrite(
    names, overwrite, droid_root, tiny_checkpoints, tmp_path
):
    out = tmp_path / "out"
    out.mkdir()
    for name in names:
        (out / name).write_bytes(FOREIGN[name])
    before = tree(out)
    message = refusal(shards_cmd(droid_root, out, "droid", tiny_checkpoints, *(["--overwrite"] if overwrite else [])))
    assert message == FOREIGN_REFUSAL.format(where=out, names=", ".join(sorted(names)))
    assert tree(out) == before and sorted(p.name for p in out.iterdir()) == sorted([*names, outdir.LOCK])


def test_the_default_timeouts_give_up_on_a_stalled_endpoint_within_a_minute(monkeypatch):
    for name in ("WAMPIPE_S3_CONNECT_TIMEOUT", "WAMPIPE_S3_READ_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    config = s3_options_from_env()["config_kwargs"]
    assert config["retries"] == {"total_max_attempts": 1}  # botocore tries once; s3fs retries a timed-out read
    pauses = sum(min(1.7**i * 0.1, 15) for i in range(S3FileSystem.retries))  # s3fs's waits between its tries
    assert config["connect_timeout"] + S3FileSystem.retries * config["read_timeout"] + pauses <= 60
