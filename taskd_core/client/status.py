"""Asking a controller what it knows (the ``QueryStatus`` extension RPC), as plain data."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import json_format

from taskd_core.client.endpoints import Endpoints, controller_addresses
from taskd_core.errors import ControllerUnavailableError, TaskdError
from taskd_core.models import Credentials
from taskd_core.rpc import recover_pb2 as pb


def _ask(
    address: str, job_id: str, events: int, timeout: float, credentials: Credentials | None
) -> pb.ControllerStatus:
    """``address`` may name several replicas (``A,B,C``): the leader answers, a standby says where it is."""
    endpoints = Endpoints(controller_addresses(address), credentials or Credentials())
    try:
        reply: pb.ControllerStatus = endpoints.call(
            "QueryStatus", pb.StatusQuery(jobId=job_id, events=events), timeout
        )
    except grpc.RpcError as exc:
        details = (exc.details() or str(exc.code())).splitlines()[0]
        raise ControllerUnavailableError(address, timeout, ConnectionError(details)) from None
    finally:
        endpoints.close()
    if reply.status.code != 0:
        raise TaskdError(f"controller refused: {reply.status.info} (code {reply.status.code})")
    return reply


def query_status(
    address: str,
    job_id: str = "",
    events: int = 0,
    timeout: float = 5.0,
    credentials: Credentials | None = None,
) -> dict[str, Any]:
    """The controller's jobs (all, or ``job_id``'s) with agents and the newest ``events`` journal entries.

    The result is the ``ControllerStatus`` message as a JSON-ready dict with
    every field present (``{"jobs": [{"jobId": ..., "agents": [...], ...}]}``),
    what ``taskd status --json`` prints.

    :param credentials: TLS files and the job's (or the admin) token to present.
    :raises ControllerUnavailableError: the controller did not answer in ``timeout``.
    :raises TaskdError: it answered with a non-zero code (e.g. 400 for an unknown job).
    """
    reply = _ask(address, job_id, events, timeout, credentials)
    status: dict[str, Any] = json_format.MessageToDict(reply, always_print_fields_with_no_presence=True)
    return status


def ended_agents(
    address: str, job_id: str, timeout: float = 5.0, credentials: Credentials | None = None
) -> int:
    """How many agents of ``job_id`` have reported their end to the controller at ``address``.

    :raises ControllerUnavailableError: the controller did not answer in ``timeout``.
    :raises TaskdError: it answered with a non-zero code (400: the job is not registered).
    """
    reply = _ask(address, job_id, 0, timeout, credentials)
    return sum(1 for job in reply.jobs for agent in job.agents if agent.exitState)
