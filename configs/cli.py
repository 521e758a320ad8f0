"""The one way every command line of the project is parsed: tyro over a dataclass whose field docstrings are the
help text.

A field docstring spans several source lines, its continuation lines indented with the class body. tyro keeps a line
break before every line that does not start with a letter, an indented one included, so `--help` broke sentences at
the source's line ends. `cli` parses through a tyro constructor registry (tyro's public extension point) whose one
rule takes tyro's own description of each dataclass and flows each field's help into one sentence-wrapped text;
blank lines still separate paragraphs.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any, Callable, NoReturn, TypeVar

import tyro
from tyro.constructors import ConstructorRegistry, StructConstructorSpec, StructTypeInfo

from wampipe.errors import UsageError

T = TypeVar("T")
REGISTRY = ConstructorRegistry()
_asking_tyro = threading.local()  # set while the rule asks tyro's own rules, so it does not answer itself


def flowing(text: str | None) -> str | None:
    """`text` with the line breaks inside each paragraph turned into spaces."""
    if text is None:
        return None
    return "\n\n".join(
        " ".join(line.strip() for line in paragraph.splitlines()) for paragraph in re.split(r"\n\s*\n", text)
    )


def _flowed(helptext: str | Callable[[], str | None] | None) -> str | Callable[[], str | None] | None:
    """`helptext` flowing; tyro reads a docstring lazily (a callable), so this stays lazy too."""
    if callable(helptext):
        return lambda: flowing(helptext())
    return flowing(helptext)


@REGISTRY.struct_rule
def _flowing_help(info: StructTypeInfo) -> Any:
    """A dataclass as tyro's own rules describe it, each field's help flowing; None (tyro decides) otherwise."""
    if getattr(_asking_tyro, "now", False) or not dataclasses.is_dataclass(info.type):
        return None
    _asking_tyro.now = True
    try:
        spec = ConstructorRegistry.get_struct_spec(info)
    finally:
        _asking_tyro.now = False
    if not isinstance(spec, StructConstructorSpec):
        return spec
    return dataclasses.replace(
        spec, fields=tuple(dataclasses.replace(f, helptext=_flowed(f.helptext)) for f in spec.fields)
    )


def cli(cls: type[T], **kwargs: Any) -> T:
    """`tyro.cli(cls, **kwargs)` with each field's help flowing as sentences."""
    return tyro.cli(cls, registry=REGISTRY, **kwargs)


class FlagError(UsageError):
    """Flags that do not go together, or a value out of a command's range that the parser took: at the entry point
    one line on stderr and exit status 2, as for a flag tyro rejects."""

    exit_status = 2


def refuse(message: str) -> NoReturn:
    """Refuse the command's flags in one line (`FlagError`: exit status 2, as for a flag tyro rejects)."""
    raise FlagError(message)


def check_at_least(*checks: tuple[str, int | None, int]) -> None:
    """(flag, value, lower bound) each: the first value below its bound is refused in one line naming the flag (None
    means not given)."""
    for flag, value, least in checks:
        if value is not None and value < least:
            raise UsageError(f"{flag} must be at least {least}, got {value}")
