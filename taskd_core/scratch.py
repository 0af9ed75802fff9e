"""The temporary directories a launcher makes, named so that its lifeline finds them.

Each is ``<tmp>/taskd-<kind>-<launcher pid>-<random>``: the progress socket of the hang
watcher (``progress``), live recovery's channel (``live``). Their owners remove them when
they close; a launcher killed by SIGKILL closes nothing, so its lifeline's guard removes
every directory :func:`scratch_pattern` matches once the launcher is gone.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def scratch_dir(kind: str) -> Path:
    """A new private directory (0700) for this process's ``kind`` of files."""
    return Path(tempfile.mkdtemp(prefix=f"taskd-{kind}-{os.getpid()}-"))


def scratch_pattern() -> str:
    """The glob matching every directory :func:`scratch_dir` makes in this process."""
    return os.path.join(tempfile.gettempdir(), f"taskd-*-{os.getpid()}-*")
