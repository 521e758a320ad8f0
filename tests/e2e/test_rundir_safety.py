"""The trainer's run directory (--checkpoint.dir) is its own: files it did not write stay as they are, a second
trainer on it refuses in one line, a checkpoint that lost or truncated a rank's files is named and the last complete
one resumes (or, with none, the run is refused), and a full disk during a save or the export stops the run in one
line with the last checkpoint and the previous export whole. Real torchrun (2 gloo ranks, tiny preset), real
signals, a real tmpfs."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, descendants, fill_disk, metric_rows, trainer_command, trainer_env
from wampipe.train.checkpoint import LOCK, MARKER, complete_checkpoints, run_identity, step_dir

pytestmark = pytest.mark.slow
STEPS = 8


def _cmd(shards: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        *trainer_command(shards, run_dir),
        "--steps",
        str(STEPS),
        "--checkpoint.interval",
        "2",
        "--data.num-workers",
        "0",
        *extra,
    ]


def _run(shards: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd(shards, run_dir, *extra), env=trainer_env(), cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metric_rows(run_dir)]


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file's bytes, but the lock's (each run that takes the lock writes its pid there)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != LOCK
    }


@pytest.fixture(scope="module")
def full_run(small_shards, tmp_path_factory) -> Path:
    """The uninterrupted run every other run is compared with."""
    run_dir = tmp_path_factory.mktemp("rundir") / "full"
    done = _run(small_shards, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_files_the_trainer_did_not_write_are_never_touched(small_shards, full_run, tmp_path):
    foreign = tmp_path / "foreign"
    (foreign / "export").mkdir(parents=True)
    (foreign / "config.yaml").write_text("my: notes\n")
    (foreign / "export" / "README.md").write_text("the model we shipped\n")
    (foreign / "metrics.jsonl").write_text(json.dumps({"step": 99, "loss": 0.5, "who": "another tool"}) + "\n")
    before = _snapshot(foreign)
    refused = _run(small_shards, foreign)
    assert refused.returncode != 0
    line = (
        f"{foreign} holds config.yaml, export, metrics.jsonl but is not a wampipe run directory (no {MARKER}): "
        f"pass a new or empty --checkpoint.dir"
    )
    assert refused.stderr.count(line) == 1, refused.stderr[-3000:]
    assert _snapshot(foreign) == before and sorted(p.name for p in foreign.iterdir()) == sorted(
        ["config.yaml", "export", "metrics.jsonl"]
    )  # not even a lock file

    # the trainer's own directory, with a file put into its export folder: the export would replace the folder
    run_dir = tmp_path / "run"
    subprocess.run(["cp", "-a", str(full_run), str(run_dir)], check=True)
    (run_dir / "export" / "README.md").write_text("how to serve it\n")
    before = _snapshot(run_dir)
    refused = _run(small_shards, run_dir, "--steps", str(STEPS + 2))
    assert refused.returncode != 0
    line = (
        f"{run_dir / 'export'} holds README.md, which no export writes: the export would replace the folder, "
        f"so move them out of it (or pass --checkpoint.no-export)"
    )
    assert refused.stderr.count(line) == 1, refused.stderr[-3000:]
    assert _snapshot(run_dir) == before


def _signal_all(proc: subprocess.Popen, signum: int) -> None:
    for pid in [proc.pid, *descendants(proc.pid)]:
        os.kill(pid, signum)


def test_a_second_trainer_on_a_directory_in_use_refuses_in_one_line(small_shards, full_run, tmp_path):
    """The first run holds the lock from before its first step; stopped (SIGSTOP) while the second starts, so the
    second meets it for sure. A file of another name in the directory is written beside, never touched."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("launched from the notebook\n")
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            _cmd(small_shards, run_dir), env=trainer_env(), cwd=ROOT, stdout=log, stderr=log, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").is_file() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        _signal_all(first, signal.SIGSTOP)
        try:
            holder = (run_dir / LOCK).read_text().strip()
            second = _run(small_shards, run_dir)
        finally:
            _signal_all(first, signal.SIGCONT)
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            _signal_all(first, signal.SIGKILL)
    assert second.returncode != 0
    line = (
        f"{run_dir} is in use by another training run (pid {holder}): wait for it to end, or pass another "
        f"--checkpoint.dir"
    )
    assert second.stderr.count(line) == 1, second.stderr[-3000:]
    assert second.stdout == ""  # no work began
    assert _losses(run_dir) == _losses(full_run)  # the first run's rows only, as if alone
    assert (run_dir / "notes.txt").read_text() == "launched from the notebook\n"


