"""The halves stay apart: train/ and configs/ import no preprocess/ module, preprocess/ no train/ module, shardformat/
and encoders/ (what both halves import) neither half, and no product package imports the devtools/ fixtures.

Each package is walked in a fresh interpreter that imports every one of its modules and lists what got loaded; the
source is read too, so an import inside a function (one that runs only when it is called) is caught as well. The
wheel ships those five packages, not devtools/."""

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
