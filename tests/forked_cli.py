"""fairseq's console scripts for the tests, each run a fork of one process that imported fairseq once.

A ``fairseq-train`` start spends about 5 s importing torch and fairseq (whose task registry alone
imports scikit-learn, about 2 s), more than most test runs then train, and the suite starts dozens
of them. This server imports the fairseq entry points once, before any computation (no thread or
OpenMP pool exists to inherit), and forks one child per run. Each run is still its own process: its
own address space, working directory, arguments and exit status, its output (file descriptors 1 and
2) in a file, and at the top of that output what the imports printed, as a fresh start's log has.

:func:`helpers.run_cli` uses it when no standard input is given, the run will not use CUDA (a
forked child cannot initialize it), and the variables read while
importing (``helpers.IMPORT_TIME_ENV``: Python's, OpenMP's, the visible CUDA devices, the paths)
are the ones the server started with; the child then runs in the caller's environment. Otherwise it
starts a fresh process. A test of start-up itself (import order, start-up warnings) starts its own.

A request may also name a Python ``script`` to run as ``python SCRIPT ARGS`` would (the 2-rank
fairseq runs of tests/fairseq_rank.py), and may hold several runs that start together (the ranks of
one job) and are waited for together.

Protocol, one JSON line each way per request: ``{"runs": [{"name" or "script", "args", "cwd", "out",
"env"}, ...]}`` in; ``{"pids"}`` once forked, then ``{"rcs"}`` (a negative number: killed by that signal).
"""

import atexit
import importlib
import json
import os
import runpy
import sys
import tempfile
import threading
import traceback
import warnings
from importlib.metadata import entry_points

# fairseq_cli.preprocess costs nothing on top of the other two (its imports are theirs).
PRELOADED = ("fairseq_cli.train", "fairseq_cli.generate", "fairseq_cli.preprocess")
STARTED_WITH = dict(os.environ)


def import_preloaded():
    """Import PRELOADED with file descriptors 1 and 2 in a file; return what they printed."""
    with tempfile.TemporaryFile() as printed:
        saved = os.dup(1), os.dup(2)
        os.dup2(printed.fileno(), 1)
        os.dup2(printed.fileno(), 2)
        try:
            for module in PRELOADED:
                importlib.import_module(module)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        printed.seek(0)
        return printed.read()


def exit_code(code):
    """What ``sys.exit(code)`` makes the interpreter exit with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_child(request, preamble):
    """In the forked child: run the console script ``request["name"]``, or the Python file
    ``request["script"]``, as a fresh start would; never returns."""
    rc = 1
    try:
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        os.write(1, preamble)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # fairseq's epoch iterator sets PYTHONWARNINGS in its process (in-process tests: the caller's);
        # a fresh start would read it into its warning filters, so the child does.
        if request["env"].get("PYTHONWARNINGS") not in (None, STARTED_WITH.get("PYTHONWARNINGS")):
            warnings._processoptions(request["env"]["PYTHONWARNINGS"].split(","))
        if "script" in request:
            sys.argv = [request["script"], *request["args"]]
            sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))  # as `python SCRIPT` has it

            def main():
                runpy.run_path(request["script"], run_name="__main__")

        else:
            (script,) = entry_points(group="console_scripts", name=request["name"])
            sys.argv = [os.path.join(os.path.dirname(sys.executable), request["name"]), *request["args"]]
            main = script.load()
        try:
            rc = exit_code(main())
        except SystemExit as stop:
            rc = exit_code(stop.code)
        except BaseException:
            traceback.print_exc()
            rc = 1
        atexit._run_exitfuncs()  # what interpreter shutdown runs: logging.shutdown, TensorBoard writers
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def serve(requests, replies):
    # A console script's sys.path[0] is its own folder (the venv's bin), not this file's.
    sys.path[0] = os.path.dirname(sys.executable)
    preamble = import_preloaded()
    if threading.active_count() != 1:
        raise RuntimeError(f"importing {PRELOADED} started threads: forking would copy them dead")
    for line in requests:
        pids = []
        for run in json.loads(line)["runs"]:
            pid = os.fork()
            if pid == 0:
                requests.close()
                replies.close()
                run_child(run, preamble)
            pids.append(pid)
        replies.write(json.dumps({"pids": pids}) + "\n")
        replies.flush()
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        replies.write(json.dumps({"rcs": codes}) + "\n")
        replies.flush()


if __name__ == "__main__":
    # The protocol keeps its own descriptors; 0 and 1 become what a child replaces anyway.
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    serve(requests, replies)
