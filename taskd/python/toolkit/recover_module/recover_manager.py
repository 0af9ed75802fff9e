"""Compatibility path of the seed document: ``DLRecoverManager`` and the report functions.

Here ``start_subscribe(frame)`` acts on workers: without a ``handler`` the
manager builds the core's action dispatcher over the adapter named ``frame``
(:func:`taskd_core.agent.frame.frame_handler`). A launcher of one's own
attaches its workers by passing ``adapter=``, an object with the ``taskd_*``
hooks over the workers it started (see README, "Your own launcher").

The module functions act on the most recently created, still open
:class:`DLRecoverManager`, as the reference's singleton did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from taskd_core.agent.frame import frame_handler
from taskd_core.client import manager
from taskd_core.client.manager import SignalHandler, active_manager
from taskd_core.rpc import recover_pb2 as pb


class DLRecoverManager(manager.DLRecoverManager):
    """The seed's client; ``start_subscribe(frame)`` carries signals out on ``frame``'s workers.

    :param adapter: the adapter object over this process's workers, for a
        ``frame`` whose installed adapter cannot find them by itself.
    """

    def __init__(
        self, info: pb.ClientInfo, server_addr: str, *, adapter: object | None = None, **kwargs: Any
    ) -> None:
        def build(frame: str, reporter: manager.DLRecoverManager) -> SignalHandler:
            return frame_handler(frame, reporter, adapter).handle

        kwargs.setdefault("handler_factory", build)
        super().__init__(info, server_addr, **kwargs)


def report_stop_complete(code: int, msg: str, fault_ranks: Mapping[int, int]) -> int:
    return active_manager().report_stop_complete(code, msg, fault_ranks)


def report_recover_strategy(fault_ranks: Mapping[int, int], strategy_list: Iterable[str]) -> int:
    return active_manager().report_recover_strategy(fault_ranks, strategy_list)


def report_recover_status(code: int, msg: str, fault_ranks: Mapping[int, int], strategy: str) -> int:
    return active_manager().report_recover_status(code, msg, fault_ranks, strategy)


def report_process_fault(
    fault_ranks: Mapping[int, int], fault_codes: Mapping[int, object] | None = None
) -> int:
    return active_manager().report_process_fault(fault_ranks, fault_codes)


__all__ = [
    "DLRecoverManager",
    "report_process_fault",
    "report_recover_status",
    "report_recover_strategy",
    "report_stop_complete",
]
