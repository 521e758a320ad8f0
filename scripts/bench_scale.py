"""Cost per sample of the metadata path, from 10^4 samples up: finalize, check, the sample index's open, a trainer's
start to its first step and the object reads at that start, each in a process of its own (wall time and peak RSS).

    python scripts/bench_scale.py --sizes 10000 100000 1000000 --metadata-only 10000000

Builds are synthetic shards of the tiny recipe written by the project's own unit writer and finalize (one template
sample's tensors under every key, so generating 10^6 samples takes a minute, not an hour); the metadata-only index
has no tar payloads (sparse shard files of the recorded sizes) and measures the index's open alone. Each figure is
printed as a JSON line, then the fitted growth: the exponent of time in the sample count and the bytes of peak RSS
per sample (least squares over the sizes). Everything is written under --work and removed after unless --keep.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

import numpy as np

from wampipe.configs.cli import cli
from wampipe.errors import entry_point

ROOT = Path(__file__).resolve().parents[1]
WINDOWS_PER_EPISODE = 100
EPISODES_PER_UNIT = 10


@dataclass
class Args:
    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    """Sample counts of the synthetic builds (finalize, check, open, trainer start)."""
    metadata_only: int = 10_000_000
    """Samples of the metadata-only index (open only; 0 skips it)."""
    finalize_workers: tuple[int, ...] = (1, 2)
    """Finalize runs at each size, one per count of processes writing shards."""
    trainer_ranks: tuple[int, ...] = (1, 2)
    """Trainer starts at each size, one per count of ranks (each with --loader-workers loader workers)."""
    loader_workers: int = 2
    """Loader workers per trainer rank."""
    mixture_sets: int = 3
    """At each size, a trainer start on this many sets of it at once (hard-linked copies, one --data.mixture; below 2:
    none)."""
    val_fraction: float = 0.05
    """At each size, a second finalize that holds this fraction of the episodes out into a validation split, then a
    trainer start that validates on it at its step (0: none)."""
    s3_sizes: tuple[int, ...] = (2_000, 10_000)
    """Builds uploaded to a local S3 server (moto) whose trainer start's requests are counted (empty: none)."""
    samples_per_shard: int = 256
    """Samples per shard of every build."""
    work: Path = ROOT / "build" / "bench_scale"
    """Where the builds are written (about 10 KB per sample)."""
    keep: bool = False
    """Keep the builds under --work."""


