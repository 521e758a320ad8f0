"""`python -m preprocess shards --val-episodes`: held-out episodes go whole into the validation split OUT/val, which
training shards never hold; the choice is recorded, checked, stable across executors and refused when it changes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from wampipe.preprocess.check import check
from wampipe.preprocess.validation import in_fraction
from wampipe.shardformat.keys import parse_key
from tests.helpers import ROOT, build, manifest, shards_cmd

pytestmark = pytest.mark.e2e  # every test runs the tools in processes of their own


def keys(out: Path) -> list[str]:
    """Every sample key of a shard directory, from its shard JSONs."""
    return [
        k
        for s in manifest(out)["shards"]
        for k in json.loads((out / s["shard"]).with_suffix(".json").read_text())["keys"]
    ]


def episodes(out: Path) -> set[int]:
    return {parse_key(k).episode for k in keys(out)}


def test_held_out_episodes_never_reach_training_shards(held_out_3, droid_shards):
    assert check(held_out_3) == []
    train, val = keys(held_out_3), keys(held_out_3 / "val")
    assert episodes(held_out_3) == {0, 2} and episodes(held_out_3 / "val") == {3}
    assert not set(train) & set(val) and sorted(train + val) == sorted(keys(droid_shards))  # the build without a split
    record = manifest(held_out_3)["validation"]
    assert record == {"split": "train", "choice": "3", "episodes": [3], "val_dir": "val"}
    assert manifest(held_out_3 / "val")["validation"] == {"split": "val", "choice": "3", "episodes": [3]}
    # statistics of the training episodes only, the same file in both splits
    stats = (held_out_3 / "metadata.json").read_bytes()
    assert stats == (held_out_3 / "val" / "metadata.json").read_bytes() != (droid_shards / "metadata.json").read_bytes()
    assert {"episode": 3, "reason": "held out for validation (--val-episodes)"} in manifest(held_out_3)["statistics"][
        "excluded"
    ]


def test_check_finds_a_held_out_sample_in_training_shards(held_out_3, droid_shards, tmp_path):
    """A training split whose shards hold an episode the manifest says is held out fails the check."""
    import shutil

    from wampipe.shardformat.manifest import Manifest

    out = tmp_path / "mixed"
    shutil.copytree(droid_shards, out)  # every episode in its training shards
    shutil.copytree(held_out_3 / "val", out / "val")
    m = Manifest.read(out)
    m.validation = manifest(held_out_3)["validation"]
    m.write(out)
    problems = check(out, decode=False)
    assert problems and all("held out for validation" in p for p in problems)
    assert len(problems) == len([k for k in keys(droid_shards) if parse_key(k).episode == 3])


def test_a_fraction_picks_the_same_episodes_on_every_executor(droid_root, tiny_checkpoints, tmp_path):
    held = [e for e in range(4) if in_fraction("droid", e, 0.5)]
    assert 0 < len(held) < 4  # the sample dataset's ids and this fraction leave both splits episodes
    local, stream = tmp_path / "local", tmp_path / "stream"
    build(droid_root, local, "droid", tiny_checkpoints, "--val-episodes", "0.50", "--executor", "local")
    build(
        droid_root,
        stream,
        "droid",
        tiny_checkpoints,
        "--val-episodes",
        "0.5",
        "--executor",
        "stream",
        "--workers",
        "2",
        "--threads-per-worker",
        "1",
        "--episodes-per-unit",
        "3",
    )
    for out in (local, stream):
        assert check(out) == []
        assert manifest(out)["validation"]["episodes"] == held and manifest(out)["validation"]["choice"] == "0.5"
        assert episodes(out / "val") == set(held) - {1} and not episodes(out) & set(held)  # 1: no full window
    assert keys(local / "val") == keys(stream / "val") and keys(local) == keys(stream)


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True)


def test_a_rerun_with_other_held_out_episodes_is_refused(held_out_3, tiny_checkpoints, droid_root):
    before = sorted(p.name for p in held_out_3.rglob("*"))
    done = run_cli(shards_cmd(droid_root, held_out_3, "droid", tiny_checkpoints, "--val-episodes", "2,3"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"{held_out_3} holds a build made from other inputs: --val-episodes: 3 -> 2,3.")
    )
    without = run_cli(shards_cmd(droid_root, held_out_3, "droid", tiny_checkpoints))
    assert without.returncode == 1 and "--val-episodes: 3 -> None" in without.stderr
    assert sorted(p.name for p in held_out_3.rglob("*")) == before


@pytest.mark.parametrize(
    "value,says",
    [
        ("1.5", "not a fraction in (0, 1)"),
        ("0.0", "not a fraction in (0, 1)"),
        ("abc", "not a fraction in (0, 1)"),
        ("-1", "not a fraction in (0, 1)"),
        ("3,x", "not a fraction in (0, 1)"),
        ("3,9", "episodes [9] are not among the 4 episodes"),
        ("0,1,2,3", "holds out every one of the 4 episodes"),
    ],
)
def test_bad_values_give_one_line(value, says, droid_root, tiny_checkpoints, tmp_path):
    done = run_cli(shards_cmd(droid_root, tmp_path / "out", "droid", tiny_checkpoints, "--val-episodes", value))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr and says in lines[-1], done.stderr
    assert not (tmp_path / "out" / "inputs.json").exists()


def test_overwrite_with_other_held_out_episodes_keeps_the_units(held_out_3, tiny_checkpoints, droid_root, tmp_path):
    import shutil

    out = shutil.copytree(held_out_3, tmp_path / "droid")
    units = {p.name: p.stat().st_ino for p in (out / "work").glob("unit-*")}
    done = run_cli(shards_cmd(droid_root, out, "droid", tiny_checkpoints, "--val-episodes", "2,3", "--overwrite"))
    assert done.returncode == 0, done.stderr
    assert {p.name: p.stat().st_ino for p in (out / "work").glob("unit-*")} == units  # only finalize ran again
    assert check(out) == [] and episodes(out) == {0} and episodes(out / "val") == {2, 3}
    assert manifest(out)["validation"]["episodes"] == [2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--metrics.val-shards", "--metrics.action-shards"])
def test_evaluation_sets_of_another_recipe_stop_the_run_at_start(flag, small_shards, droid_shards, tmp_path):
    """Checked like --data.shards, before the first step: not thousands of steps in at the first evaluation."""
    from tests.helpers import trainer_command, trainer_env

    cmd = [
        *trainer_command(small_shards, tmp_path / "run"),
        flag,
        str(droid_shards),
        "--metrics.val-interval",
        "100",
        "--metrics.action-interval",
        "100",
    ]
    done = subprocess.run(cmd, env=trainer_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    role = "a validation split" if "val" in flag else "an action-evaluation set"
    line = (
        f"{droid_shards}: built for another DiT recipe than {small_shards}: in_dim 48 vs 4; {role} must be "
        f"built like the data it evaluates"
    )
    assert done.stderr.count(line) == 1, done.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_a_validation_split_is_checked_on_its_own(held_out_3, capsys):
    """`check DIR/val`: the split alone, its samples all of the held-out episodes, one OK line."""
    from wampipe.preprocess.__main__ import main as preprocess_main

    assert check(held_out_3 / "val") == []
    preprocess_main(["check", str(held_out_3 / "val")])
    assert capsys.readouterr().out.splitlines() == [
        f"OK: {held_out_3 / 'val'}: "
        f"{manifest(held_out_3 / 'val')['totals']['samples']} samples in "
        f"{len(manifest(held_out_3 / 'val')['shards'])} shards"
    ]
