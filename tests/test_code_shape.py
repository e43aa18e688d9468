"""The plugin stays small enough to hold in one's head: no module over 600 lines, no function over 60;
no lab module over 500 lines. One cohesive module beats several that call each other back and forth
(what a reader must follow is measured by ../shared/tools/reading_load.py, not by line counts)."""

import ast

import pytest

from helpers import REPO

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
MODULES = sorted((REPO / "attn_reg_plugin").rglob("*.py"))
MAX_LAB_MODULE_LINES = 500
LAB_MODULES = sorted((REPO / "lab" / "attn_reg_lab").rglob("*.py"))


def long_functions(source: str, limit: int):
    """(name, first line, length) of every function or method longer than ``limit`` lines, docstring included."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_module_and_functions_are_short(path):
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{len(source.splitlines())} lines"
    assert long_functions(source, MAX_FUNCTION_LINES) == []


@pytest.mark.parametrize("path", LAB_MODULES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_lab_module_is_at_most_500_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LAB_MODULE_LINES, f"{lines} lines"


def test_the_walk_finds_long_functions():
    """Nested functions and methods count too, so an empty list above means none is long."""
    body = "\n".join(f"            x{i} = {i}" for i in range(60))
    source = f"class A:\n    def method(self):\n        def inner():\n{body}\n        return inner\n"
    assert long_functions(source, 60) == [("method", 2, 63), ("inner", 3, 61)]


def test_the_plugin_uses_no_private_torch_api():
    """``torch._C`` may change in any release: nothing in the plugin calls it."""
    found = [
        f"{m.relative_to(REPO)}:{n}"
        for m in MODULES
        for n, line in enumerate(m.read_text().splitlines(), 1)
        if "torch._C" in line
    ]
    assert not found, found
