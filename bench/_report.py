"""Markdown templates with named fields: the prose of ``docs/benchmarks.md``, filled from the benches' results.

A template (``bench/templates/<name>.md``) holds the fixed text. ``{{field}}`` is
replaced by the field's value; ``{{#flag}}...{{/flag}}`` is kept only when the
field ``flag`` is true. The values come from one renderer per bench in
``run_all.py``, so every measured figure and every word that depends on an
outcome ("met", "missed", "yes") is computed from the results; the templates
only describe what each bench does.

Filling is strict: a field the template names that the renderer did not give
(or gave as None), a field given that the template never names, a flag that is
not a bool and a ``{{`` left over all raise :class:`TemplateError`, so no report
is written with a hole or a stale figure in it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
_NAME = r"[a-z_][a-z0-9_]*"
_FIELD = re.compile(r"\{\{\s*(" + _NAME + r")\s*\}\}")
_BLOCK = re.compile(r"\{\{#(" + _NAME + r")\}\}(.*?)\{\{/\1\}\}", re.S)

#: A field's value: text for ``{{field}}``, a bool for ``{{#flag}}`` blocks (None: missing).
Value = str | bool | None


class TemplateError(Exception):
    """A template and the fields given for it do not fit together."""


def load(name: str) -> str:
    """The text of ``bench/templates/<name>.md``."""
    return (TEMPLATES / f"{name}.md").read_text(encoding="utf-8")


def heading(name: str) -> str:
    """The first line of a template: its section's heading."""
    return load(name).split("\n", 1)[0]


def fill(name: str, fields: Mapping[str, Value], text: str | None = None) -> str:
    """``text`` (by default the template ``name``) with its blocks decided and its fields filled.

    :raises TemplateError: naming the template and the field, for any misfit (see the module).
    """
    source = load(name) if text is None else text
    used: set[str] = set()

    def block(match: re.Match[str]) -> str:
        flag, body = match.group(1), match.group(2)
        value = fields.get(flag)
        if not isinstance(value, bool):
            raise TemplateError(f"template {name}: block {flag!r} needs a true/false field, got {value!r}")
        used.add(flag)
        if not value:
            used.update(_FIELD.findall(body))  # fields only a dropped block names may be left out
            return ""
        return body

    def field(match: re.Match[str]) -> str:
        key = match.group(1)
        value = fields.get(key)
        if value is None:
            raise TemplateError(f"template {name}: field {key!r} has no value")
        if isinstance(value, bool):
            raise TemplateError(f"template {name}: field {key!r} is a flag ({value}); only blocks take flags")
        used.add(key)
        return value

    decided = _BLOCK.sub(block, source)
    bare = _FIELD.sub("", decided)
    if "{{" in bare:
        left = bare[bare.find("{{") :][:60]
        raise TemplateError(f"template {name}: a malformed or unclosed {{{{...}}}} is left: {left!r}")
    out = _FIELD.sub(field, decided)
    unused = sorted(set(fields) - used)
    if unused:
        raise TemplateError(f"template {name}: fields {unused} are given but the template names none of them")
    # A dropped block leaves its blank lines behind; every filled template ends with one newline.
    return re.sub(r"\n{3,}", "\n\n", out).rstrip("\n") + "\n"
