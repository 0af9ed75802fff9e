"""The temporary directories a launcher makes, named so that its lifeline finds them.

Each is ``<tmp>/taskd-<kind>-<launcher pid>-<random>``: the progress socket of the hang
watcher (``progress``), live recovery's channel (``live``). Their owners remove them when
they close; a launcher killed by SIGKILL closes nothing, so its lifeline's guard removes
every directory :func:`scratch_pattern` matches once the launcher is gone.
:func:`check_temp_dir` says in one line, before anything starts, that there is nowhere to make them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from taskd_core.errors import ConfigError


def scratch_dir(kind: str) -> Path:
    """A new private directory (0700) for this process's ``kind`` of files."""
    return Path(tempfile.mkdtemp(prefix=f"taskd-{kind}-{os.getpid()}-"))


def scratch_pattern() -> str | None:
    """The glob matching every directory :func:`scratch_dir` makes in this process; None when there
    is no usable temporary directory (the launcher's settings then refuse to start, in one line)."""
    try:
        return os.path.join(tempfile.gettempdir(), f"taskd-*-{os.getpid()}-*")
    except FileNotFoundError:
        return None


def check_temp_dir(env: Mapping[str, str]) -> None:
    """Raise :class:`ConfigError` unless Python finds a usable temporary directory.

    The node agent and live recovery make their files there once workers run;
    finding out then would end the job midway, with a traceback.
    """
    try:
        tempfile.gettempdir()
    except FileNotFoundError:
        given = env.get("TMPDIR", "")
        where = f"TMPDIR={given!r} is not a writable directory, nor" if given else "none of"
        raise ConfigError(
            f"no usable temporary directory: {where} /tmp, /var/tmp, /usr/tmp or the current directory "
            "is writable; set TMPDIR to a writable directory"
        ) from None
