"""`python -m preprocess shards` never mixes two builds in one directory, lets one run own it, skips bad episodes
and refuses bad arguments at start: real processes, signals, datasets and tiny checkpoints."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wampipe.preprocess.__main__ import main
from wampipe.preprocess.check import check
from wampipe.preprocess.outdir import INPUTS, LOCK
from tests.helpers import (
    ROOT,
    alive,
    assert_good_episode_statistics,
    build,
    children,
    corrupt_droid,
    manifest,
    refusal,
    shards_cmd,
    tree,
    wait_for,
)


@pytest.fixture(scope="module")
def bad_build(tmp_path_factory, droid_root, tiny_checkpoints) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """(source, output, the run) of a complete build of the sample DROID dataset with two bad episodes."""
    tmp = tmp_path_factory.mktemp("bad")
    src, out = corrupt_droid(droid_root, tmp / "src"), tmp / "shards"
    return src, out, build(src, out, "droid", tiny_checkpoints)


@pytest.mark.e2e
def test_overwrite_of_finalize_inputs_keeps_the_units(bad_build, tiny_checkpoints, tmp_path):
    src, complete, _ = bad_build
    out = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(complete), str(out)], check=True)
    units = {p.name: p.stat().st_mtime_ns for p in (out / "work").glob("unit-*")}
    main(shards_cmd(src, out, "droid", tiny_checkpoints, "--seed", "1", "--overwrite")[3:])
    assert {p.name: p.stat().st_mtime_ns for p in (out / "work").glob("unit-*")} == units
    assert check(out) == []
    assert manifest(out)["seed"] == 1 and json.loads((out / INPUTS).read_text())["seed"] == 1


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="worker death on parent death is Linux's prctl")
def test_one_run_owns_out_its_workers_die_with_it_and_a_killed_build_is_never_mixed(
    droid_root, bad_build, tiny_checkpoints, tmp_path
):
    out = tmp_path / "killed"
    # a long build (every 4th window, augmented, one unit per episode, two workers); it is killed mid-units
    cmd = shards_cmd(
        droid_root,
        out,
        "droid",
        tiny_checkpoints,
        "--workers",
        "2",
        "--anchor-stride",
        "4",
        "--augment-variants",
        "1",
        "--episodes-per-unit",
        "1",
    )
    owner = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (out / LOCK).is_file() and (out / LOCK).read_text().strip() == str(owner.pid), "the lock")
        second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert owner.poll() is None  # the second run ended while the first held OUT
        assert second.returncode == 1
        assert second.stderr.strip().splitlines()[-1] == (
            f"{out} is in use by another run (pid {owner.pid}): wait for it to end, or use another --out"
        )

        def mid_units() -> bool:
            return bool(list((out / "work").glob("unit-*.json")) and list((out / "work").glob(".unit-*.tmp")))

        wait_for(mid_units, "a finished unit while another is being written")
        workers = children(owner.pid)
        done = sorted(p.name for p in (out / "work").glob("unit-*.json"))
        owner.send_signal(signal.SIGKILL)
    finally:
        owner.kill()
        owner.wait()
    assert workers
    wait_for(lambda: not any(alive(w) for w in workers), "the workers to die with their parent", timeout=10)
    after = tree(out)
    time.sleep(2)
    assert tree(out) == after  # nothing keeps writing
    assert sorted(p.name for p in (out / "work").glob("unit-*.json")) == done  # the units in progress never finished
    assert not (out / "manifest.json").exists()

    refusals = {
        "--anchor-stride": ("8", "4 -> 8"),
        "--model": ("5b-wan22", "5b -> 5b-wan22"),
        "--episodes-per-unit": ("3", "1 -> 3"),
        "--seed": ("1", "0 -> 1"),
    }  # augmented: the units differ
    for flag, (value, change) in refusals.items():
        assert f"{flag}: {change}" in refusal(cmd + [flag, value])
    assert "--src: sha256 " in refusal(
        shards_cmd(bad_build[0], out, "droid", tiny_checkpoints, *cmd[cmd.index("--workers") :])
    )
    assert tree(out) == after

    # --overwrite deletes the old units (their inputs differ) and builds the new ones
    build(droid_root, out, "droid", tiny_checkpoints, "--max-episodes", "1", "--anchor-stride", "96", "--overwrite")
    assert check(out) == []
    assert sorted(p.name for p in (out / "work").glob("unit-*")) == [
        "unit-000000.json",
        "unit-000000.rows.npy",
        "unit-000000.tar",
    ]
    assert json.loads((out / INPUTS).read_text())["max_episodes"] == 1
    assert manifest(out)["totals"]["samples"] == 1  # episode 0: 192 rows, 96 windows, the first of every 96


@pytest.mark.e2e
def test_bad_arguments_and_weights_fail_at_start(droid_root, tiny_checkpoints, tmp_path):
    out = tmp_path / "out"
    tiny = tiny_checkpoints
    clip = tiny / "clip" / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    stats = {"q01": [0.0] * 7, "q99": [1.0] * 7}
    (tmp_path / "lacking.json").write_text(
        json.dumps({"oxe_droid": {"statistics": {"state": {"joint_position": stats}, "action": {}}}})
    )
    (tmp_path / "narrow.json").write_text(
        json.dumps(
            {
                "oxe_droid": {
                    "statistics": {"state": {"joint_position": {"q01": [0.0] * 6, "q99": [1.0] * 6}}, "action": {}}
                }
            }
        )
    )
    cases = {
        ("--samples-per-shard", "0"): "--samples-per-shard must be at least 1, got 0",
        ("--max-episodes", "0"): "--max-episodes must be at least 1, got 0",
        ("--batch-size", "0"): "--batch-size must be at least 1, got 0",
        ("--workers", "-1"): "--workers must be at least 0, got -1",
        ("--anchor-stride", "-2"): "--anchor-stride must be at least 1, got -2",
        ("--augment-variants", "-1"): "--augment-variants must be at least 0, got -1",
        ("--unit-index", "2", "--num-units", "2"): "--unit-index must be in [0, 2)",
        ("--vae", str(tmp_path / "missing.pth")): f"{tmp_path / 'missing.pth'}: file does not exist",
        ("--vae", str(clip)): f"{clip}: this file is a open-clip xlm-roberta ViT-H/14, Wan layout, but the VAE needs",
        ("--vae", str(tiny / "wan2.1" / "Wan2.1_VAE.pth")): "Wan2.1 VAE (16 latent channels, 8x), but a Wan2.2 VAE38",
        ("--image-encoder", str(tiny / "wan2.2" / "Wan2.2_VAE.pth")): "but the image encoder needs",
        ("--text-encoder", str(clip)): "but the text encoder needs",
        ("--tokenizer", str(tiny / "clip")): f"{tiny / 'clip'}: not a tokenizer folder",
        ("--metadata", str(tmp_path / "none.json")): f"--metadata {tmp_path / 'none.json'}: unreadable",
        ("--metadata", str(tmp_path / "lacking.json")): "oxe_droid: state.gripper_position.q01 unusable "
        "(statistics.state has no sub-keys ['gripper_position'])",
        ("--metadata", str(tmp_path / "narrow.json")): "oxe_droid: state.joint_position.q01 has 6 values, the "
        "dataset's joint_position is 7 wide",
        ("--src", str(tmp_path)): f"{tmp_path / 'meta' / 'info.json'}: not a LeRobot dataset",
    }
    for extra, expected in cases.items():
        assert expected in refusal(shards_cmd(droid_root, out, "droid", tiny, *extra)), extra
    assert not out.exists()  # nothing was started

    # through a real process: the message as the last line, no traceback
    result = subprocess.run(
        shards_cmd(droid_root, out, "droid", tiny, "--vae", str(clip)), cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"{clip}: this file is a open-clip xlm-roberta ViT-H/14, Wan "
        f"layout, but the VAE needs a Wan2.1 VAE (16 latent channels, "
        f"8x), original layout or Wan2.2 VAE38 (48 latent channels, "
        f"16x), original layout or Diffusers AutoencoderKLWan"
    )


def test_a_full_disk_stops_the_build_in_one_line_and_the_same_command_resumes(droid_root, tiny_checkpoints, small_disk):
    """A real tmpfs filled but for 64 KiB: a unit's tar does not fit. One line, no traceback; with space again the
    same command finishes a build `check` accepts."""
    from tests.helpers import fill_disk

    out = small_disk / "out"
    filler = fill_disk(small_disk, 64 << 10)
    cmd = shards_cmd(droid_root, out, "droid", tiny_checkpoints, "--max-episodes", "2")
    full = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert full.stderr.strip().splitlines()[-1] == (
        f"{out}: No space left on device: free space (or raise the quota) and run the same command again; finished "
        f"units are kept"
    ), full.stderr[-3000:]
    filler.unlink()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    check(out)


# (extra arguments, the difference the refusal must name); seed: no augmentation, so only the shards differ
OTHER_INPUTS = {
    "anchor_stride": (["--anchor-stride", "8"], "--anchor-stride: 16 -> 8"),
    "model": (["--model", "5b-wan22"], "--model: 5b -> 5b-wan22"),
    "episodes_per_unit": (["--episodes-per-unit", "3"], "--episodes-per-unit: 2 -> 3"),
    "seed": (["--seed", "1"], "--seed: 0 -> 1"),
    # other latents (compiled kernels): the 5B's encoder recorded by its kernels' name
    "vae_compile": (["--vae-compile", "on"], "--vae-compile: False -> fused-norms-channels-last"),
}


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
