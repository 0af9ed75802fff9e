"""The guard process of :mod:`taskd_core.forkserver.lifeline` (run by path, with ``python -I -S``).

It imports nothing from TaskD, so it starts in milliseconds. Its stdin is a
pipe from the launcher carrying one line per change: ``+PID`` (a worker
group to guard), ``-PID`` (gone, forget it) or ``q`` (the launcher ends in
order: exit without killing). End of file without ``q`` means the launcher
died: every guarded group gets SIGKILL at once.
"""

import os
import signal
import sys


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


def main() -> int:
    guarded: set[int] = set()
    for line in sys.stdin:
        word = line.strip()
        if word == "q":
            return 0
        if word[:1] in "+-" and word[1:].isdigit():
            pid = int(word[1:])
            if word[0] == "+":
                guarded.add(pid)
            else:
                guarded.discard(pid)
    for pid in sorted(guarded):
        _kill(pid)
    return 0


if __name__ == "__main__":
    # Terminal signals belong to the launcher; the guard only ends through its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(main())
