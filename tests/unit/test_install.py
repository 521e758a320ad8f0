"""Installed like a tool: the console scripts pyproject.toml declares, a base install that builds shards and trains
with no extra present, each extra's feature naming the extra in one line where it is missing, base dependencies that
are what the code imports, and a shards command that needs its source."""

import importlib
import importlib.metadata
import sys


from tests.helpers import (
    BASE_REQUIREMENTS,
    EXTRA_REQUIREMENTS,
    PROJECT,
    ROOT,
    WHEEL_PACKAGES,
    normalized_name,
    requirement_closure,
)
from wampipe.train.launch import split_arguments


def test_every_console_script_target_exists():
    assert sorted(PROJECT["scripts"]) == [
        "wampipe-check",
        "wampipe-inspect",
        "wampipe-preview",
        "wampipe-shards",
        "wampipe-stats",
        "wampipe-train",
    ]
    for target in PROJECT["scripts"].values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target


def test_train_script_splits_torchrun_options_from_trainer_flags():
    assert split_arguments(["--nproc-per-node", "2", "--preset", "tiny", "--data.shards", "d"]) == (
        ["--standalone", "--nproc-per-node", "2"],
        ["--preset", "tiny", "--data.shards", "d"],
    )
    assert split_arguments(["--nnodes=2", "--rdzv-endpoint", "h:1", "--", "--max-restarts", "x"]) == (
        ["--nnodes=2", "--rdzv-endpoint", "h:1"],
        ["--max-restarts", "x"],
    )


def imported_distributions() -> dict[str, set[str]]:
    """Distribution -> the project's files that import one of its modules (at the top or in a function)."""
    import ast

    owners = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for path in sorted(p for package in WHEEL_PACKAGES for p in (ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names):
                for dist in owners.get(top, []):
                    found.setdefault(normalized_name(dist), set()).add(str(path.relative_to(ROOT)))
    return found


# base dependencies the packages use through another library rather than by an import of their own
LOADED_BY_OTHERS = {"sentencepiece"}  # transformers' T5 tokenizer loads it to read the umT5 tokenizer files


def test_base_dependencies_are_what_the_code_imports():
    """Every base dependency is imported by the packages (or loaded for them, LOADED_BY_OTHERS), and every other
    import is of an extra or of what an extra brings (botocore, aiohttp: s3fs's), each behind its ImportError."""
    imported = imported_distributions()
    imported.pop("wampipe", None)
    assert BASE_REQUIREMENTS - set(imported) == LOADED_BY_OTHERS
    from_extras = requirement_closure(set().union(*EXTRA_REQUIREMENTS.values())) - BASE_REQUIREMENTS
    assert {dist: files for dist, files in imported.items() if dist not in BASE_REQUIREMENTS | from_extras} == {}
