"""The halves stay apart: train/ and configs/ import no preprocess/ module, preprocess/ no train/ module, shardformat/
and encoders/ (what both halves import) neither half, and no product package imports the devtools/ fixtures. Every
import of a product package goes through the one `wampipe` namespace (an installed wampipe claims no other name).

Each package is walked in a fresh interpreter that imports every one of its modules and lists what got loaded; the
source is read too, so an import inside a function (one that runs only when it is called) is caught as well. The
wheel ships those five packages under wampipe, not devtools/. A module moved out of the product is gone from it, and
no import anywhere in the checkout names its old place. Only the commands' entry points end the process: library code
raises the project's errors."""

import ast
import re
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import FORBIDDEN_IMPORTS, ROOT

MOVED = {"wampipe.preprocess.synthetic": "devtools.synthetic"}  # fixtures: synthetic shards for tests and benchmarks
CHECKOUT = (*FORBIDDEN_IMPORTS, "devtools", "scripts", "tests")


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_no_import_statement_names_a_package_it_must_not_import(package):
    statement = re.compile(
        rf"^\s*(?:from|import)\s+(?:wampipe\.)?(?:{'|'.join(FORBIDDEN_IMPORTS[package])})\b", re.MULTILINE
    )
    found = [
        f"{path.relative_to(ROOT)}: {m.group().strip()}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for m in statement.finditer(path.read_text())
    ]
    assert found == []


