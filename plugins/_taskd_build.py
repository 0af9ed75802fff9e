"""PEP 517 build backend of the adapter distributions: setuptools, finding taskd-core in a checkout.

taskd-core is not on a package index, so ``pip install ./plugins/pytorch``
from a TaskD checkout could not satisfy the adapter's ``taskd-core``
requirement. When an adapter is built in place inside a checkout (two levels
up is taskd-core's ``pyproject.toml``), the metadata pip resolves against
names that checkout instead (``taskd-core @ file:///...``), and pip installs
the core from it. Wheels built for distribution are built from the sdist,
outside any checkout (``python -m build``), and keep the plain requirement.

Each adapter reaches this file through a link of the same name in its own
directory (``backend-path`` must lie inside the project).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  # every hook not overridden below

CORE = "taskd-core"
#: The core's unconditional requirement line (extras' lines carry a ";" marker).
_CORE_LINE = re.compile(rf"Requires-Dist:\s*{CORE}\s*(?:[<>=!~(]|$)")


def _checkout_core() -> Path | None:
    """The TaskD checkout this adapter is being built in, or None outside one (an unpacked sdist)."""
    root = Path.cwd().resolve().parent.parent
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return root if project.get("project", {}).get("name") == CORE else None


def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: dict[str, str | list[str]] | None = None
) -> str:
    name: str = _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)
    root = _checkout_core()
    if root is not None:
        metadata = Path(metadata_directory) / name / "METADATA"
        lines = metadata.read_text(encoding="utf-8").splitlines(keepends=True)
        pinned = f"Requires-Dist: {CORE} @ {root.as_uri()}\n"
        metadata.write_text(
            "".join(pinned if _CORE_LINE.match(line) and ";" not in line else line for line in lines),
            encoding="utf-8",
        )
    return name
