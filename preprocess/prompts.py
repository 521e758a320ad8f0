"""Training prompts: the instruction, lower-cased, inserted twice into the embodiment's template
(docs/REFERENCE.md#4-prompts).

Every annotation column is kept (DROID has three; the reference draws one per sample, so the trainer does too).
"""

from __future__ import annotations

import hashlib
import re

from wampipe.preprocess.errors import DatasetError
from wampipe.preprocess.lerobot import Episode
from wampipe.shardformat.embodiments import Embodiment


MAX_INSTRUCTION_CHARS = 10_000  # umT5 reads 512 tokens, a few thousand characters
MAX_INSTRUCTION_DEPTH = 16  # brackets inside brackets; a stored instruction list has one level

_TOKEN = re.compile(
    r"""\s*(?:[uU]?(?P<str>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")"""
    r"|(?P<num>[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)"
    r"|(?P<name>True|False|None)\b|(?P<punct>[\[\](),]))"
)
_NAMES = {"True": True, "False": False, "None": None}


class BadInstruction(Exception):
    """A stored instruction that gives no prompt: too long, nested too deep, or an empty list."""


def instruction_text(raw: str) -> str:
    """A stored list/tuple literal (e.g. "['pick up the cup']") gives its first element; other literals (strings,
    numbers, True/False/None) their str(); anything else, such as a plain sentence, itself. This is what the
    reference's ast.literal_eval does, read by a bounded parser that evaluates nothing; raises BadInstruction."""
    if len(raw) > MAX_INSTRUCTION_CHARS:
        raise BadInstruction(f"an instruction of {len(raw)} characters (at most {MAX_INSTRUCTION_CHARS})")
    try:
        parsed = _literal(raw.strip())
    except ValueError:  # not a literal: plain sentences land here
        return str(raw)
    if isinstance(parsed, (list, tuple)) and not parsed:
        raise BadInstruction(f"an empty {type(parsed).__name__}: no instruction in it")
    return str(parsed[0]) if isinstance(parsed, (list, tuple)) else str(parsed)


def _literal(text: str):
    """The literal `text` spells (strings, numbers, True/False/None, lists and tuples of them); ValueError if it is
    not one of those, BadInstruction if nested deeper than MAX_INSTRUCTION_DEPTH."""
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            raise ValueError(f"not a literal at character {pos}")
        assert match.lastgroup is not None  # every alternative of _TOKEN is a named group
        tokens.append((match.lastgroup, match.group(match.lastgroup)))
        pos = match.end()
    if not tokens:
        raise ValueError("empty")
    tokens = [("punct", "("), *tokens, ("punct", ")"), (None, None)]  # a bare `'a', 'b'` is a tuple, as in Python
    value, end = _value(tokens, 0, -1)
    if end != len(tokens) - 1:
        raise ValueError("more after the literal")
    return value


def _value(tokens: list, i: int, depth: int):
    """(the value starting at token i, the index after it)."""
    kind, text = tokens[i]
    if kind == "str":
        parts = []
        while tokens[i][0] == "str":  # adjacent strings join, as in Python
            parts.append(_unquote(tokens[i][1]))
            i += 1
        return "".join(parts), i
    if kind == "num":
        return (float(text) if any(c in text for c in ".eE") else int(text)), i + 1
    if kind == "name":
        return _NAMES[text], i + 1
    if text not in ("[", "("):
        raise ValueError(f"unexpected {text!r}")
    if depth == MAX_INSTRUCTION_DEPTH:
        raise BadInstruction(f"an instruction nested deeper than {MAX_INSTRUCTION_DEPTH} levels")
    closing, items, comma, i = "]" if text == "[" else ")", [], False, i + 1
    while tokens[i][1] != closing:
        item, i = _value(tokens, i, depth + 1)
        items.append(item)
        comma = tokens[i][1] == ","
        if comma:
            i += 1
        elif tokens[i][1] != closing:
            raise ValueError(f"expected ',' or {closing!r}")
    if text == "(" and len(items) == 1 and not comma:  # parentheses around one value
        return items[0], i + 1
    return (items if text == "[" else tuple(items)), i + 1


def _unquote(token: str) -> str:
    """The text of a quoted string token, its backslash escapes read as Python reads them."""
    body = token[1:-1]
    return body.encode("latin-1", "backslashreplace").decode("unicode_escape") if "\\" in body else body


def format_prompt(raw_instruction: str, embodiment: Embodiment) -> str:
    instruction = instruction_text(raw_instruction).lower()
    return embodiment.prompt_prefix + instruction + embodiment.prompt_middle + instruction


def prompt_id(prompt: str) -> str:
    """Content-addressed id of a prompt: every unit (and the synthetic writer) names it the same way without
    coordination; the text table is keyed by it."""
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]


def window_prompts(episode: Episode, start: int, embodiment: Embodiment) -> dict[str, str]:
    """Annotation column -> prompt, from the instructions at the window's first row (as the reference reads them)."""
    columns = list(embodiment.annotation_columns) or list(episode.annotations)
    missing = [c for c in columns if c not in episode.annotations]
    if missing:
        raise DatasetError(
            None, episode.index, f"annotation columns {missing} are missing (have {sorted(episode.annotations)})"
        )
    if not columns:
        raise DatasetError(None, episode.index, "no instruction: neither annotation columns nor task_index")
    prompts = {}
    for c in columns:
        try:
            prompts[c] = format_prompt(str(episode.annotations[c][start]), embodiment)
        except BadInstruction as err:  # the episode is left out; the file is where its instruction is stored
            raise DatasetError(episode.annotation_files.get(c), episode.index, f"{c} at row {start}: {err}") from None
    return prompts
