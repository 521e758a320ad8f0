"""The halves stay apart: train/ and configs/ import no preprocess/ module, preprocess/ no train/ module, shardformat/
and encoders/ (what both halves import) neither half, and no product package imports the devtools/ fixtures. Every
import of a product package goes through the one `wampipe` namespace (an installed wampipe claims no other name).

Each package is walked in a fresh interpreter that imports every one of its modules and lists what got loaded; the
source is read too, so an import inside a function (one that runs only when it is called) is caught as well. The
wheel ships those five packages under wampipe, not devtools/. A module moved out of the product is gone from it, and
no import anywhere in the checkout names its old place. Only the commands' entry points end the process: library code
raises the project's errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FORBIDDEN_IMPORTS, ROOT

WALK = """
import importlib, json, pkgutil, sys
package = importlib.import_module("wampipe." + sys.argv[1])
names = [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_a_package_loads_no_module_of_a_package_it_must_not_import(package):
    done = subprocess.run([sys.executable, "-c", WALK, package], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    outside = [m for m in loaded if m.split(".")[0] in FORBIDDEN_IMPORTS]
    assert outside == [], f"importing {package}/ loads {outside} outside the wampipe namespace"
    tops = {m.split(".")[1] if m.startswith("wampipe.") else m.split(".")[0] for m in loaded}
    assert tops & set(FORBIDDEN_IMPORTS[package]) == set(), (
        f"importing {package}/ loads {tops & set(FORBIDDEN_IMPORTS[package])}"
    )


@pytest.mark.e2e
def test_an_installed_name_is_not_shadowed_by_a_users_train_module(tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('the user train.py was imported')\n")
    done = subprocess.run(
        [sys.executable, "-c", "import wampipe.train.config, wampipe.train.launch"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


ONE_MODULE_PER_FILE = """
import collections, importlib, json, pathlib, pkgutil, sys
for top in ("preprocess", "train"):  # what `python -m preprocess ...` and `python -m train.evaluate` import first
    importlib.import_module(top)
for top in ("configs", "encoders", "preprocess", "shardformat", "train"):
    package = importlib.import_module("wampipe." + top)
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
root, files = pathlib.Path.cwd().resolve(), collections.defaultdict(set)
ours = {"configs", "encoders", "preprocess", "shardformat", "train", "wampipe", "devtools"}  # not a .venv inside
for name, module in list(sys.modules.items()):
    path = pathlib.Path(getattr(module, "__file__", None) or "/").resolve()
    if path.is_relative_to(root) and path.relative_to(root).parts[0] in ours:
        files[str(path.relative_to(root))].add(id(module))
print(json.dumps({path: len(ids) for path, ids in files.items()}))
"""


@pytest.mark.e2e
def test_every_source_file_loads_as_exactly_one_module():
    done = subprocess.run(
        [sys.executable, "-c", ONE_MODULE_PER_FILE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.splitlines()[-1])
    assert "train/main.py" in counts and "preprocess/__init__.py" in counts
    assert {path: n for path, n in counts.items() if n != 1} == {}


@pytest.mark.e2e
def test_the_documented_commands_run_from_a_checkout_with_nothing_installed(tmp_path):
    """An interpreter that has the dependencies but no wampipe (the checkout's editable install is not on its path):
    `torchrun train/main.py` (which runs `python train/main.py`), `python -m preprocess` and `python -m train.evaluate`
    work from the checkout's root."""
    import sysconfig
    import venv

    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # a path line, not a site directory: the .pth files there (the editable install's finder) are not run
    paths = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (Path(purelib) / "dependencies.pth").write_text("\n".join(sorted(paths)) + "\n")
    nowhere = subprocess.run(
        [python, "-c", "import torch, tyro, wampipe"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert "No module named 'wampipe'" in nowhere.stderr, nowhere.stderr[-2000:]
    for command in (
        ["train/main.py", "--help"],
        ["-m", "preprocess", "shards", "--help"],
        ["-m", "train.evaluate", "--help"],
    ):
        done = subprocess.run([python, *command], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "usage:" in done.stdout, (command, done.stderr[-2000:])
