"""Compatibility path of the seed document: ``DLRecoverManager`` and the report functions.

The module functions act on the most recently created, still open
:class:`DLRecoverManager`, as the reference's singleton did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from taskd_core.client.manager import DLRecoverManager, active_manager


def report_stop_complete(code: int, msg: str, fault_ranks: Mapping[int, int]) -> int:
    return active_manager().report_stop_complete(code, msg, fault_ranks)


def report_recover_strategy(fault_ranks: Mapping[int, int], strategy_list: Iterable[str]) -> int:
    return active_manager().report_recover_strategy(fault_ranks, strategy_list)


def report_recover_status(code: int, msg: str, fault_ranks: Mapping[int, int], strategy: str) -> int:
    return active_manager().report_recover_status(code, msg, fault_ranks, strategy)


def report_process_fault(fault_ranks: Mapping[int, int]) -> int:
    return active_manager().report_process_fault(fault_ranks)


__all__ = [
    "DLRecoverManager",
    "report_process_fault",
    "report_recover_status",
    "report_recover_strategy",
    "report_stop_complete",
]
