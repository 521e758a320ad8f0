"""Every scripts/*.py starts as a program from an installed checkout (no sys.path set-up) and prints its help, every
flag with help of its own and nothing on stderr; the scripts that other tests run for real are smoke-tested there."""

import subprocess
import sys

import pytest

from tests.helpers import HELP_ENV, ROOT, check_help

pytestmark = pytest.mark.e2e  # every test runs the tools in processes of their own

RUN_ELSEWHERE = {  # script -> the test that runs it as a program
    "bench_init_load.py": "e2e/test_init_load.py",
    "bench_loader.py": "e2e/test_bench_loader.py",
    "bench_train.py": "e2e/test_bench_train.py",
    "check_fp8_parity.py": "e2e/test_float8.py",
}


def test_every_script_prints_its_help(tmp_path):
    scripts = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
    assert set(RUN_ELSEWHERE) <= set(scripts)
    for script, test in RUN_ELSEWHERE.items():
        assert f'"{script}"' in (ROOT / "tests" / test).read_text(), (script, test)
    # from another directory, all at once: each one is a separate interpreter that imports torch
    children = {
        name: subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / name), "--help"],
            cwd=tmp_path,
            env=HELP_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in scripts
    }
    for name, child in children.items():
        out, err = child.communicate(timeout=300)
        assert "usage" in out.lower(), name
        check_help(subprocess.CompletedProcess(child.args, child.returncode, out, err))
