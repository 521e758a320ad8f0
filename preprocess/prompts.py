"""Training prompts: the instruction, lower-cased, inserted twice into the embodiment's template
(docs/REFERENCE.md#4-prompts).

Every annotation column is kept (DROID has three; the reference draws one per sample, so the trainer does too).
`clean_text` is the umT5 tokenizer's text cleaning, reused by the text encoder.
"""

from __future__ import annotations

import ast
import hashlib
import html
import re

import ftfy

from preprocess.embodiments import Embodiment
from preprocess.errors import DatasetError
from preprocess.lerobot import Episode


def instruction_text(raw: str) -> str:
    """A stored list/tuple literal (e.g. "['pick up the cup']") gives its first element; other literals their str()."""
    try:
        parsed = ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError):  # the reference's exception set; plain sentences land here
        return str(raw)
    return str(parsed[0]) if isinstance(parsed, (list, tuple)) else str(parsed)


def format_prompt(raw_instruction: str, embodiment: Embodiment) -> str:
    instruction = instruction_text(raw_instruction).lower()
    return embodiment.prompt_prefix + instruction + embodiment.prompt_middle + instruction


def prompt_id(prompt: str) -> str:
    """Content-addressed id of a prompt: every unit (and the synthetic writer) names it the same way without
    coordination; the text table is keyed by it."""
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]


def clean_text(text: str) -> str:
    """ftfy fix, HTML-unescape twice, collapse whitespace, strip (the umT5 tokenizer wrapper's 'whitespace' clean)."""
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


def window_prompts(episode: Episode, start: int, embodiment: Embodiment) -> dict[str, str]:
    """Annotation column -> prompt, from the instructions at the window's first row (as the reference reads them)."""
    columns = list(embodiment.annotation_columns) or list(episode.annotations)
    missing = [c for c in columns if c not in episode.annotations]
    if missing:
        raise DatasetError(None, episode.index, f"annotation columns {missing} are missing (have {sorted(episode.annotations)})")
    if not columns:
        raise DatasetError(None, episode.index, "no instruction: neither annotation columns nor task_index")
    return {c: format_prompt(str(episode.annotations[c][start]), embodiment) for c in columns}