def test_a_damaged_checkpoint_is_named_and_the_last_complete_one_resumes(small_shards, full_run, tmp_path):
    run_dir = tmp_path / "run"
    stopped = _run(small_shards, run_dir, "--stop-after", "6")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2, 4, 6]
    step4, step6 = step_dir(run_dir, 4), step_dir(run_dir, 6)
    for name in ("rank-00001.json", "rank-00001.safetensors", "__1_0.distcp"):  # rank 1's files of step 6 lost
        (step6 / name).unlink()
    for name, keep in (("rank-00001.json", 0.5), ("rank-00000.safetensors", 0.9)):  # two of step 4's truncated
        data = (step4 / name).read_bytes()
        (step4 / name).write_bytes(data[: int(len(data) * keep)])

    kept = step_dir(run_dir, 2) / "rank-00000.json"
    kept.rename(tmp_path / kept.name)  # with step 2 damaged too, nothing is left to resume from: refused
    before = _snapshot(run_dir)
    refused = _run(small_shards, run_dir)
    assert refused.returncode != 0
    line = (
        f"{step6}: not a complete checkpoint and none before it: restore its files, or pass "
        f"--checkpoint.no-resume to start over (deleting its step directories)"
    )
    assert refused.stderr.count(line) == 1, refused.stderr[-3000:]
    assert (
        f"{step_dir(run_dir, 2)} skipped, not a complete checkpoint: missing rank-00000.json of its 2 ranks"
        in refused.stdout.splitlines()
    )
    assert _snapshot(run_dir) == before

    (tmp_path / kept.name).rename(kept)
    resumed = _run(small_shards, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = resumed.stdout.splitlines()
    assert (
        f"{step6} skipped, not a complete checkpoint: missing __1_0.distcp, rank-00001.json, "
        f"rank-00001.safetensors of its 2 ranks" in lines
    )
    skipped4 = next(line for line in lines if line.startswith(f"{step4} skipped, not a complete checkpoint: "))
    assert "rank-00001.json unreadable" in skipped4 and "rank-00000.safetensors unreadable" in skipped4
    assert any(line.startswith(f"resumed from {step_dir(run_dir, 2)} at step 2 ") for line in lines)
    assert _losses(run_dir) == _losses(full_run)  # steps 3 to 8 again, as the uninterrupted run took them


def test_a_start_over_never_mixes_with_the_run_before_it(small_shards, full_run, tmp_path):
    """Run A left steps 4, 6 and 8; run B starts over in the same directory with 4 steps saved every step: A's step
    directories go before B's first step, so rotation keeps B's own (2, 3, 4) and a plain restart resumes B, also
    when one of A's step directories is copied back in (B's identity differs from the one it records)."""
    import shutil

    run_dir = Path(shutil.copytree(full_run, tmp_path / "run"))
    assert [s for s, _ in complete_checkpoints(run_dir)] == [4, 6, 8]
    again = _run(small_shards, run_dir, "--checkpoint.no-resume", "--steps", "4", "--checkpoint.interval", "1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        f"--checkpoint.no-resume: deleted the 3 step directories of an earlier run in {run_dir} (step-000004, "
        f"step-000006, step-000008)"
    ) in again.stdout.splitlines()
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2, 3, 4]
    assert run_identity(run_dir) != run_identity(full_run)  # a start over is another run
    # a step directory of run A copied back in is not run B's: resume, rotation and evaluation pass it by
    shutil.copytree(step_dir(full_run, 8), step_dir(run_dir, 8))
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2, 3, 4]
    resumed = _run(small_shards, run_dir, "--steps", "5", "--checkpoint.interval", "1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = resumed.stdout.splitlines()
    assert any(
        line.startswith(
            f"{step_dir(run_dir, 8)} skipped, not a complete checkpoint: rank-00000.json belongs to another run"
        )
        for line in lines
    ), resumed.stdout[-3000:]
    assert any(line.startswith(f"resumed from {step_dir(run_dir, 4)} at step 4 ") for line in lines)
    assert step_dir(run_dir, 8).is_dir()  # another run's files: never rotated away


def _one_line(stderr: str, start: str) -> str:
    """The only stderr line that starts with `start`, checked to be the run's only report (no rank's traceback)."""
    lines = [line for line in stderr.splitlines() if line.startswith(start)]
    assert len(lines) == 1, stderr[-3000:]
    assert "Error" not in stderr.replace(lines[0], "").replace("ChildFailedError", ""), stderr[-3000:]
    return lines[0]


def test_a_full_disk_during_a_save_or_the_export_stops_in_one_line_and_keeps_what_was_there(
    small_shards, full_run, small_disk
):
    run_dir = small_disk / "run"
    first = _run(small_shards, run_dir, "--stop-after", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    filler = fill_disk(small_disk, 128 << 10)  # room for the metrics rows, not for a checkpoint
    full = _run(small_shards, run_dir)
    assert full.returncode != 0
    line = _one_line(full.stderr, f"{step_dir(run_dir, 4)}: saving the checkpoint failed (")
    assert line.endswith(
        f"MiB free there); the last checkpoint {step_dir(run_dir, 2)} is as it was: free space (or "
        f"fix the cause) and run again to resume"
    )
    assert float(line.split(" MiB free there")[0].rsplit("; ", 1)[1]) < 0.5
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2] and not step_dir(run_dir, 4).exists()

    filler.unlink()
    again = _run(small_shards, run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _losses(run_dir) == _losses(full_run)

    export = _snapshot(run_dir / "export")
    fill_disk(small_disk, 128 << 10)  # two more steps, no checkpoint, then the export: it does not fit
    more = _run(
        small_shards, run_dir, "--steps", str(STEPS + 2), "--checkpoint.interval", "0", "--checkpoint.no-save-final"
    )
    assert more.returncode != 0
    line = _one_line(more.stderr, f"{run_dir / 'export'}: export failed (")
    assert "No space left on device" in line and line.endswith("the previous export there is as it was")
    assert _snapshot(run_dir / "export") == export and not (run_dir / ".export.tmp").exists()
