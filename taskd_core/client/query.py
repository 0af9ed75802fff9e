"""Asking a controller what it knows: one client of its read-only RPCs, answering with model values.

:class:`QueryClient` wraps ``QueryStatus`` (jobs, agents, cycle, newest journal
entries) and ``QueryEvents`` (a job's journal page by page) and returns
:class:`~taskd_core.models.ControllerStatus`, :class:`~taskd_core.models.JobStatus`
and :class:`~taskd_core.models.JournalPage`, never protobuf. ``taskd status``,
``taskd events``, ``taskd timeline``, the launchers and the benchmarks use it;
so can an adapter's own tests and tools::

    with QueryClient("127.0.0.1:8899") as controller:   # or "A:8899,B:8899,C:8899": the leader answers
        job = controller.job("my-job", events=20)
        print(job.state, [a.agent_id for a in job.agents], [e.kind for e in job.events])

Credentials work as for :class:`~taskd_core.client.manager.DLRecoverManager`:
by default TLS files and the job token come from ``TASKD_TLS_CA`` /
``TASKD_TLS_CERT`` / ``TASKD_TLS_KEY`` / ``TASKD_JOB_TOKEN``; pass
``Credentials(token=admin_token, ...)`` to see every job.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any, Self

import grpc

from taskd_core.client.endpoints import Endpoints, controller_addresses
from taskd_core.errors import ControllerUnavailableError, QueryRefusedError
from taskd_core.models import Code, ControllerStatus, Credentials, JobStatus, JournalPage
from taskd_core.rpc import recover_pb2 as pb
from taskd_core.rpc.convert import controller_status_from_pb, journal_page_from_pb

#: Journal entries asked for per ``QueryEvents`` call (the controller's own page size).
PAGE = 1000
#: gRPC statuses that are the server's answer, not a missing controller: no retry changes them.
_REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


class QueryClient:
    """One controller's status and journal; use as a context manager.

    :param address: ``HOST:PORT`` of the controller, or its replicas comma-separated (``A,B,C``):
        the leader answers, a standby names it and the call follows.
    :param credentials: what to present; by default from the environment (see the module).
    :param timeout: seconds each call may take.
    """

    def __init__(self, address: str, credentials: Credentials | None = None, *, timeout: float = 5.0) -> None:
        self.address = address
        self.timeout = timeout
        self._endpoints = Endpoints(
            controller_addresses(address), credentials or Credentials.from_env(os.environ)
        )

    def status(self, job_id: str = "", events: int = 0) -> ControllerStatus:
        """Every job the caller may see (or only ``job_id``), each with its newest ``events`` entries.

        :raises ControllerUnavailableError: the controller did not answer in the timeout.
        :raises QueryRefusedError: it refused (400: it does not know ``job_id``; 403: not the job's token).
        :raises ProtocolError: the answer holds values no TaskD controller sends.
        """
        query = pb.StatusQuery(jobId=job_id, events=events)
        reply = self._call("QueryStatus", query)
        return controller_status_from_pb(reply)

    def job(self, job_id: str, events: int = 0) -> JobStatus:
        """One job with its newest ``events`` journal entries; raises as :meth:`status` does."""
        jobs = [job for job in self.status(job_id, events).jobs if job.job_id == job_id]
        if not jobs:
            raise QueryRefusedError(self.address, "QueryStatus", int(Code.UNREGISTERED), f"no job {job_id!r}")
        return jobs[0]

    def events(self, job_id: str, after: int = 0, limit: int = PAGE) -> JournalPage:
        """At most ``limit`` entries of ``job_id``'s journal after ``after``, oldest first.

        Raises as :meth:`status` does.
        """
        query = pb.EventQuery(jobId=job_id, afterSeq=after, limit=limit)
        reply = self._call("QueryEvents", query)
        return journal_page_from_pb(job_id, reply)

    def ended_agents(self, job_id: str) -> int:
        """How many agents of ``job_id`` have reported their end; raises as :meth:`status`."""
        return sum(1 for agent in self.job(job_id).agents if agent.exit_code is not None)

    def _call(self, rpc: str, query: pb.StatusQuery | pb.EventQuery) -> Any:
        try:
            reply = self._endpoints.call(rpc, query, self.timeout)
        except grpc.RpcError as exc:
            details = (exc.details() or str(exc.code())).splitlines()[0][:200]
            if exc.code() in _REFUSALS:
                raise QueryRefusedError(self.address, rpc, exc.code().name, details) from None
            raise ControllerUnavailableError(self.address, self.timeout, ConnectionError(details)) from None
        if reply.status.code != Code.OK:
            raise QueryRefusedError(self.address, rpc, reply.status.code, reply.status.info)
        return reply

    def close(self) -> None:
        self._endpoints.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
