"""Named recipes: one YAML file per recipe (tiny.yaml, libero-5b.yaml, ...) read by both CLIs, plus datasets.yaml.

A recipe's sections: `preprocess` (fields of `python -m preprocess shards`), `train` (fields of the trainer's
Config), `dit` (the DiT's shape), `synthetic` (per-sample shapes of synthetic shards) and `throughput` (the
measured auto settings). `--config` of either CLI takes a recipe name or a YAML file of the same layout, such as
the config.yaml a training run saves in its run directory.

Every YAML file the project reads goes through `read`, within bounds no real config comes near: at most MAX_BYTES
of UTF-8, MAX_NODES values counted with every alias expanded (an alias bomb stops while being read, before anything
is built), MAX_DEPTH levels of nesting. A file outside them, or not YAML, stops with one line: the file, the line
and why; values shown in messages are cut to 80 characters.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from yaml.composer import ComposerError

from wampipe.errors import UsageError

DIR = Path(__file__).resolve().parent
DATASETS_FILE = DIR / "datasets.yaml"


def names() -> list[str]:
    """The recipe names: the YAML files here other than datasets.yaml."""
    return sorted(p.stem for p in DIR.glob("*.yaml") if p != DATASETS_FILE)


MAX_BYTES = 1 << 20  # recipes are a few KiB, an official checkpoint's conf.yaml some tens
MAX_NODES = 100_000  # values, aliases expanded
MAX_DEPTH = 64  # nested mappings and sequences


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts the values it composes (an alias as all the values it repeats) and their nesting."""

    def __init__(self, stream):
        super().__init__(stream)
        self.nodes, self.depth, self.sizes = 0, 0, {}

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            if id(node) not in self.sizes:  # not composed yet: the alias sits inside its own anchor
                raise ComposerError(None, None, "an alias inside its own anchor", mark)
            self._count(self.sizes[id(node)], mark)
            return node
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
        before = self.nodes
        self._count(1, mark)
        node = super().compose_node(parent, index)
        self.depth -= 1
        self.sizes[id(node)] = self.nodes - before
        return node

    def _count(self, nodes: int, mark) -> None:
        self.nodes += nodes
        if self.nodes > MAX_NODES:
            raise ComposerError(None, None, f"more than {MAX_NODES} values with aliases expanded", mark)

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as err:  # e.g. an int of too many digits, a date that does not exist
            raise yaml.constructor.ConstructorError(None, None, str(err), node.start_mark) from None


def read(path: Path, error: type[Exception] = UsageError) -> dict:
    """The YAML mapping in `path`, read within the bounds above; anything else raises `error` (a WampipeError subclass
    that takes one message) with one line naming the file (and the line) and what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as err:
        raise error(f"{path}: unreadable config ({err.strerror})") from None
    if len(raw) > MAX_BYTES:
        raise error(f"{path}: larger than {MAX_BYTES >> 20} MiB, the most a config may be")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start})") from None
    try:
        data = yaml.load(text, _BoundedLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f"line {mark.line + 1}: " if mark else ""
        raise error(f"{path}: {line}{shown(err.problem or err.context, quote=False)}") from None
    except yaml.reader.ReaderError as err:  # a character YAML does not allow
        line = text.count("\n", 0, err.position) + 1
        raise error(f"{path}: line {line}: character {err.character:#x} is not allowed in YAML") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a YAML mapping")
    return data


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80


def shown(value: Any, quote: bool = True) -> str:
    """`value` for an error message: its repr (or, with quote=False, the string itself) cut to 80 characters."""
    text = _SHORT.repr(value) if quote else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def path_of(name_or_file: str) -> Path:
    """The file of a recipe name, or the given file; one line with the choices when it is neither."""
    if name_or_file in names():
        return DIR / f"{name_or_file}.yaml"
    if Path(name_or_file).is_file():
        return Path(name_or_file)
    raise UsageError(f"--config {name_or_file}: no such file and no such recipe (recipes: {', '.join(names())})")


def recipe(name: str) -> dict:
    """The sections of a named recipe; one line with the choices for an unknown name."""
    if name not in names():
        raise UsageError(f"unknown recipe {name!r}; choose one of {names()}")
    return read(DIR / f"{name}.yaml")


def section(data: dict, key: str, where: Path | str) -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise UsageError(f"{where}: section {key!r} is not a mapping")
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
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in (values or {})
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise UsageError(f"{where}: missing key {missing[0]!r}")
    return cls(**_fields(cls, values, where))


def _fields(cls: type, values: dict, where: str, current: Any = None) -> dict:
    if not isinstance(values, dict):
        raise UsageError(f"{where}: expected a mapping, got {shown(values)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(f"{where}: unknown key {shown(unknown[0])} (known: {', '.join(sorted(known))})")
    out = {}
    for key, value in values.items():
        nested = getattr(current, key, None)
        out[key] = (
            apply(nested, value, f"{where}.{key}")
            if dataclasses.is_dataclass(nested)
            else _convert(hints[key], value, f"{where}.{key}")
        )
    return out


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if value == "auto" and set(args) == {bool, type(None)}:
            return None  # an on/off setting's auto, None in Python (train/config.py says why)
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, where)
            except UsageError:
                continue
    elif origin is Literal:
        if value in args:
            return value
        raise UsageError(f"{where}: {shown(value)} is not one of {list(args)}")
    elif origin in (tuple, list) and isinstance(value, (list, tuple)):
        items = args[:1] * len(value) if origin is list or (len(args) == 2 and args[1] is Ellipsis) else args
        if len(items) == len(value):
            return origin(_convert(t, v, f"{where}[{i}]") for i, (t, v) in enumerate(zip(items, value)))
    elif dataclasses.is_dataclass(tp) and isinstance(value, dict):  # e.g. a mixture's {shards, weight}
        return build(typing.cast(type, tp), value, where)  # a type hint, so the class and not an instance
    elif tp is Path and isinstance(value, str):
        return Path(value)
    elif tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:  # PyYAML reads 1e-5 (no dot) as a string
            number = float(value)
        except (ValueError, OverflowError):
            number = None
        if number is not None:
            if not math.isfinite(number):
                raise UsageError(f"{where}: {shown(value)} is not a finite number")
            return number
    elif tp is Any or (isinstance(tp, type) and isinstance(value, tp) and (tp is bool or not isinstance(value, bool))):
        return value
    raise UsageError(f"{where}: {shown(value)} is not of type {getattr(tp, '__name__', tp)}")


def nonfinite(instance: Any, prefix: str = "--") -> list[str]:
    """`--section.field value` of each float field of dataclass `instance` (nested ones and tuples included) that
    holds inf or nan: flags parse them as floats, and no setting means them."""
    out = []
    for f in dataclasses.fields(instance):
        value, flag = getattr(instance, f.name), prefix + f.name.replace("_", "-")
        if dataclasses.is_dataclass(value):
            out += nonfinite(value, flag + ".")
            continue
        numbers = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            out.append(f"{flag} {value}")
    return out


def plain(instance: Any) -> dict:
    """A dataclass as YAML-safe plain values (paths as strings, tuples as lists): what `apply` reads back."""

    def convert(value: Any) -> Any:
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
