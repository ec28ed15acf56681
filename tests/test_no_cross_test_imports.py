"""No test module imports another: shared code lives in tests/helpers/, shared fixtures
in tests/conftest.py. Importing a test module runs its module-level code, re-collects
nothing but couples files that should stand alone (and `from x import fixture` hides
where a fixture comes from)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _test_module(name: str, stems: set[str]) -> str | None:
    """The test module `name` (dotted, absolute) refers to, or None."""
    parts = name.split(".")
    if parts[0] == "tests" and len(parts) > 1 and parts[1].startswith("test_"):
        return ".".join(parts[:2])
    if parts[0] in stems:  # `import test_x`: tests/ on sys.path (pytest's rootdir insert)
        return parts[0]
    return None


def cross_test_imports(source: str, stems: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import of a test module anywhere in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .test_x import y`, `from . import test_x`
                names = [base] if base else [alias.name for alias in node.names]
                names = [f"tests.{n}" for n in names]
            else:  # `from tests.test_x import y`, `from tests import test_x`
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__")):
            names = [node.args[0].value]
        else:
            continue
        for name in names:
            module = _test_module(name, stems)
            if module is not None:
                found.append((node.lineno, module))
                break
    return found


def test_detector_sees_every_import_form():
    stems = {"test_a"}
    sources = [
        "import tests.test_a",
        "import tests.test_a as t",
        "from tests.test_a import helper",
        "from tests import test_a",
        "from tests import helpers, test_a",
        "import test_a",
        "from test_a import helper",
        "from .test_a import helper",
        "from . import test_a",
        "def f():\n    from tests.test_a import helper",
        "import importlib\nimportlib.import_module('tests.test_a')",
    ]
    for source in sources:
        assert cross_test_imports(source, stems), source
    for source in ["import tests.helpers.engine", "from tests.helpers.pool import snapshot",
                   "from tests import helpers", "import pytest", "from . import conftest",
                   "import subprocess\nsubprocess.run(['python', '-m', 'tests.test_a'])"]:
        assert not cross_test_imports(source, stems), source


def test_no_test_module_imports_another():
    files = sorted(TESTS.glob("test_*.py"))
    assert len(files) > 10, f"found only {len(files)} test files under {TESTS}"
    stems = {f.stem for f in files}
    bad = [f"tests/{f.name}:{line} imports {module}"
           for f in files for line, module in cross_test_imports(f.read_text(), stems)]
    assert not bad, ("test modules import other test modules; move what they share to "
                     "tests/helpers/ (code) or tests/conftest.py (fixtures):\n" + "\n".join(bad))
