"""TaskD adapter for PyTorch: ``taskdrun`` and the elastic agent it runs under the TaskD node agent.

Importing this package imports nothing (``PytorchAdapter`` resolves on first
use, PEP 562): a worker that ``multiprocessing`` spawns runs taskdrun's entry
module (:mod:`taskd_pytorch._entry`) and must not pay for the launcher.
:mod:`taskd_pytorch.adapter` is the entry point of group ``taskd`` named
``pytorch``, and torch is loaded only when ``taskdrun`` builds its agent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from taskd_pytorch.adapter import PytorchAdapter

__all__ = ["PytorchAdapter"]


def __getattr__(name: str) -> Any:
    if name == "PytorchAdapter":
        from taskd_pytorch.adapter import PytorchAdapter

        return PytorchAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
