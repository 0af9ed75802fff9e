"""The guard process of :mod:`taskd_core.forkserver.lifeline` (run by path, with ``python -I -S``).

It imports nothing from TaskD, so it starts in milliseconds. Its stdin is a
pipe from the launcher carrying one line per change: ``+PID`` (a worker
group to guard), ``-PID`` (gone, forget it), ``mTOKEN`` (the job scope's
marker), ``cPATH`` (the job's cgroup), ``tGLOB`` (the launcher's temporary
directories) or ``q`` (the launcher ends in order: exit without killing).
End of file without ``q`` means the launcher died: every guarded group gets
SIGKILL at once, then every other process of the job's scope
(:func:`taskd_core.forkserver.jobscope.end`, loaded by path only then), and
the temporary directories are removed.
"""

import glob
import importlib.util
import os
import shutil
import signal
import sys
from pathlib import Path


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        # Not a group leader (a worker started without its own session): the process alone.
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    except PermissionError:
        pass


def _end_scope(cgroups: list[Path], token: str | None) -> None:
    spec = importlib.util.spec_from_file_location("_taskd_jobscope", Path(__file__).with_name("jobscope.py"))
    if spec is None or spec.loader is None:
        return
    jobscope = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jobscope)
    jobscope.end(cgroups, token)


def main() -> int:
    guarded: set[int] = set()
    cgroups: list[Path] = []
    token: str | None = None
    scratch: list[str] = []
    for line in sys.stdin:
        word = line.rstrip("\n")
        if word == "q":
            return 0
        if word[:1] in "+-" and word[1:].isdigit():
            pid = int(word[1:])
            if word[0] == "+":
                guarded.add(pid)
            else:
                guarded.discard(pid)
        elif word[:1] == "m":
            token = word[1:]
        elif word[:1] == "c":
            cgroups.append(Path(word[1:]))
        elif word[:1] == "t":
            scratch.append(word[1:])
    for pid in sorted(guarded):
        _kill(pid)
    if token is not None or cgroups:
        _end_scope(cgroups, token)
    for pattern in scratch:
        for path in glob.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    # Terminal signals belong to the launcher; the guard only ends through its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(main())
