"""The output directory: one run holds it at a time, and it only ever holds one build.

A run holds an exclusive flock on OUT/.lock for its whole life (array jobs a shared one: together they build one
output); the kernel releases it however the process ends. What the build is made from (preprocess.spec: the
source's fingerprint, every argument that changes output bytes, the encoders' sha256) is recorded in OUT/inputs.json
before any unit, and the part that changes a unit's bytes in every unit's JSON. A run whose inputs differ from those
recorded refuses to start, naming each difference, instead of mixing two builds in one directory; `--overwrite`
deletes the old build (its units only where they differ) first.

A run deletes or replaces only files of a build, never a file someone else put in OUT (`ownership`). The names a
build writes are inputs.json, manifest.json, wids.json, metadata.json, text/embeddings.safetensors,
text/prompts.json, samples.npy, shard-NNNNNN.tar/.json, the same names under val/ (the validation split),
work/unit-NNNNNN.tar/.json/.rows.npy, work/selection.json and finalize's work files (work/plan-train.npy,
work/plan-val.npy and, under work/plan-train/ and work/plan-val/, shard-NNNNNN.tar.rows.npy and
bucket-NNNNNN.rows/.ids). A directory whose
inputs.json is a build's record owns every file at those names. Without one, only what a record names is a build's:
a sealed manifest.json (an older wampipe's) with wids.json and the files it lists, and the units whose JSON records
their inputs. Any other file at those names is foreign: the run refuses to start, naming it, with or without
`--overwrite`, and deletes nothing. Of the hidden files, only the temporaries of shardformat.files (marked
`.*.wampipe-<pid>-<hex>.tmp`) are ever removed.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

from wampipe.errors import UsageError
from wampipe.preprocess.spec import BuildSpec
from wampipe.shardformat.files import atomic_write_json, fsync_dir, is_temporary, lock_directory, temporary_path
from wampipe.shardformat.layout import (
    INPUTS,
    MANIFEST,
    SAMPLE_INDEX,
    SELECTION,
    SHARD_NAME,
    STATISTICS,
    TEXT_PROMPTS,
    TEXT_TABLE,
    UNIT_NAME,
    VAL_DIR,
    WIDS_INDEX,
    WORK_DIR,
)
from wampipe.shardformat.manifest import ShardFormatError, parse_sealed_json

LOCK = ".lock"
# a split's finalize outputs, manifest first
SPLIT_NAMES = (MANIFEST, WIDS_INDEX, STATISTICS, TEXT_TABLE, TEXT_PROMPTS, SAMPLE_INDEX)
FIXED_NAMES = SPLIT_NAMES + tuple(f"{VAL_DIR}/{name}" for name in SPLIT_NAMES)  # the training split's, then val/'s
# the shards (of either split), the units and their JSONs
NUMBERED = re.compile(
    rf"({VAL_DIR}/{SHARD_NAME.pattern}|{SHARD_NAME.pattern}|{WORK_DIR}/{UNIT_NAME.pattern})".replace(
        r"\.tar", r"\.(tar|json|rows\.npy)"
    )
)
# finalize's plan of each split, its shards' rows and the buckets of the sample index (preprocess.write)
PLANS = re.compile(rf"{WORK_DIR}/plan-(train|val)(\.npy|/{SHARD_NAME.pattern}\.rows\.npy|/bucket-\d{{6,}}\.(rows|ids))")


# ---------------------------------------------------------------- one run per directory


@contextmanager
def hold(out: Path, shared: bool = False) -> Iterator[None]:
    """Lock OUT for the block (shardformat.files.lock_directory); exit with a clear message if another run holds it."""
    fd = lock_directory(out / LOCK, "run", "use another --out", shared)
    try:
        yield
    finally:
        os.close(fd)


def remove_temporaries(out: Path) -> None:
    """Delete the temporaries of writes a killed run left behind (only while holding OUT exclusively); a user's
    own hidden files stay."""
    for folder in (
        out,
        out / WORK_DIR,
        out / Path(TEXT_TABLE).parent,
        out / VAL_DIR,
        out / VAL_DIR / Path(TEXT_TABLE).parent,
    ):
        for tmp in folder.glob(".*.tmp"):
            if is_temporary(tmp):
                tmp.unlink()


# ---------------------------------------------------------------- which files are a build's


def ownership(names: Iterable[str], read: Callable[[str], bytes]) -> tuple[list[str], list[str]]:
    """(a build's own, foreign): the files among `names` (paths relative to a shard directory, local or remote)
    at the names a build writes, split by the rule of the module docstring. `read(name)` gives a file's bytes."""
    written = sorted(
        n for n in names if n in (INPUTS, SELECTION) or n in FIXED_NAMES or NUMBERED.fullmatch(n) or PLANS.fullmatch(n)
    )
    if INPUTS in written and is_record(_json(read, INPUTS)):
        return written, []
    own = set()
    try:
        manifest = parse_sealed_json(read(MANIFEST), MANIFEST) if MANIFEST in written else None
    except ShardFormatError:
        manifest = None
    if manifest is not None:
        listed = [s.get("shard", "") for s in manifest.get("shards", [])]
        own |= {
            MANIFEST,
            WIDS_INDEX,
            *listed,
            *(n.replace(".tar", ".json") for n in listed),
            manifest.get("text_table", {}).get("file"),
            manifest.get("text_table", {}).get("prompts"),
            manifest.get("statistics", {}).get("file"),
            manifest.get("sample_index", {}).get("file"),
        }
    for name in written:
        if name.startswith(f"{WORK_DIR}/") and name.endswith(".json"):
            unit = _json(read, name)
            if isinstance(unit, dict) and "inputs" in unit:
                own |= {name, name.replace(".json", ".tar")}
    return [n for n in written if n in own], [n for n in written if n not in own]


# what every wampipe's inputs.json holds: a JSON file at that name without them is a user's, not a build's record
RECORD_KEYS = frozenset({"dataset", "src", "vae", "text_encoder", "image_encoder"})


def is_record(value) -> bool:
    return isinstance(value, dict) and RECORD_KEYS <= value.keys()


def _json(read: Callable[[str], bytes], name: str):
    try:
        return json.loads(read(name))
    except ValueError:
        return None


def local_ownership(out: Path) -> tuple[list[str], list[str]]:
    """`ownership` of the local directory OUT."""
    names = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and not p.is_symlink()]
    return ownership(names, lambda name: (out / name).read_bytes())