def product_modules() -> dict[str, Path]:
    """Every product module by its installed name."""
    out = {}
    for path in sorted(p for package in FORBIDDEN_IMPORTS for p in (ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(("wampipe",) + (parts[:-1] if parts[-1] == "__init__" else parts))] = path
    return out


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules a file imports, at its top or inside a function (a lazy import is an edge too), but not
    under `if TYPE_CHECKING:` (names for the checker only)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for part in node.body
        for n in ast.walk(part)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wampipe"):
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found |= {name for name in names if name in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    return found


def test_no_product_module_imports_itself_through_others():
    modules = product_modules()
    graph = {name: imported_modules(path, modules) - {name} for name, path in modules.items()}
    cycles, state = [], {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                cycles.append(" -> ".join(path[path.index(other) :] + [name, other]) if other in path else other)
            elif other not in state:
                visit(other, path + [name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert cycles == []


def test_no_product_file_uses_a_private_name_of_another_file():
    """`from wampipe.x import _name` or `x._name` of an imported product module: a private name is the file's own."""
    found = []
    for path in sorted(p for package in FORBIDDEN_IMPORTS for p in (ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wampipe"):
                found += [
                    f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
                modules |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name for a in node.names if a.name.startswith("wampipe")}
        found += [
            f"{path.relative_to(ROOT)}: {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ]
    assert found == []


def test_the_wheel_ships_every_product_package_under_wampipe_and_no_fixture():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = {name.split(".")[1] for name in setuptools["packages"] if name != "wampipe"}
    assert shipped == set(FORBIDDEN_IMPORTS) and (ROOT / "devtools" / "__init__.py").is_file()
    assert setuptools["package-dir"] == {
        f"wampipe.{name}": name for name in FORBIDDEN_IMPORTS
    }  # the folders stay on top
    every = {
        p.parent.relative_to(ROOT).as_posix().replace("/", ".")
        for name in FORBIDDEN_IMPORTS
        for p in (ROOT / name).rglob("__init__.py")
    }
    assert {f"wampipe.{name}" for name in every} == set(setuptools["packages"]) - {"wampipe"}  # subpackages too


def test_every_import_of_a_product_package_goes_through_wampipe():
    """A bare `import train` would load a second copy of the module (or a user's own train.py)."""
    statement = re.compile(rf"^\s*(?:from|import)\s+(?:{'|'.join(FORBIDDEN_IMPORTS)})\b", re.MULTILINE)
    paths = [path for package in CHECKOUT for path in sorted((ROOT / package).rglob("*.py"))]
    found = [
        f"{path.relative_to(ROOT)}: {m.group().strip()}" for path in paths for m in statement.finditer(path.read_text())
    ]
    assert found == []


def test_each_product_folder_is_linked_into_the_wampipe_folder():
    """Tools that follow files (pyright, go-to-definition) resolve `wampipe.train.x` through these links."""
    for name in FORBIDDEN_IMPORTS:
        link = ROOT / "wampipe" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), link


def _imported_names(path: Path) -> Iterator[str]:
    """Every module an import statement in `path` names, with `from a import b` also as a.b (b may be a module)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            assert node.module is not None  # level 0: an absolute import always names its module
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_module_moved_out_of_the_product_is_gone_and_imported_from_its_new_place_only(old):
    source = {name: ROOT / f"{name.removeprefix('wampipe.').replace('.', '/')}.py" for name in (old, MOVED[old])}
    assert not source[old].exists() and source[MOVED[old]].is_file()
    paths = [path for package in CHECKOUT for path in sorted((ROOT / package).rglob("*.py"))]
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in paths
        for name in _imported_names(path)
        if name.removeprefix("wampipe.") == old.removeprefix("wampipe.")
        or name.removeprefix("wampipe.").startswith(f"{old.removeprefix('wampipe.')}.")
    ]
    assert found == [], f"{old} is {MOVED[old]} now"


# The functions that end a command's process for its entry point: they may end it, and only an entry point may call
# them. (os._exit also ends a spawned child or a pool worker of preprocess/tasks.py, which are no commands: unchecked.)
EXIT_HELPERS = {"wampipe/errors.py": ("entry_point",), "train/runtime.py": ("leave_now", "leave_finished")}
EXITS = {"sys.exit", "exit", "quit"}


def exits_outside_entry_points(relative: str, source: str) -> list[str]:
    """`file:line what` for each place in a product file that ends the process (`raise SystemExit`, sys.exit) or
    calls an EXIT_HELPERS function outside an entry point: a function named `main` (and what it nests), the
    `if __name__ == "__main__":` block, a whole `__main__.py`. Inside a helper, ending it is its job."""
    helpers = {name for names in EXIT_HELPERS.values() for name in names}
    found = []

    def walk(node: ast.AST, entry: bool, helper: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner_entry, inner_helper = entry, helper
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner_entry |= child.name == "main"
                inner_helper |= child.name in EXIT_HELPERS.get(relative, ())
            elif isinstance(child, ast.If) and isinstance(node, ast.Module):
                inner_entry |= ast.unparse(child.test) in ("__name__ == '__main__'", '__name__ == "__main__"')
            if isinstance(child, ast.Raise) and child.exc is not None and not inner_entry and not inner_helper:
                if ast.unparse(child.exc.func if isinstance(child.exc, ast.Call) else child.exc) == "SystemExit":
                    found.append(f"{relative}:{child.lineno} raise SystemExit")
            elif isinstance(child, ast.Call) and not inner_entry:
                name = ast.unparse(child.func)
                if name.rpartition(".")[2] in helpers or (name in EXITS and not inner_helper):
                    found.append(f"{relative}:{child.lineno} {name}")
            walk(child, inner_entry, inner_helper)

    walk(ast.parse(source), entry=Path(relative).name == "__main__.py", helper=False)
    return found


def test_the_exit_check_finds_what_ends_the_process_outside_an_entry_point():
    source = textwrap.dedent("""
        import sys
        from wampipe.errors import entry_point
        def load(path):
            if not path:
                raise SystemExit(f"{path}: missing")
            raise SystemExit
        def main():
            with entry_point():
                raise SystemExit(load(""))
        def check():
            sys.exit(2)
        def run(runtime):
            with entry_point():
                runtime.leave_now(None)
        def entry_point():
            raise SystemExit(1)
        if __name__ == "__main__":
            sys.exit(main())
    """)
    assert exits_outside_entry_points("train/x.py", source) == [
        "train/x.py:6 raise SystemExit",
        "train/x.py:7 raise SystemExit",
        "train/x.py:12 sys.exit",
        "train/x.py:14 entry_point",
        "train/x.py:15 runtime.leave_now",
        "train/x.py:17 raise SystemExit",
    ]
    assert exits_outside_entry_points("wampipe/errors.py", source)[-1] == "wampipe/errors.py:15 runtime.leave_now"
    assert exits_outside_entry_points("preprocess/__main__.py", source) == []


def test_only_the_entry_points_end_the_process():
    """Library code raises the project's errors (wampipe/errors.py); a command's `main` (or its module's
    `if __name__ == "__main__":`, or a `__main__.py`) turns one into its exit status, through the EXIT_HELPERS."""
    found = [
        where
        for package in (*FORBIDDEN_IMPORTS, "wampipe")
        for path in sorted((ROOT / package).rglob("*.py"))
        for where in exits_outside_entry_points(path.relative_to(ROOT).as_posix(), path.read_text())
    ]
    assert found == []


# the trainer's rooms: what each may import of train/ (its own room always)
ROOMS = {
    "wampipe.train.dit": ("wampipe.train.config",),
    "wampipe.train.planning": ("wampipe.train.config", "wampipe.train.dit"),
}


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_the_dit_and_planning_rooms_import_nothing_of_the_training_loop(room):
    modules = product_modules()
    allowed = (room, *ROOMS[room])
    found = sorted(
        f"{name} imports {other}"
        for name, path in modules.items()
        if name.startswith(room + ".") or name == room
        for other in imported_modules(path, modules)
        if other.startswith("wampipe.train") and not other.startswith(allowed) and other != "wampipe.train"
    )
    assert found == []
