"""Named recipes: one YAML file per recipe (tiny.yaml, libero-5b.yaml, ...) read by both CLIs, plus datasets.yaml.

A recipe's sections: `preprocess` (fields of `python -m preprocess shards`), `train` (fields of the trainer's
Config), `dit` (the DiT's shape), `synthetic` (per-sample shapes of synthetic shards) and `throughput` (the
measured auto settings). `--config` of either CLI takes a recipe name or a YAML file of the same layout, such as
the config.yaml a training run saves in its run directory.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

DIR = Path(__file__).resolve().parent
DATASETS_FILE = DIR / "datasets.yaml"


def names() -> list[str]:
    """The recipe names: the YAML files here other than datasets.yaml."""
    return sorted(p.stem for p in DIR.glob("*.yaml") if p != DATASETS_FILE)


def read(path: Path) -> dict:
    """A YAML mapping, or one line naming the file and what is wrong."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise SystemExit(f"{path}: unreadable config ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: not a mapping of sections")
    return data


def path_of(name_or_file: str) -> Path:
    """The file of a recipe name, or the given file; one line with the choices when it is neither."""
    if name_or_file in names():
        return DIR / f"{name_or_file}.yaml"
    if Path(name_or_file).is_file():
        return Path(name_or_file)
    raise SystemExit(f"--config {name_or_file}: no such file and no such recipe (recipes: {', '.join(names())})")


def recipe(name: str) -> dict:
    """The sections of a named recipe; one line with the choices for an unknown name."""
    if name not in names():
        raise SystemExit(f"unknown recipe {name!r}; choose one of {names()}")
    return read(DIR / f"{name}.yaml")


def section(data: dict, key: str, where: Path | str) -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise SystemExit(f"{where}: section {key!r} is not a mapping")
    return value


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in a command line (`--flag V` or `--flag=V`; the last one wins, as in the parsers)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def apply(instance: Any, values: dict, where: str) -> Any:
    """A copy of dataclass `instance` with `values` (nested mappings for nested dataclasses) converted to the field
    types; an unknown key or a value of the wrong type stops with one line naming `where` and the key."""
    return dataclasses.replace(instance, **_fields(type(instance), values, where, instance))


def build(cls: type, values: dict, where: str) -> Any:
    """A `cls` dataclass of `values` as `apply` converts them; every field without a default must be given."""
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in (values or {})
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise SystemExit(f"{where}: missing key {missing[0]!r}")
    return cls(**_fields(cls, values, where))


def _fields(cls: type, values: dict, where: str, current: Any = None) -> dict:
    if not isinstance(values, dict):
        raise SystemExit(f"{where}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SystemExit(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    out = {}
    for key, value in values.items():
        nested = getattr(current, key, None)
        out[key] = (apply(nested, value, f"{where}.{key}") if dataclasses.is_dataclass(nested)
                    else _convert(hints[key], value, f"{where}.{key}"))
    return out


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, where)
            except SystemExit:
                continue
    elif origin is Literal:
        if value in args:
            return value
        raise SystemExit(f"{where}: {value!r} is not one of {list(args)}")
    elif origin in (tuple, list) and isinstance(value, (list, tuple)):
        items = args[:1] * len(value) if origin is list or (len(args) == 2 and args[1] is Ellipsis) else args
        if len(items) == len(value):
            return origin(_convert(t, v, f"{where}[{i}]") for i, (t, v) in enumerate(zip(items, value)))
    elif dataclasses.is_dataclass(tp) and isinstance(value, dict):  # e.g. a mixture's {shards, weight}
        return build(tp, value, where)
    elif tp is Path and isinstance(value, str):
        return Path(value)
    elif tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:  # PyYAML reads 1e-5 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    elif tp is Any or (isinstance(tp, type) and isinstance(value, tp) and (tp is bool or not isinstance(value, bool))):
        return value
    raise SystemExit(f"{where}: {value!r} is not of type {getattr(tp, '__name__', tp)}")


def plain(instance: Any) -> dict:
    """A dataclass as YAML-safe plain values (paths as strings, tuples as lists): what `apply` reads back."""
    def convert(value):
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        return str(value) if isinstance(value, Path) else value

    return convert(dataclasses.asdict(instance))


def write(path: Path, sections: dict, comment: str) -> None:
    """Write `sections` as a recipe-layout YAML file headed by a comment line."""
    text = yaml.safe_dump(sections, sort_keys=False, default_flow_style=False)
    Path(path).write_text(f"# {comment}\n{text}")
