"""TaskD adapter for PyTorch: ``taskdrun`` and the elastic agent it runs under the TaskD node agent.

Importing this package does not import torch; :mod:`taskd_pytorch.adapter` is
the entry point of group ``taskd`` named ``pytorch``, and torch is loaded only
when ``taskdrun`` builds its agent.
"""

from __future__ import annotations

from taskd_pytorch.adapter import PytorchAdapter

__all__ = ["PytorchAdapter"]
