"""The ``pytorch`` framework adapter: TaskD's hooks carried out by a torch elastic agent.

:class:`PytorchAdapter` is what the entry point ``pytorch`` of group ``taskd``
names. ``taskdrun`` builds it around its :class:`~taskd_pytorch.elastic.TaskdElasticAgent`
and hands it to the node agent with ``load_adapter("pytorch", instance=...)``.
Built without an agent (as ``taskd plugins`` does), it can only declare its
strategies; the control hooks then fail with a message saying to use ``taskdrun``.

This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from taskd_core.errors import ConfigError
from taskd_core.models import Strategy, WorkerStatus
from taskd_core.plugins import hookimpl, require_module

#: The command that installs the framework, in every message that says it is missing.
INSTALL_TORCH = "pip install 'taskd-pytorch[framework]'"


def require_torch() -> None:
    """Raise :class:`~taskd_core.errors.FrameworkMissingError` (with :data:`INSTALL_TORCH`) without torch."""
    require_module("pytorch", "torch", "PyTorch (module torch)", INSTALL_TORCH)


class WorkerControl(Protocol):
    """The worker operations an adapter delegates to (``TaskdElasticAgent`` implements them)."""

    def restart_all(self) -> Mapping[int, int]: ...

    def restart_list(self, local_ranks: Sequence[int]) -> Mapping[int, int]: ...

    def resize(self, group_rank: int, group_world_size: int) -> None: ...

    def stop(self, local_ranks: Sequence[int] | None, timeout: float) -> None: ...

    def statuses(self) -> Mapping[int, WorkerStatus]: ...

    def live_ready(self) -> bool: ...

    def begin_round(self, round_no: int) -> None: ...

    def await_round(self, round_no: int, timeout: float) -> bool: ...


#: Every job can be restarted whole, dumped or ended (``recover-live`` is added
#: when every local worker uses :mod:`taskd_pytorch.live`). Restarting single ranks
#: is not offered by default: in a DDP job the healthy ranks block or fail in
#: their next collective when a peer restarts, so they cannot survive it.
DEFAULT_STRATEGIES: tuple[Strategy, ...] = (Strategy.RECOVER, Strategy.DUMP, Strategy.EXIT)


class PytorchAdapter:
    """TaskD hooks for the workers of one ``taskdrun`` node.

    :param agent: the elastic agent that owns the workers.
    :param in_place: the job declares that its healthy ranks survive a peer's
        restart (no collectives between them), so ``recover-in-place`` is offered too.
    """

    def __init__(self, agent: WorkerControl | None = None, *, in_place: bool = False) -> None:
        require_torch()
        self._agent = agent
        self._strategies = ((Strategy.RECOVER_IN_PLACE,) if in_place else ()) + DEFAULT_STRATEGIES

    @property
    def agent(self) -> WorkerControl:
        if self._agent is None:
            raise ConfigError(
                "the pytorch adapter controls workers only inside taskdrun, which gives it an agent"
            )
        return self._agent

    @hookimpl
    def taskd_strategies(self) -> list[str]:
        # Asked after a fault: the lost ranks' marks from their last life still count.
        live = (Strategy.RECOVER_LIVE,) if self._agent is not None and self._agent.live_ready() else ()
        return [s.value for s in live + self._strategies]

    @hookimpl
    def taskd_stop_workers(self, local_ranks: Sequence[int] | None, timeout: float) -> bool:
        self.agent.stop(local_ranks, timeout)
        return True

    @hookimpl
    def taskd_restart_all(self) -> bool:
        self.agent.restart_all()
        return True

    @hookimpl
    def taskd_restart_list(self, local_ranks: Sequence[int]) -> bool:
        self.agent.restart_list(local_ranks)
        return True

    @hookimpl
    def taskd_resize(self, node_rank: int, nodes: int) -> bool:
        self.agent.resize(node_rank, nodes)
        return True

    @hookimpl
    def taskd_begin_round(self, round_no: int) -> bool:
        self.agent.begin_round(round_no)
        return True

    @hookimpl
    def taskd_await_round(self, round_no: int, timeout: float) -> bool:
        return self.agent.await_round(round_no, timeout)

    @hookimpl
    def taskd_monitor(self) -> dict[int, WorkerStatus]:
        return dict(self.agent.statuses())
