"""The one way every command line of the project is parsed: tyro over a dataclass whose field docstrings are the
help text.

A field docstring spans several source lines, its continuation lines indented with the class body. tyro keeps a line
break before every line that does not start with a letter, an indented one included, so `--help` broke sentences at
the source's line ends. `cli` flows each paragraph of a field's help into one sentence-wrapped text; blank lines
still separate paragraphs.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn, TypeVar

import tyro
from tyro import _docstrings

from wampipe.errors import UsageError

T = TypeVar("T")
_field_docstring = getattr(_docstrings, "get_field_docstring", None)  # tyro's own, private: absent, help is as tyro's


def flowing(text: str | None) -> str | None:
    """`text` with the line breaks inside each paragraph turned into spaces."""
    if text is None:
        return None
    return "\n\n".join(" ".join(line.strip() for line in paragraph.splitlines())
                       for paragraph in re.split(r"\n\s*\n", text))


def _flowing_field_docstring(*args: Any) -> str | None:
    assert _field_docstring is not None  # cli installs this function only when tyro has its own
    return flowing(_field_docstring(*args))


def cli(cls: type[T], **kwargs: Any) -> T:
    """`tyro.cli(cls, **kwargs)` with each field's help flowing as sentences."""
    if _field_docstring is not None:
        _docstrings.get_field_docstring = _flowing_field_docstring
    return tyro.cli(cls, **kwargs)


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