def refuse_foreign(where: str, foreign: list[str]) -> None:
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UsageError(
            f"{where} holds files that no wampipe build recorded, at names a build writes: {shown}. "
            f"Nothing was deleted; move them away or use another --out (--overwrite deletes only a "
            f"build's own files)"
        )


# ---------------------------------------------------------------- what a build is made from


def differences(recorded: dict, inputs: dict) -> list[str]:
    """`--flag: old -> new` for every input that differs."""
    return [
        f"--{k.replace('_', '-')}: {_show(recorded.get(k))} -> {_show(inputs.get(k))}"
        for k in sorted(recorded.keys() | inputs.keys())
        if recorded.get(k) != inputs.get(k)
    ]


def _show(value) -> str:
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value):
        return f"sha256 {value[:12]}"  # the source fingerprint and the encoders' hashes
    return str(value)


def conflicts(out: Path, inputs: dict) -> tuple[list[str], bool]:
    """(how OUT's recorded inputs differ from `inputs`, whether its units differ too)."""
    problems: list[str] = []
    units_differ = False
    recorded = out / INPUTS
    if recorded.is_file():
        old = json.loads(recorded.read_text())
        problems += differences(old, inputs)
        units_differ = BuildSpec.unit_inputs(old) != BuildSpec.unit_inputs(inputs)
    elif (out / MANIFEST).is_file():
        problems.append(f"{out / MANIFEST} has no {INPUTS} beside it (an older wampipe wrote it)")
    expected = BuildSpec.unit_inputs(inputs)
    for index in sorted((out / WORK_DIR).glob("unit-*.json")):  # also catches units copied in from elsewhere
        old = json.loads(index.read_text()).get("inputs")
        if old is None:
            problems.append(f"{index} records no inputs (an older wampipe wrote it)")
            units_differ = True
            continue
        old = BuildSpec.unit_inputs(old)
        problems += differences(old, expected)
        units_differ |= old != expected
    return list(dict.fromkeys(problems)), units_differ


def claim(out: Path, inputs: dict, overwrite: bool) -> None:
    """Make OUT the place of the build of `inputs`: resume the build there if it has the same inputs, delete it
    with `overwrite`, refuse otherwise; refuse a foreign file at a name the build writes either way. Then record
    `inputs` (if not yet)."""
    refuse_foreign(str(out), local_ownership(out)[1])
    problems, units_differ = conflicts(out, inputs)
    if problems and overwrite:
        delete_build(out, units=units_differ)
        problems = []
    if not problems and not (out / INPUTS).is_file():
        _write_once(out / INPUTS, inputs)  # array jobs starting together race here: one file wins ...
        problems, _ = conflicts(out, inputs)  # ... and the others compare against it
    if problems:
        raise UsageError(
            f"{out} holds a build made from other inputs: {'; '.join(problems)}. Pass the old values to "
            f"resume it, or use another --out, or --overwrite to delete the old build"
        )


def _write_once(path: Path, obj: dict) -> None:
    staged = temporary_path(path)
    atomic_write_json(staged, obj)
    try:
        os.link(staged, path)  # atomic and never replaces an existing file
    except FileExistsError:
        pass
    finally:
        staged.unlink()
    fsync_dir(path.parent)


def delete_build(out: Path, units: bool) -> None:
    """Delete the build's own files (`ownership`) from OUT: the finalize outputs (manifest first, so the directory
    stops claiming to be complete), with `units` the unit spills too, then the recorded inputs."""
    own = local_ownership(out)[0]
    first = [n for n in FIXED_NAMES if n in own]
    numbered = [n for n in own if NUMBERED.fullmatch(n) and (units or not n.startswith(f"{WORK_DIR}/"))]
    plans = [n for n in own if PLANS.fullmatch(n)]
    selection = [n for n in own if n == SELECTION and units]  # it decides the units: it goes with them
    for name in first + numbered + plans + selection + [n for n in own if n == INPUTS]:
        (out / name).unlink()
    for split in ("train", "val"):  # the plans' folders, once empty
        folder = out / WORK_DIR / f"plan-{split}"
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
