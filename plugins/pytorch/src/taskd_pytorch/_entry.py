"""The ``taskdrun`` command's entry module, which imports nothing at module level.

``multiprocessing``'s spawn start method (torch's, for function entry points and
``--run-path``) runs the launcher's main module again in every worker it starts:
with this module as the command's target, a spawned worker imports nothing of
TaskD beyond this file and the package's own ``__init__`` (also empty of imports);
:func:`console_main` imports the launcher only when the command really runs.
"""

from __future__ import annotations

from typing import NoReturn


def console_main() -> NoReturn:
    """Run ``taskdrun`` (:func:`taskd_pytorch.cli.console_main`)."""
    from taskd_pytorch.cli import console_main as run

    run()
