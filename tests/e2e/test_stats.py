"""metadata.json statistics against a direct numpy computation on the sample datasets."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wampipe.preprocess.__main__ import main as preprocess_main
from wampipe.preprocess.stats import build_metadata
from wampipe.shardformat.embodiments import get_embodiment

from tests.helpers import ROOT


def tree_state(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.e2e
def test_cli_merges_and_never_writes_into_sources(libero_root, libero_v3_root, tmp_path):
    before = tree_state(libero_root), tree_state(libero_v3_root)
    out = tmp_path / "cfg" / "metadata.json"
    cmd = [
        sys.executable,
        "-m",
        "preprocess",
        "stats",
        "--src",
        str(libero_root),
        "--src",
        str(libero_v3_root),
        "--embodiment",
        "libero_sim",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    assert (tree_state(libero_root), tree_state(libero_v3_root)) == before
    merged = json.loads(out.read_text())["libero_sim"]
    single = build_metadata([libero_root], get_embodiment("libero_sim"))["libero_sim"]
    # the v3 copy holds the same rows: the merge of two equal datasets is that dataset
    for stat in ("min", "max", "q01", "q99"):
        assert merged["statistics"]["state"]["state"][stat] == single["statistics"]["state"]["state"][stat]
    np.testing.assert_allclose(
        merged["statistics"]["action"]["actions"]["mean"], single["statistics"]["action"]["actions"]["mean"], rtol=1e-6
    )
    with pytest.raises(SystemExit, match="inside the source dataset"):  # the CLI's entry point, in this process
        preprocess_main(
            [
                "stats",
                "--src",
                str(libero_root),
                "--embodiment",
                "libero_sim",
                "--out",
                str(libero_root / "meta" / "metadata.json"),
            ]
        )
    assert not (libero_root / "meta" / "metadata.json").exists()


@pytest.mark.e2e  # in a process of its own, whose address space is capped
def test_a_length_meta_claims_but_the_rows_lack_fails_its_episode_not_the_allocation(droid_root, tmp_path):
    """episodes.jsonl says 4e10 rows for episode 2 (97 in its parquet): under an 8 GiB address-space cap the
    statistics finish without it, since their arrays grow with the rows read."""
    import resource

    src = Path(shutil.copytree(droid_root, tmp_path / "src"))
    listing = src / "meta" / "episodes.jsonl"
    rows = [json.loads(line) for line in listing.read_text().splitlines()]
    rows[2]["length"] = 4e10
    listing.write_text("\n".join(map(json.dumps, rows)) + "\n")

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "wampipe.preprocess",
            "stats",
            "--src",
            str(src),
            "--embodiment",
            "oxe_droid",
            "--out",
            str(tmp_path / "metadata.json"),
        ],
        capture_output=True,
        text=True,
        preexec_fn=cap,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        f"skipped {src / 'data/chunk-000/episode_000002.parquet'}: episode 2: parquet has 97 rows, meta says "
        f"length 40000000000" in done.stdout.splitlines()
    )
