"""Reading a job's event journal from a controller (the ``QueryEvents`` extension RPC).

:class:`JournalClient` keeps one channel open and reads pages after a
cursor, oldest first; ``taskd events`` and ``taskd timeline`` use it.
"""

from __future__ import annotations

import json
from types import TracebackType
from typing import Self

import grpc

from taskd_core.client.endpoints import Endpoints, controller_addresses
from taskd_core.errors import ControllerUnavailableError, TaskdError
from taskd_core.models import Credentials, JournalEvent
from taskd_core.rpc import recover_pb2 as pb

#: Journal entries asked for per call.
PAGE = 1000


def _event(job_id: str, view: pb.EventView) -> JournalEvent:
    try:
        detail = json.loads(view.detail) if view.detail else {}
    except json.JSONDecodeError:
        detail = {"text": view.detail}
    return JournalEvent(view.seq, view.time, job_id, view.cycle, view.kind, detail)


class JournalClient:
    """A controller's journal, page by page; use as a context manager."""

    def __init__(self, address: str, credentials: Credentials | None = None, timeout: float = 5.0) -> None:
        """``address``: the controller, or its replicas comma-separated (the leader answers)."""
        self.address = address
        self.timeout = timeout
        self._endpoints = Endpoints(controller_addresses(address), credentials or Credentials())

    def page(self, job_id: str, after: int = 0, limit: int = PAGE) -> tuple[list[JournalEvent], str]:
        """Up to ``limit`` entries with ``seq > after``, oldest first, and the job's state.

        :raises ControllerUnavailableError: the controller did not answer in the timeout.
        :raises TaskdError: it refused (400 for a job it does not know).
        """
        query = pb.EventQuery(jobId=job_id, afterSeq=after, limit=limit)
        try:
            reply = self._endpoints.call("QueryEvents", query, self.timeout)
        except grpc.RpcError as exc:
            raise ControllerUnavailableError(
                self.address, self.timeout, ConnectionError(exc.details())
            ) from None
        if reply.status.code != 0:
            raise TaskdError(f"controller refused: {reply.status.info} (code {reply.status.code})")
        return [_event(job_id, v) for v in reply.events], reply.state

    def close(self) -> None:
        self._endpoints.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
