"""The docs name tests that exist: each `tests/<kind>/test_*.py[::test_name]` in docs/ and README.md is a file of the
suite, and each named test a function in it (`::name` alone continues the file named before it in that cell)."""

import ast
import re

from tests.helpers import ROOT

REFERENCE = re.compile(r"(tests/(?:unit|e2e)/test_\w+\.py)?(?:::(test_\w+))?")


def test_every_test_the_docs_name_exists():
    missing, seen = [], 0
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            assert "tests/test_" not in line, f"{doc.name}:{number}: tests live in tests/unit/ or tests/e2e/"
            file = None
            for cell in line.split("|"):
                for match in REFERENCE.finditer(cell):
                    file = match.group(1) or file
                    if not (match.group(1) or match.group(2)):
                        continue
                    seen += 1
                    path = ROOT / str(file)
                    if file is None or not path.is_file():
                        missing.append(f"{doc.name}:{number}: {match.group()}")
                    elif match.group(2) and match.group(2) not in {
                        node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
                    }:
                        missing.append(f"{doc.name}:{number}: {file}::{match.group(2)}")
    assert seen > 30 and not missing, missing
