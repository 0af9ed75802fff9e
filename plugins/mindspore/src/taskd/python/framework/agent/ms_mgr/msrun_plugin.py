"""Seed import path of ``MSRunPlugin`` (real msrun imports exactly this); a re-export of :mod:`taskd_mindspore`."""

from __future__ import annotations

from taskd_mindspore.plugin import MSRunPlugin

__all__ = ["MSRunPlugin"]
