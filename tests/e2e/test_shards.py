"""`python -m preprocess shards` end to end on the sample datasets with tiny checkpoints, and the integrity check."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import IO, cast

import pytest
from safetensors import safe_open

from wampipe.preprocess.__main__ import main as preprocess_main
from wampipe.preprocess.check import check
from wampipe.shardformat.files import sha256_file
from wampipe.shardformat.members import decode_members
from wampipe.train.dit.export import OFFICIAL_CLIP_DIM
from tests.helpers import ROOT, build, manifest, shard_samples, shards_cmd

pytestmark = pytest.mark.e2e  # every test runs the tools in processes of their own


def test_droid_shards_pass_check_and_hold_the_reference_shapes(droid_shards, droid_root):
    assert check(droid_shards) == []
    m = manifest(droid_shards)
    assert m["embodiment"] == "oxe_droid" and m["model"] == "5b"
    # Sample DROID episodes: lengths 192, 62, 97, 133 -> 96, 0, 1, 37 distinct windows; every 16th kept.
    assert m["totals"]["samples"] == 6 + 0 + 1 + 3
    assert [s["count"] for s in m["shards"]] == [4, 4, 2]
    assert m["skipped"] == [{"episode": 1, "reason": "shorter than one window (62 rows, a full window needs 97)"}]
    samples = [s for shard in m["shards"] for s in shard_samples(droid_shards / shard["shard"])]
    episodes_in_first_shard = {decode_members(s[1])[0]["episode"] for s in samples[:4]}
    assert len(episodes_in_first_shard) > 1  # mixed across episodes at write time
    meta, tensors = decode_members(samples[0][1])
    assert tensors["state"].shape == (4, 8) and tensors["action"].shape == (96, 8)
    assert tensors["clip"].shape[0] == 257
    assert tensors["latents"].ndim == 4 and tensors["latents"].shape[1] == 9  # [C, 9, h, w]
    assert len(meta["prompt_ids"]) == 3
    prompts = json.loads((droid_shards / "text" / "prompts.json").read_text())
    assert all(p in prompts for p in meta["prompt_ids"].values())
    assert prompts[meta["prompt_ids"]["annotation.language.language_instruction"]]["text"].startswith(
        "A multi-view video shows that a robot "
    )


@pytest.mark.parametrize("layout", ["libero_root", "libero_v3_root"])
def test_libero_layouts_pass_check(layout, request, tmp_path, tiny_checkpoints):
    if layout == "libero_root":
        out = request.getfixturevalue("libero_shards")  # the session's build of that layout, by the same command
    else:
        out = tmp_path / "shards"
        build(request.getfixturevalue(layout), out, "libero", tiny_checkpoints)
    assert check(out) == []
    m = manifest(out)
    # LIBERO lengths 168, 47, 73, 109 -> 96, 0, 1, 37 windows of extent 72; every 16th kept.
    assert m["totals"]["samples"] == 6 + 0 + 1 + 3
    sample = shard_samples(out / m["shards"][0]["shard"])[0][1]
    _, tensors = decode_members(sample)
    assert tensors["action"].shape == (64, 7) and tensors["state"].shape == (4, 8)


def test_rerun_is_byte_identical_and_array_jobs_match(droid_shards, droid_root, tiny_checkpoints, tmp_path):
    """A fresh build split over array jobs (units, then finalize's shards, then its index and manifest), and one on
    Ray, give the session build's bytes; rerunning a finished directory rewrites nothing."""
    split = tmp_path / "split"
    for unit in (1, 0):
        out = build(droid_root, split, "droid", tiny_checkpoints, "--unit-index", str(unit), "--num-units", "2")
        assert "--stage finalize" in out.stdout
    assert not (split / "manifest.json").exists()
    # finalize split over two array jobs running at once (each its shards), then once more for the index and manifest
    jobs = [
        subprocess.Popen(
            shards_cmd(
                droid_root,
                split,
                "droid",
                tiny_checkpoints,
                "--stage",
                "finalize",
                "--unit-index",
                str(i),
                "--num-units",
                "2",
            ),
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in (0, 1)
    ]
    for job in jobs:
        stdout, stderr = job.communicate(timeout=600)
        assert job.returncode == 0 and "without --unit-index" in stdout, stderr[-2000:]
    assert not (split / "manifest.json").exists()
    written = {p.name: p.stat().st_mtime_ns for p in split.glob("shard-*")}
    assert sorted(written) == sorted(
        n for s in manifest(droid_shards)["shards"] for n in (s["shard"], s["shard"].replace(".tar", ".json"))
    )
    done = build(droid_root, split, "droid", tiny_checkpoints, "--stage", "finalize")
    assert "start: encoder weights not loaded (--stage finalize)" in done.stdout  # nothing to encode
    assert manifest(split)["shards"] == manifest(droid_shards)["shards"]
    assert {p.name: p.stat().st_mtime_ns for p in split.glob("shard-*")} == written  # the jobs' shards were kept
    assert (split / "samples.npy").read_bytes() == (droid_shards / "samples.npy").read_bytes()

    # Ray (a local instance started by the run): one task per unit, same bytes as the local pool.
    ray_out = tmp_path / "ray"
    build(droid_root, ray_out, "droid", tiny_checkpoints, "--executor", "ray")
    assert manifest(ray_out)["shards"] == manifest(droid_shards)["shards"]

    # Re-running a finished directory rewrites nothing.
    before = {p.name: p.stat().st_mtime_ns for p in split.glob("shard-*")}
    build(droid_root, split, "droid", tiny_checkpoints)
    assert {p.name: p.stat().st_mtime_ns for p in split.glob("shard-*")} == before


def test_kill_and_resume(droid_shards, droid_root, tiny_checkpoints, tmp_path):
    """A stream killed mid-build, resumed by the default executor (the local pool on CPU): the session build's
    bytes, whichever executor wrote which unit."""
    out = tmp_path / "killed"
    threads = json.loads((droid_shards / "inputs.json").read_text())["threads_per_worker"]
    proc = subprocess.Popen(
        shards_cmd(
            droid_root, out, "droid", tiny_checkpoints, "--executor", "stream", "--threads-per-worker", str(threads)
        ),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not list((out / "work").glob("unit-*.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    for tar in out.glob("shard-*.tar"):  # whatever is visible is complete
        with tarfile.open(tar) as t:
            t.getmembers()
    for index in (out / "work").glob("unit-*.json"):  # a unit's JSON only ever follows its complete tar
        assert json.loads(index.read_text())["sha256"] == sha256_file(index.with_suffix(".tar"))
    build(droid_root, out, "droid", tiny_checkpoints)
    assert check(out) == []
    assert manifest(out)["shards"] == manifest(droid_shards)["shards"]


def test_a_truncated_video_is_its_episodes_recorded_failure(droid_root, tiny_checkpoints, tmp_path):
    """(--fail-fast on such an episode: tests/test_bad_episodes.py)"""
    src = tmp_path / "src"
    shutil.copytree(droid_root, src)
    video = src / "videos/chunk-000/observation.images.wrist_image_left/episode_000003.mp4"
    video.write_bytes(video.read_bytes()[:2000])
    out = tmp_path / "out"
    result = build(src, out, "droid", tiny_checkpoints)
    m = manifest(out)
    assert [f["episode"] for f in m["failures"]] == [3]
    assert str(video) in m["failures"][0]["reason"] and "episode 3" in m["failures"][0]["reason"]
    assert "FAILED episode 3" in result.stdout
    assert m["totals"]["samples"] == 6 + 1 and check(out) == []


def corrupt_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_check_finds_corruption(droid_shards, tmp_path):
    first = manifest(droid_shards)["shards"][0]["shard"]

    flipped = corrupt_copy(droid_shards, tmp_path / "flip")
    data = bytearray((flipped / first).read_bytes())
    data[700] ^= 0xFF
    (flipped / first).write_bytes(bytes(data))
    assert f"{first}: sha256 differs from the manifest" in check(flipped)

    truncated = corrupt_copy(droid_shards, tmp_path / "trunc")
    (truncated / first).write_bytes((truncated / first).read_bytes()[:5000])
    problems = check(truncated)
    assert any(p.startswith(f"{first}: truncated or unreadable tar") for p in problems), problems
    assert any(p.startswith(f"{first}: ") and "bytes, the manifest says" in p for p in problems)

    deleted = corrupt_copy(droid_shards, tmp_path / "del")
    members = [
        (i, cast(IO[bytes], t.extractfile(i)).read())  # every member a file
        for t in [tarfile.open(deleted / first)]
        for i in t.getmembers()
    ]
    victim = next(i.name for i, _ in members if i.name.endswith(".clip.npy") or ".clip.npy" in i.name)
    with tarfile.open(deleted / first, "w", format=tarfile.USTAR_FORMAT) as tar:
        for info, data in members:
            if info.name != victim:
                tar.addfile(info, __import__("io").BytesIO(data))
    key = victim.split(".")[0]
    problems = check(deleted)
    assert any(p.startswith(f"{first}: sample {key}: member clip.npy") and "missing" in p for p in problems), problems

    assert check(tmp_path / "nowhere") == [
        f"{tmp_path / 'nowhere' / 'manifest.json'}: missing (an unfinished run, or not a shard directory)"
    ]


def test_check_cli_exit_codes(droid_shards, tmp_path, capsys):
    ok = subprocess.run(
        [sys.executable, "-m", "preprocess", "check", str(droid_shards)], cwd=ROOT, capture_output=True, text=True
    )
    assert ok.returncode == 0 and ok.stdout.startswith("OK:")
    bad = corrupt_copy(droid_shards, tmp_path / "bad")
    os.remove(bad / manifest(bad)["shards"][1]["shard"])
    with pytest.raises(SystemExit) as failed:  # the CLI's entry point, in this process
        preprocess_main(["check", str(bad)])
    assert failed.value.code == 1 and "shard-000001.tar: missing" in capsys.readouterr().out


def test_tiny_trainer_runs_on_pipeline_shards(droid_shards, tmp_path):
    """The shards `preprocess shards` writes are what `train/main.py` reads: the tiny preset takes its widths from
    them (the tiny CLIP's are the released ones, so the export's CLIP branch is the official shape); a real preset
    whose widths differ is refused with the fields named."""
    run = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "train/main.py",
        "--data.shards",
        str(droid_shards),
        "--metrics.no-progress",
    ]
    out = subprocess.run(
        run
        + ["--preset", "tiny", "--steps", "4", "--metrics.interval", "2", "--checkpoint.dir", str(tmp_path / "tiny")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 4 | loss" in out.stdout
    export = tmp_path / "tiny" / "export" / "model.safetensors"
    with safe_open(export, "pt") as f:  # the official DiT projects CLIP features from ViT-H/14's width
        assert f.get_slice("img_emb.proj.1.weight").get_shape() == [OFFICIAL_CLIP_DIM, OFFICIAL_CLIP_DIM]
    assert "official loader stops" not in out.stdout + out.stderr
    refused = subprocess.run(
        run + ["--preset", "droid-5b", "--checkpoint.dir", str(tmp_path / "5b")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert "does not fit --model.name droid-5b: text_dim: model 4096, shards 32" in said
    assert "image_dim" not in said  # the tiny CLIP gives the released 1280-wide features
