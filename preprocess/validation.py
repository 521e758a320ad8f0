"""Held-out episodes (`--val-episodes`): which whole episodes go into the validation split, and the split of the
finished units' samples into the training split (OUT) and the validation split (OUT/val, shardformat VAL_DIR).

A fraction holds out each episode whose hash of (dataset, episode id) falls below it: the choice depends on the
episode alone, never on the order of episodes, the units, the executor or the number of workers. A list names the
episodes. The choice is made before any unit and changes only the finalize stage: units hold every episode, and
finalize writes each sample into one split, so training shards never hold a held-out sample.
"""

from __future__ import annotations

import hashlib

from wampipe.errors import UsageError


HELD_OUT = "held out for validation (--val-episodes)"  # the statistics' reason for leaving an episode out
USAGE = "a fraction in (0, 1) like 0.05, or a comma list of episode ids like 3,17,42"


def parse(spec: str) -> float | list[int]:
    """The fraction, or the sorted episode ids, of a `--val-episodes` value; one line naming it when it is neither."""
    text = spec.strip()
    try:
        if "," in text or text.isdigit():
            ids = sorted({int(part) for part in text.split(",")})
            if all(i >= 0 for i in ids):
                return ids
        elif 0 < float(text) < 1:
            return float(text)
    except ValueError:
        pass
    raise UsageError(f"--val-episodes {spec!r}: not {USAGE}")


def canonical(spec: str) -> str:
    """`spec` written one way (0.10 -> 0.1, 7,3 -> 3,7): the form the build records and compares on a rerun."""
    choice = parse(spec)
    # the list is what is tested: a checker reads `float` as float | int, so a float test would leave int | list
    return ",".join(map(str, choice)) if isinstance(choice, list) else repr(choice)


def in_fraction(dataset: str, episode: int, fraction: float) -> bool:
    """Whether `episode` of `dataset` falls in the held-out `fraction`: a hash of both, uniform in [0, 1)."""
    digest = hashlib.sha256(f"{dataset}/{episode}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def held_out(spec: str, dataset: str, episodes: list[int], src) -> list[int]:
    """The episodes of `episodes` (the build's) that `spec` holds out; refuses a choice that names an episode the
    build does not have, or leaves no episode to either split."""
    choice = parse(spec)
    if isinstance(choice, list):  # (as in canonical)
        missing = sorted(set(choice) - set(episodes))
        if missing:
            raise UsageError(
                f"--val-episodes {spec}: episodes {missing[:10]} are not among the {len(episodes)} "
                f"episodes this build reads from {src} (ids {min(episodes)}..{max(episodes)})"
            )
        held = choice
    else:
        held = [e for e in episodes if in_fraction(dataset, e, choice)]
    if not held or len(held) == len(episodes):
        which = "none" if not held else "every one"
        raise UsageError(
            f"--val-episodes {spec} holds out {which} of the {len(episodes)} episodes this build reads "
            f"from {src}: give {USAGE} that leaves episodes in both splits"
        )
    return held


def split_summaries(summaries: list[dict], held: list[int]) -> tuple[list[dict], list[dict]]:
    """(training, validation) copies of the units' records (write.summarize_unit), each with the episode outcomes
    (encoded, failures, skipped) of its own episodes only; which samples go where is the plan's (write.plan_split).
    Prompts stay whole: both splits share one text table."""
    held_set = set(held)

    def part(summary: dict, keep) -> dict:
        return {
            **summary,
            "encoded": [e for e in summary["encoded"] if keep(e)],
            "failures": [f for f in summary["failures"] if keep(f["episode"])],
            "skipped": [s for s in summary["skipped"] if keep(s["episode"])],
        }

    return (
        [part(s, lambda e: e not in held_set) for s in summaries],
        [part(s, lambda e: e in held_set) for s in summaries],
    )
