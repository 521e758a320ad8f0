"""The halves stay apart: train/ and configs/ import no preprocess/ module, preprocess/ no train/ module, shardformat/
and encoders/ (what both halves import) neither half, and no product package imports the devtools/ fixtures.

Each package is walked in a fresh interpreter that imports every one of its modules and lists what got loaded; the
source is read too, so an import inside a function (one that runs only when it is called) is caught as well. The
wheel ships those five packages, not devtools/. A module moved out of the product is gone from it, and no import
anywhere in the checkout names its old place."""

import ast
import json
import re
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import ROOT

FORBIDDEN = {
    "train": ("preprocess", "devtools"),
    "configs": ("train", "preprocess", "devtools"),
    "preprocess": ("train", "devtools"),
    "shardformat": ("train", "preprocess", "devtools"),
    "encoders": ("train", "preprocess", "devtools"),
}
MOVED = {"preprocess.synthetic": "devtools.synthetic"}  # fixtures: synthetic shards for tests and benchmarks
CHECKOUT = (*FORBIDDEN, "devtools", "scripts", "tests")
WALK = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
names = [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_loads_no_module_of_a_package_it_must_not_import(package):
    done = subprocess.run([sys.executable, "-c", WALK, package], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = [m for m in json.loads(done.stdout.splitlines()[-1]) if m.split(".")[0] in FORBIDDEN[package]]
    assert loaded == [], f"importing {package}/ loads {loaded}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_statement_names_a_package_it_must_not_import(package):
    statement = re.compile(rf"^\s*(?:from|import)\s+(?:{'|'.join(FORBIDDEN[package])})\b", re.MULTILINE)
    found = [f"{path.relative_to(ROOT)}: {m.group().strip()}" for path in sorted((ROOT / package).rglob("*.py"))
             for m in statement.finditer(path.read_text())]
    assert found == []


def test_the_wheel_ships_every_product_package_and_no_fixture():
    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = {name.split(".")[0] for name in find_packages(str(ROOT), include=include)}
    assert shipped == set(FORBIDDEN) and (ROOT / "devtools" / "__init__.py").is_file()


def _imported_names(path):
    """Every module an import statement in `path` names, with `from a import b` also as a.b (b may be a module)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_module_moved_out_of_the_product_is_gone_and_imported_from_its_new_place_only(old):
    source = {name: ROOT / f"{name.replace('.', '/')}.py" for name in (old, MOVED[old])}
    assert not source[old].exists() and source[MOVED[old]].is_file()
    paths = [path for package in CHECKOUT for path in sorted((ROOT / package).rglob("*.py"))]
    found = [f"{path.relative_to(ROOT)}: {name}" for path in paths for name in _imported_names(path)
             if name == old or name.startswith(f"{old}.")]
    assert found == [], f"{old} is {MOVED[old]} now"
