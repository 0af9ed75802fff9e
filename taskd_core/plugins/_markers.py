"""The pluggy markers of the ``taskd`` project (kept apart to avoid import cycles)."""

from __future__ import annotations

import pluggy

#: pluggy project name, hook prefix and entry-point group.
PROJECT = "taskd"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
