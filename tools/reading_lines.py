"""Where the reading load's lines go: each plugin line that ``reading_load.py``'s widest attention
call executes, attributed to the function that holds it, one count per function.

    OMP_NUM_THREADS=1 .venv/bin/python tools/reading_lines.py [--tool ../shared/tools/reading_load.py] [--tokens 16]

Runs the tool's own ``measure()`` (its tiny BERT, its AD-DROP GA step), so the total is its "lines"
figure for that length; each (file, line) goes to the innermost ``def`` around it (by ``ast``).
"""

import argparse
import ast
import collections
import importlib.util
import os
import sys


def functions_of(path):
    """(first line, last line, qualified name) of every function in ``path``."""
    spans = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                spans.append((child.lineno, child.end_lineno, prefix + child.name))
                walk(child, prefix + child.name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    with open(path) as f:
        walk(ast.parse(f.read()), "")
    return spans


def owner(spans, line):
    inside = [(first, name) for first, last, name in spans if first <= line <= last]
    return max(inside)[1] if inside else "<module>"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--tool", default="../shared/tools/reading_load.py", help="path of reading_load.py")
    parser.add_argument("--tokens", type=int, default=16, help="the call's length (the tool's: 16 short, 700 long)")
    args = parser.parse_args(argv)
    spec = importlib.util.spec_from_file_location("reading_load", args.tool)
    tool = importlib.util.module_from_spec(spec)
    sys.argv = [args.tool]
    spec.loader.exec_module(tool)
    _, _, lines = tool.measure(args.tokens)
    counts, spans = collections.Counter(), {}
    for file, line in lines:
        path = os.path.join(tool.ROOT, file)
        counts[f"{file}:{owner(spans.setdefault(file, functions_of(path)), line)}"] += 1
    for name, n in sorted(counts.items()):
        print(f"{n:4d} {name}")
    print(f"{sum(counts.values())} lines in {len(counts)} functions")


if __name__ == "__main__":
    main()
