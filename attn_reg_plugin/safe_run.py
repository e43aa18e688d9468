"""``python -m attn_reg_plugin.safe_run TOOL [ARGS...]``: run a fairseq command or script with the
plugin's allow-list of checkpoint globals, torch's safe unpickler still on.

The plugin's own checkpoints load anywhere (see ``fairseq_plugin.attn_reg_task.store_model_args_as_config``).
Checkpoints of stock fairseq runs (``--task translation`` without the plugin) and of plugin
versions before 0.3 pickle the legacy model arguments as an ``argparse.Namespace``, which torch
>= 2.6 refuses (``Unsupported global: GLOBAL argparse.Namespace``) in every tool that does not
import the plugin. ``--user-dir`` imports it for fairseq's commands; this runs any other tool,
e.g. fairseq's ``scripts/average_checkpoints.py`` (in a fairseq checkout, not in the pip
package; ``attn-reg-average-checkpoints`` is the same averaging, installed), after the import. Unlike ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` it trusts only the
classes ``fairseq_plugin.safe_load`` lists, not every global a checkpoint names.
"""

import os
import runpy
import shutil
import sys

USAGE = (
    "usage: python -m attn_reg_plugin.safe_run TOOL [ARGS...]\n"
    "TOOL: a fairseq command on PATH (fairseq-generate, fairseq-interactive, ...) or a Python script "
    "(fairseq's scripts/average_checkpoints.py); ARGS are passed to it unchanged"
)


def _is_python_script(path: str) -> bool:
    if path.endswith(".py"):
        return True
    with open(path, "rb") as f:
        first = f.readline(200)
    return first.startswith(b"#!") and b"python" in first


def resolve_tool(tool: str) -> str:
    """The Python file TOOL names: a path, or a command (a console script) of this interpreter's
    environment, else one found on PATH."""
    path = tool if os.path.isfile(tool) else None
    path = path or shutil.which(tool, path=os.path.dirname(sys.executable)) or shutil.which(tool)
    if path is None:
        raise SystemExit(
            f"attn_reg_plugin.safe_run: TOOL {tool!r} is neither a file nor a command of this environment or on PATH\n{USAGE}"
        )
    path = os.path.abspath(path)
    if not _is_python_script(path):
        raise SystemExit(f"attn_reg_plugin.safe_run: TOOL {tool!r} ({path}) is not a Python script\n{USAGE}")
    return path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    path = resolve_tool(argv[0])
    import fairseq  # noqa: F401  (first, so that the import below registers the plugin's fairseq parts too)

    from .fairseq_plugin import safe_load  # noqa: F401  (the allow-list)

    sys.argv = [path, *argv[1:]]
    sys.path.insert(0, os.path.dirname(path))  # what `python SCRIPT` does
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