# Linux counts a process's peak RSS from its fork: a child of this (large) process would report at least this
# process's size. So a small launcher forks the measured command and reports the rusage wait4 gives it, the peak of
# the largest process of the command's tree (the command and every descendant it waited for).
LAUNCH = (
    "import os, sys\npid = os.fork()\nif pid == 0:\n    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "_, status, usage = os.wait4(pid, 0)\nopen(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def run_measured(command: list[str], env: dict | None = None) -> dict:
    """Wall seconds and the peak RSS (MB) of the largest process of `command`'s tree (`LAUNCH`)."""
    report = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-scale-rss-{os.getpid()}"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-S", "-c", LAUNCH, str(report), *map(str, command)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    wall = time.perf_counter() - start
    text = done.stdout.decode(errors="replace")
    if done.returncode:
        raise SystemExit(f"{' '.join(map(str, command[:6]))} ...: exit {done.returncode}\n{text[-3000:]}")
    peak = int(report.read_text()) / 1024
    report.unlink()
    return {"wall_s": round(wall, 2), "peak_rss_mb": round(peak, 1), "output": text}


# ---------------------------------------------------------------- builds


def template_dir(work: Path) -> Path:
    """A small synthetic build whose first sample, text table and statistics every bench build reuses."""
    from devtools.synthetic import make_synthetic_shards

    path = work / "template"
    if not (path / "manifest.json").is_file():
        shutil.rmtree(path, ignore_errors=True)
        make_synthetic_shards(path, "tiny", episodes=2, windows_per_episode=2, samples_per_shard=4, compress="none")
    return path


def write_units(out: Path, n: int, template: Path) -> None:
    """Units of `n` samples in the real unit format (write.write_unit), each sample the template's tensors under its
    own key with its own meta.json."""
    from wampipe.preprocess import write
    from wampipe.preprocess.check import tar_samples
    from wampipe.shardformat.keys import sample_key
    from wampipe.shardformat.layout import META

    with open(template / "shard-000000.tar", "rb") as f:
        _, members = next(tar_samples(f))
    meta = json.loads(members[META])
    tensors = [(suffix, data) for suffix, data in members.items() if suffix != META]
    episodes = -(-n // WINDOWS_PER_EPISODE)
    for unit, first in enumerate(range(0, episodes, EPISODES_PER_UNIT)):
        eps = list(range(first, min(first + EPISODES_PER_UNIT, episodes)))

        def samples():
            for ep in eps:
                for w in range(min(WINDOWS_PER_EPISODE, n - ep * WINDOWS_PER_EPISODE)):
                    key = sample_key(meta["dataset"], ep, w * 8, 0)
                    m = {
                        **meta,
                        "episode": ep,
                        "window_start": w * 8,
                        "anchor_multiplicity": 3 if w == 0 else 2 if w == WINDOWS_PER_EPISODE - 1 else 1,
                    }
                    yield key, [*((f"{key}.{s}", d) for s, d in tensors), (f"{key}.{META}", json.dumps(m).encode())]

        write.write_unit(
            out, unit, samples(), {"episodes": eps, "failures": [], "skipped": [], "encoded": eps, "prompts": {}}
        )
    for name in ("metadata.json", "text"):
        src, dst = template / name, out / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    (out / "bench-units.json").write_text(json.dumps({"units": unit + 1, "samples": n}))


def finalize_units(out: Path, workers: int, samples_per_shard: int, val_every: int = 0) -> None:
    """The finalize of preprocess (mix: plan, shard tasks, sample index) and the manifest, over the units of `out`;
    with `val_every`, every val_every-th episode held out into the validation split out/val first, as finalize does
    with --val-episodes."""
    from wampipe.preprocess import write
    from wampipe.preprocess.finalize import mix
    from wampipe.preprocess.validation import split_summaries
    from wampipe.shardformat.layout import VAL_DIR
    from wampipe.shardformat.manifest import Manifest, build_manifest

    units = json.loads((out / "bench-units.json").read_text())["units"]
    template = Manifest.read(out.parent / "template").to_dict()
    summaries = [write.summarize_unit(out, u) for u in range(units)]
    held = [e for s in summaries for e in s["encoded"] if val_every and e % val_every == 0]
    splits = [(out, summaries, None)]
    if held:
        train, val = split_summaries(summaries, held)
        record = {"choice": f"every {val_every}th", "episodes": held}
        splits = [
            (out / VAL_DIR, val, {"split": "val", **record}),
            (out, train, {"split": "train", **record, "val_dir": VAL_DIR}),
        ]
        for name in ("metadata.json", "text"):
            src, dst = out / name, out / VAL_DIR / name
            if not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    keep = (
        "source",
        "dataset",
        "embodiment",
        "model",
        "modality_keys",
        "transform",
        "encoders",
        "compress",
        "text_table",
        "statistics",
    )
    for into, part, validation in splits:
        mixed = mix(out, into, part, samples_per_shard, 0, held, validation, template["dataset"], workers)
        assert mixed is not None  # mix returns None only for one part of an array job (`part`), not passed here
        shards, sample_index, member_bytes = mixed
        manifest = build_manifest(
            part,
            shards,
            **{k: template[k] for k in keep},
            samples_per_shard=samples_per_shard,
            seed=0,
            sample_index=sample_index,
            member_bytes=member_bytes,
            validation=validation or {},
        )
        manifest.write(into)


def clear_finalize(out: Path) -> None:
    """Remove what finalize wrote (shards, their JSONs, the index, the manifest, the plan, a validation split),
    keeping the units."""
    for pattern in ("shard-*.tar", "shard-*.json", "samples.npy", "manifest.json", "wids.json", "work/plan-*", "val"):
        for path in out.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def metadata_only(out: Path, n: int, template: Path, samples_per_shard: int) -> None:
    """A sealed directory of `n` samples whose shards are sparse files: the index and manifest are real."""
    from wampipe.shardformat.files import sha256_file
    from wampipe.shardformat.layout import SAMPLE_INDEX, shard_file
    from wampipe.shardformat.manifest import Manifest
    from wampipe.shardformat.samples import member_names, row_dtype

    manifest = Manifest.read(template)
    names = member_names(manifest.schema)
    sizes = {"meta.json": 400, **{f"{t}.npy": 128 for t in manifest.schema}}
    slots = len(sizes)
    span = sum(-(-s // 512) * 512 + 512 for s in sizes.values())
    shards = -(-n // samples_per_shard)
    rows = np.zeros(n, row_dtype(slots))
    rows["episode"] = np.arange(n) // WINDOWS_PER_EPISODE
    rows["start"] = np.arange(n) % WINDOWS_PER_EPISODE * 8
    w = np.arange(n) % WINDOWS_PER_EPISODE
    rows["multiplicity"] = np.where(w == 0, 3, np.where(w == WINDOWS_PER_EPISODE - 1, 2, 1))
    position = np.random.default_rng(0).permutation(n)
    rows["shard"] = position // samples_per_shard
    base = (position % samples_per_shard).astype(np.uint64) * span
    offset = 512
    for slot, (name, size) in enumerate(sorted(sizes.items())):
        rows["member"][:, slot] = names.index(name)
        rows["offset"][:, slot] = base + offset
        rows["size"][:, slot] = size
        offset += -(-size // 512) * 512 + 512
    out.mkdir(parents=True)
    counts = np.bincount(rows["shard"], minlength=shards)
    entries = []
    for s in range(shards):
        path = out / shard_file(s)
        with open(path, "wb") as f:
            f.truncate(int(counts[s]) * span + 1024)
        entries.append(
            {"shard": path.name, "count": int(counts[s]), "bytes": int(counts[s]) * span + 1024, "sha256": "0" * 64}
        )
    np.save(out / SAMPLE_INDEX, rows, allow_pickle=False)
    for name in ("metadata.json", "text"):
        (shutil.copytree if (template / name).is_dir() else shutil.copy)(template / name, out / name)
    d = manifest.to_dict()
    d.update(
        shards=entries,
        totals={**d["totals"], "samples": n, "shards": shards},
        sample_index={"file": SAMPLE_INDEX, "sha256": sha256_file(out / SAMPLE_INDEX), "count": n, "members": names},
    )
    Manifest.from_dict(d).write(out)


# ---------------------------------------------------------------- measurements


# the open alone, after the imports every trainer process makes anyway
OPEN = (
    "import sys, time; from wampipe.shardformat.index import ShardIndex; t = time.perf_counter(); "
    "i = ShardIndex(sys.argv[1]); print('OPEN', time.perf_counter() - t, len(i))"
)


def open_index_cost(root: str, env: dict | None = None) -> dict:
    r = run_measured([sys.executable, "-c", OPEN, root], env)
    line = next(x for x in r.pop("output").splitlines() if x.startswith("OPEN"))
    return {**r, "open_s": round(float(line.split()[1]), 3)}


def linked_copy(root: Path, to: Path) -> Path:
    """A shard directory at `to` whose files are hard links of `root`'s finished files (another set, no bytes)."""
    shutil.rmtree(to, ignore_errors=True)
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.is_file() and rel.parts[0] not in ("work", "val") and not rel.name.startswith("bench-"):
            (to / rel).parent.mkdir(parents=True, exist_ok=True)
            os.link(path, to / rel)
    return to


def trainer_start(roots: Path | list[Path], ranks: int, loader_workers: int, run_dir: Path) -> dict:
    """A trainer's start to its first step (and its validation, where a set has a split) on one set or a mixture."""
    shutil.rmtree(run_dir, ignore_errors=True)
    data = (
        ["--data.shards", str(roots)]
        if isinstance(roots, Path)
        else ["--data.mixture", *(f"{root}=1" for root in roots)]
    )
    r = run_measured(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            "train/main.py",
            "--preset",
            "tiny",
            *data,
            "--steps",
            "1",
            "--checkpoint.dir",
            str(run_dir),
            "--checkpoint.no-save-final",
            "--checkpoint.no-export",
            "--metrics.no-tensorboard",
            "--metrics.no-progress",
            "--data.num-workers",
            str(loader_workers),
        ]
    )
    r.pop("output")
    return r


def s3_reads(root: Path, work: Path) -> dict:
    from devtools.s3 import S3Server
    from wampipe.shardformat.storage import ShardStore, sync_up

    server = S3Server(work / "s3.log").start()
    try:
        env = server.env()
        os.environ.update(env)
        bucket = f"bench-{root.name}"
        ShardStore(f"s3://{bucket}").fs.mkdir(bucket)
        sync_up(root, f"s3://{bucket}/shards")
        before = len(server.requests())
        r = open_index_cost(f"s3://{bucket}/shards", env)
        requests = server.requests()[before:]
        r["requests"] = len(requests)
        r["gets"] = sum(m == "GET" for m, _, _ in requests)
        r["shard_json_gets"] = sum(m == "GET" and p.endswith(".json") and "/shard-" in p for m, p, _ in requests)
        return r
    finally:
        server.stop()


def fit(rows: list[dict], field: str) -> dict:
    """Exponent of `field` in the sample count (log-log least squares) and its growth per sample (linear)."""
    n = np.array([r["samples"] for r in rows], np.float64)
    y = np.array([r[field] for r in rows], np.float64)
    if len(rows) < 2:
        return {}
    exponent = np.polyfit(np.log(n), np.log(np.maximum(y, 1e-9)), 1)[0]
    slope = np.polyfit(n, y, 1)[0]
    return {"exponent": round(float(exponent), 3), "per_sample": float(slope)}


def main(args: Args) -> None:
    args.work.mkdir(parents=True, exist_ok=True)
    template = template_dir(args.work)
    results: dict[str, list[dict]] = {}

    def report(kind: str, **row) -> None:
        results.setdefault(kind, []).append(row)
        print(json.dumps({"what": kind, **row}), flush=True)

    for n in args.sizes:
        out = args.work / f"n{n}"
        if not (out / "bench-units.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            t = time.perf_counter()
            write_units(out, n, template)
            print(f"units of {n} samples written in {time.perf_counter() - t:.1f} s", flush=True)
        for workers in args.finalize_workers:
            clear_finalize(out)
            r = run_measured(
                [sys.executable, __file__, "--finalize-only", str(out), str(workers), str(args.samples_per_shard)]
            )
            r.pop("output")
            report(f"finalize_{workers}", samples=n, **r)
        r = run_measured([sys.executable, "-m", "wampipe.preprocess", "check", str(out), "--no-members"])
        r.pop("output")
        report("check", samples=n, **r)
        report("open", samples=n, **open_index_cost(str(out)))
        for ranks in args.trainer_ranks:
            report(
                f"trainer_start_{ranks}", samples=n, **trainer_start(out, ranks, args.loader_workers, args.work / "run")
            )
        if args.mixture_sets >= 2:
            sets = [out] + [linked_copy(out, args.work / f"n{n}-set{k}") for k in range(1, args.mixture_sets)]
            report(
                "trainer_start_mixture",
                samples=n,
                sets=len(sets),
                **trainer_start(sets, 1, args.loader_workers, args.work / "run"),
            )
            for extra in sets[1:]:
                shutil.rmtree(extra)
        if args.val_fraction:
            every = max(2, round(1 / args.val_fraction))
            clear_finalize(out)
            r = run_measured(
                [
                    sys.executable,
                    __file__,
                    "--finalize-only",
                    str(out),
                    str(max(args.finalize_workers)),
                    str(args.samples_per_shard),
                    str(every),
                ]
            )
            r.pop("output")
            report("finalize_val", samples=n, val_every=every, workers=max(args.finalize_workers), **r)
            report("trainer_start_val", samples=n, **trainer_start(out, 1, args.loader_workers, args.work / "run"))
        if n in args.s3_sizes:
            report("s3_open", samples=n, **s3_reads(out, args.work))
    for n in [s for s in args.s3_sizes if s not in args.sizes]:
        out = args.work / f"n{n}"
        if not (out / "manifest.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            write_units(out, n, template)
            finalize_units(out, 1, args.samples_per_shard)
        report("s3_open", samples=n, **s3_reads(out, args.work))
    if args.metadata_only:
        out = args.work / f"meta{args.metadata_only}"
        shutil.rmtree(out, ignore_errors=True)
        metadata_only(out, args.metadata_only, template, args.samples_per_shard)
        report("open", samples=args.metadata_only, metadata_only=True, **open_index_cost(str(out)))
    for kind, rows in results.items():
        for field in ("wall_s", "peak_rss_mb", "open_s"):
            if rows and field in rows[0]:
                print(json.dumps({"fit": kind, "field": field, **fit([r for r in rows if "samples" in r], field)}))
    if not args.keep:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        if len(sys.argv) in (5, 6) and sys.argv[1] == "--finalize-only":  # the measured child of a finalize run
            finalize_units(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int((sys.argv[5:] or [0])[0]))
        else:
            main(cli(Args, description=__doc__))
