"""Test support: wheels of what is installed here, so fresh virtualenvs install without an index.

The packaging tests install TaskD into fresh virtualenvs with ``--no-index``.
Their third-party requirements come from this environment: each installed
distribution is packed back into a wheel from the files its ``RECORD`` lists,
so the fresh environments get exactly the versions the suite runs with,
offline and in well under a second per wheel.
"""

from __future__ import annotations

import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: Files pip writes at install time; a wheel must not carry them.
_INSTALL_ONLY = {"INSTALLER", "REQUESTED", "direct_url.json"}


def requirement_closure(names: list[str]) -> list[str]:
    """The installed distributions ``names`` need at run time (no extras), themselves included."""
    seen: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist.metadata["Name"]
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(seen.values())


def repack(name: str, out: Path) -> Path:
    """Wheel of installed distribution ``name`` in ``out``."""
    dist = metadata.distribution(name)
    wheel_info = dist.read_text("WHEEL") or ""
    tag = next(line.split(":", 1)[1].strip() for line in wheel_info.splitlines() if line.startswith("Tag:"))
    target = out / f"{canonicalize_name(name).replace('-', '_')}-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as whl:
        for file in dist.files or ():
            if file.suffix == ".pyc" or file.name in _INSTALL_ONLY or file.parts[0] == "..":
                continue
            whl.write(Path(str(dist.locate_file(file))), str(file))
    return target
