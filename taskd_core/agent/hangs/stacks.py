"""Taking a hung worker's Python stack, every thread, before it is killed.

``py-spy dump`` where installed (it reads the process's memory without
stopping it, so it works on a stopped or ``D``-state worker); else the
``faulthandler`` dump that :mod:`taskd_core.worker` arranges on
:data:`~taskd_core.worker.STACK_SIGNAL`, which the worker writes itself. Both
share one time budget. The stack also goes into the worker's own output.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from taskd_core.worker import STACK_SIGNAL, stack_file

logger = logging.getLogger(__name__)


def py_spy() -> str | None:
    """The ``py-spy`` executable: on PATH or beside this interpreter (a virtualenv's bin)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else None


def capture_stack(pid: int, socket_path: str | None, timeout: float) -> str:
    """Every thread's Python stack of ``pid``: py-spy, else the worker's faulthandler dump.

    Both share ``timeout``: a py-spy slowed down by a busy machine leaves the
    rest of it to the dump, which the worker writes itself in microseconds.
    ``socket_path``: the progress socket the worker reports to (its dump file is beside it).
    """
    deadline = time.monotonic() + timeout
    spy = py_spy()
    if spy is not None:
        try:
            # --nonblocking reads memory without ptrace-stopping the target: safe on a stopped or
            # D-state worker.
            done = subprocess.run(
                [spy, "dump", "--pid", str(pid), "--nonblocking"],
                capture_output=True,
                text=True,
                # The dump gets a share of the time in any case.
                timeout=timeout * 0.75,
                check=False,
            )
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout
            logger.warning(
                "py-spy could not read pid %s: %s", pid, (done.stderr or done.stdout).strip()[-500:]
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            logger.warning("py-spy could not read pid %s: %s", pid, exc)
    if socket_path is not None:
        dumped = _faulthandler_dump(pid, stack_file(socket_path, pid), deadline - time.monotonic())
        if dumped:
            return "(faulthandler dump)\n" + dumped
    return "(no stack: py-spy is not installed and the worker arranged no faulthandler dump)\n"


def _faulthandler_dump(pid: int, path: Path, timeout: float) -> str:
    try:
        before = path.stat().st_size
    except OSError:
        return ""  # the worker never used the worker API, so nobody listens on the dump signal
    try:
        os.kill(pid, STACK_SIGNAL)
        # A stopped worker runs no handler; it is killed right after, so letting it run is harmless.
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return ""
    deadline = time.monotonic() + timeout
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            now = path.stat().st_size
        except OSError:
            return ""
        if now > before and now == size:  # grew, then stopped growing: the dump is complete
            break
        size = now
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(before)
            return f.read()
    except OSError:
        return ""


def write_to_worker_output(pid: int, text: str) -> None:
    """Append ``text`` to the worker's own stdout (its log file under every launcher here)."""
    try:
        with open(f"/proc/{pid}/fd/1", "a", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        logger.info("cannot write into the output of pid %s: %s", pid, exc)
