"""The tests' own layout: no file under tests/ imports a test module (``test_*``); what tests share
lives in tests/helpers/ (helpers/__init__.py lists it). Imports are read with ``ast``: module-level
and function-level ``import`` / ``from ... import``, ``importlib.import_module`` / ``__import__`` of a
constant name, and Python source in string constants (the ``python -c`` scripts tests start).
A self-check on a toy directory shows the checker catches each kind.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(name: str | None) -> bool:
    return bool(name) and name.split(".")[0].startswith("test_")


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import of a test module in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and _is_test_module(node.module):
                found.append((node.lineno, node.module))
            elif node.level > 0 and node.module is None:  # from . import test_x
                found += [(node.lineno, a.name) for a in node.names if _is_test_module(a.name)]
            elif node.level > 0 and _is_test_module(node.module):  # from .test_x import y
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
                and _is_test_module(arg.value)
            ):
                found.append((node.lineno, arg.value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:  # a string that is Python source: a script run by ``python -c`` or written to a file
                with warnings.catch_warnings():  # e.g. invalid escapes in the script's own strings
                    warnings.simplefilter("ignore")
                    script = ast.parse(node.value)
            except (SyntaxError, ValueError):
                continue  # prose (docstrings, messages)
            found += [(node.lineno, module) for _, module in _imported(script)]
    return found


def imports_of_test_modules(root: Path) -> list[str]:
    """``"<path relative to root>:<line>: <module>"`` for every import of a test module by a Python
    file under ``root`` (test files, helpers, conftest, scripts alike), by path and line."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(root).parts):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        name = path.relative_to(root).as_posix()
        out += [f"{name}:{line}: {module}" for line, module in sorted(_imported(tree))]
    return out


def test_no_test_file_imports_another():
    """Nothing under tests/ imports a test module: shared code comes from tests/helpers/."""
    found = imports_of_test_modules(TESTS)
    assert not found, "\n".join(["imports of test modules (move what they share to tests/helpers/):", *found])


def test_the_checker_catches_each_kind_of_import(tmp_path):
    """A toy tests directory with one import of a test module of each kind (the module names are
    built by f-strings, so this file's own strings are not such scripts): each is reported, with its
    file and line, and the clean files are not."""
    bad = "test_" + "b"
    files = {
        "test_a.py": f"import os\nfrom {bad} import x\n",
        "test_c.py": f"def test_c():\n    import {bad}\n\n    assert {bad}\n",
        "test_d.py": f"from . import {bad}\nfrom .{bad} import y\n",
        "test_e.py": f"import importlib\nm = importlib.import_module('{bad}')\nn = __import__('{bad}.sub')\n",
        "test_f.py": f"import subprocess\nCODE = 'import {bad} as t; t.run()'\n",
        "helpers/__init__.py": "",
        "helpers/h.py": f"def h():\n    from {bad}.inner import z\n    return z\n",
        "conftest.py": "import helpers.h\n",
        "test_ok.py": (
            '"""Docstring: never import test_b here."""\n'
            "from helpers.h import h\nfrom helpers import h as hh\nimport testing_tools\n"
            "MSG = 'see test_b.py'\n"
        ),
        f"{bad}.py": "x = 1\ny = 2\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert imports_of_test_modules(tmp_path) == [
        f"helpers/h.py:2: {bad}.inner",
        f"test_a.py:2: {bad}",
        f"test_c.py:2: {bad}",
        f"test_d.py:1: {bad}",
        f"test_d.py:2: {bad}",
        f"test_e.py:2: {bad}",
        f"test_e.py:3: {bad}.sub",
        f"test_f.py:2: {bad}",
    ]
