"""The sweep's children and its lock: no fairseq-train or fairseq-generate outlives the sweep, and
one sweep at a time writes an ``--out-dir``.

A child runs in its own process group (so ending it reaches its data-loader workers too), and on
Linux with ``PR_SET_PDEATHSIG``: the kernel sends it SIGTERM when the sweep dies, even by SIGKILL
(its data-loader workers, forked without that signal, follow within 5 s, when torch's watchdog sees
their parent gone; they write nothing).
Its output goes straight into its log file, not through a pipe, so every line it wrote survives
the sweep; the sweep follows the file to print progress. SIGTERM, SIGINT and SIGHUP on the sweep
raise :class:`SweepStopped`, which ends the running child before the sweep exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence

GRACE_SECONDS = 10.0  # a child still running this long after SIGTERM gets SIGKILL
POLL_SECONDS = 0.2
RUNNING: List[subprocess.Popen] = []  # the children running now (a Slurm job's time-limit signal waits for them)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class SweepStopped(BaseException):
    """A signal asked the sweep to stop (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it). ``ended`` names the children it ended."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.ended: List[str] = []


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP raise :class:`SweepStopped` while inside; the old handlers after.
    Outside the main thread (where Python refuses handlers) it does nothing."""

    def stop(signum, frame):
        raise SweepStopped(signum)

    kept = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                kept[sig] = signal.signal(sig, stop)
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


DEFERRED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR2")


class DeferredStop:
    """While inside (a context), a signal of :data:`DEFERRED_SIGNALS` whose handler is Python's (the
    command's :func:`stop_on_signals`, or in a submitit job its time-limit requeue on SIGUSR2) is only
    recorded in ``requested``: training in this process saves at the end of its step, then calls
    :meth:`act`, the signal's own handler. A second signal before that calls it at once (the last
    whole checkpoint is kept); one left unanswered when the context ends is acted on then. Outside
    the main thread (no handlers there) it defers nothing."""

    def __init__(self):
        self.requested: Optional[int] = None
        self.kept: dict = {}

    def __enter__(self) -> DeferredStop:
        try:
            for name in DEFERRED_SIGNALS:
                sig = getattr(signal, name, None)
                handler = signal.getsignal(sig) if sig is not None else None
                if callable(handler):
                    signal.signal(sig, self._defer)
                    self.kept[sig] = handler
        except ValueError:  # not the main thread
            pass
        return self

    def _defer(self, signum, frame) -> None:
        if self.requested is not None:  # asked twice: now
            self.kept[signum](signum, frame)
        self.requested = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.requested).name if self.requested is not None else ""

    def act(self) -> None:
        """The requested signal's own handler (SweepStopped, submitit's requeue, ...); a handler that
        returns leaves the deferral in place for the next signal."""
        signum, self.requested = self.requested, None
        if signum is not None:
            self.kept[signum](signum, None)

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if kind is None:
                self.act()
        finally:
            for sig, handler in self.kept.items():
                signal.signal(sig, handler)


def _die_with(parent: int) -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when ``parent`` dies; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: nobody is left to signal us
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def end_child(proc: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """SIGTERM to the child's process group, SIGKILL after ``grace`` seconds; waits for it."""
    for sig, wait in ((signal.SIGTERM, grace), (getattr(signal, "SIGKILL", signal.SIGTERM), None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, sig)  # its own group: start_new_session made it the leader
            else:
                proc.send_signal(sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(
    cmd: Sequence[str],
    log_path: Path,
    on_line: Optional[Callable[[str], None]] = None,
    on_tick: Optional[Callable[[float], None]] = None,
) -> float:
    """Run ``cmd`` with its output appended to ``log_path`` (after a ``$ command`` line), call
    ``on_line`` per line it writes and ``on_tick(seconds so far)`` every poll; return the seconds it
    ran. Ends the child if anything (a signal included) interrupts; RuntimeError with the log's tail
    if it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
    start, offset, pending, proc = time.time(), log_path.stat().st_size, b"", None

    def follow() -> None:
        nonlocal offset, pending
        with open(log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
        offset += len(data)
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            on_line(line.decode("utf-8", errors="replace").rstrip("\r"))

    try:
        with open(log_path, "ab") as sink:
            proc = subprocess.Popen(
                cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with(os.getpid()),
            )  # fmt: skip
        RUNNING.append(proc)
        while proc.poll() is None:
            if on_line is not None:
                follow()
            if on_tick is not None:
                on_tick(time.time() - start)
            time.sleep(POLL_SECONDS)
        if on_line is not None:
            follow()
            if pending:  # a last line without its newline
                on_line(pending.decode("utf-8", errors="replace"))
    except BaseException as e:
        if proc is not None and proc.poll() is None:
            end_child(proc)
            if isinstance(e, SweepStopped):
                e.ended.append(f"{Path(cmd[0]).name} (PID {proc.pid})")
        raise
    finally:
        if proc in RUNNING:
            RUNNING.remove(proc)
    seconds = time.time() - start
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
        raise RuntimeError(
            f"{Path(cmd[0]).name} failed with exit code {proc.returncode}; log {log_path}:\n" + "\n".join(tail)
        )
    return seconds


# -- the lock -------------------------------------------------------------------------------------
class LockedError(RuntimeError):
    """Another sweep holds the ``--out-dir``."""


@contextlib.contextmanager
def out_dir_lock(out: Path, command: str, log: Callable[[str], None]) -> Iterator[Path]:
    """Hold ``out/sweep.lock`` while inside: an exclusive ``flock`` (the kernel drops it when its
    holder dies, however it dies, so liveness needs no PID check) on a file naming the holder (PID,
    start, command). A held lock raises :class:`LockedError` naming the running sweep; a file left
    by a dead sweep is taken over, saying so."""
    out.mkdir(parents=True, exist_ok=True)
    lock = out / "sweep.lock"
    try:
        import fcntl
    except ImportError:  # not POSIX
        log(f"--out-dir {out} is not locked on this system: run one sweep there at a time")
        yield lock
        return
    for _ in range(5):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited: children never hold it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = _holder(fd)
            os.close(fd)
            raise LockedError(
                f"--out-dir {out} is in use by a running sweep ({_describe(held)}); wait for it, stop it "
                f"(kill {held.get('pid', 'its PID')}: its runs resume later), or use another --out-dir"
            ) from None
        if _same_file(fd, lock):
            break
        os.close(fd)  # the holder released and removed it between our open and flock: again
    else:
        raise LockedError(f"--out-dir {out}: could not take {lock} (other sweeps keep starting there)")
    try:
        held = _holder(fd)
        if held:
            log(f"taking over the lock of a sweep that no longer runs ({_describe(held)}): {lock}")
        mine = {"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(mine) + "\n").encode("utf-8"), 0)
        yield lock
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()  # before the unlock: a sweep that opened it meanwhile sees another file and retries
        os.close(fd)


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 65536, 0).decode("utf-8") or "{}")
    except ValueError:
        return {"pid": "?", "command": "(an unreadable lock file)"}


def _describe(held: dict) -> str:
    return f"PID {held.get('pid', '?')}, started {held.get('started', '?')}: {held.get('command', '?')}"


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


# -- a command under the lock and the signals -----------------------------------------------------
def run_locked(
    ap, out: Path, prog: str, argv: Sequence[str], body: Callable[[], int], log: Callable[[str], None]
) -> int:
    """``body()`` with ``out`` locked and SIGTERM/SIGINT/SIGHUP ending the running child; a held lock
    is ``ap.error``; a stop prints what it ended and returns 128 + the signal (attn-reg-mt-sweep's and
    attn-reg-mt-compare's main)."""
    try:
        with stop_on_signals(), out_dir_lock(out, shlex.join([prog, *argv]), log):
            return body()
    except LockedError as e:
        ap.error(str(e))
    except (SweepStopped, KeyboardInterrupt) as e:
        signum = getattr(e, "signum", 2)
        ended = ", ".join(getattr(e, "ended", [])) or "no child was running"
        print(
            f"{prog}: stopped by {signal.Signals(signum).name}: ended {ended}; finished runs are kept, the "
            "same command resumes the rest",
            file=sys.stderr,
        )
        return 128 + signum
