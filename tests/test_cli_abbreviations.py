"""Every command the project ships refuses abbreviated options (issue 56).

argparse's default reads a prefix of an option as that option: ``attn-reg-mt-compare --test`` (an option it
does not have) was taken for ``--test-ref``. With ``allow_abbrev=False`` an unknown option is refused by its name.
"""

import ast

from helpers import REPO

# The plugin's commands, the lab's and the examples' scripts.
SHIPPED = ("attn_reg_plugin", "lab/attn_reg_lab", "examples")


def _argument_parsers():
    """``(path, line, refuses abbreviations)`` of every ``ArgumentParser(...)`` call in the shipped code."""
    for root in SHIPPED:
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name != "ArgumentParser":
                    continue
                refuses = any(
                    k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in node.keywords
                )
                yield path.relative_to(REPO), node.lineno, refuses


def test_every_shipped_argument_parser_refuses_abbreviations():
    parsers = list(_argument_parsers())
    # The scan sees the commands (a wrong root would find none and pass for nothing).
    assert {str(path) for path, _, _ in parsers} >= {
        "attn_reg_plugin/sweep/options.py",  # the compare commands' command_parser and the sweep's
        "attn_reg_plugin/prepare.py",
        "attn_reg_plugin/average_checkpoints.py",
        "lab/attn_reg_lab/sweep.py",
        "examples/glue/run_glue.py",
    }
    allowing = [f"{path}:{line}" for path, line, refuses in parsers if not refuses]
    assert allowing == [], "ArgumentParser without allow_abbrev=False"
