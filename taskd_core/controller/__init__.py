"""The TaskD recovery controller: a ClusterD-compatible ``Recover`` gRPC service.

Public surface: :class:`~taskd_core.controller.server.EmbeddedController` (an
in-process controller for launchers and tests), :func:`~taskd_core.controller.server.serve`
and :class:`~taskd_core.controller.server.ControllerConfig` (the daemon),
:func:`~taskd_core.controller.policy.load_policies` (policy files).

Modules: ``policy`` (job policies), ``machine`` (the per-job recovery state
machine, no I/O), ``store`` (the storage interface and its values) with
``store_sqlite`` (one file, the default) and ``store_etcd`` (a key prefix in etcd,
fenced writes) over ``etcd_client`` (etcd's v3 gRPC API), ``election`` (one leader
per etcd prefix, through a lease), ``replica`` (lead and serve, or stand by),
``subscriber`` (one signal stream), ``runtime`` (jobs, agents, timers), ``metrics``
(Prometheus), ``service`` (protobuf <-> runtime, status codes), ``server`` (gRPC
server, ``serve``, ``EmbeddedController``).

Replicas
--------
With ``state="etcd://HOST:PORT[,...]/PREFIX"`` any number of controllers share one
state; one leads and serves, the others answer every RPC with gRPC UNAVAILABLE and
the leader's address in the trailing metadata ``taskd-leader`` (health: SERVING on
the leader only; ``taskd.Replica`` SERVING on all). ``QueryStatus`` names the leader
and its generation (fields 110, 111). See docs/deploy.md.

Embedding
---------
``EmbeddedController(listen="127.0.0.1:0", state=":memory:", defaults=JobPolicy(...), *,
policies=None, keepalive_interval=5.0, grace=1.0, start_timeout=10.0)`` starts a
controller on its own event loop in a daemon thread and returns once it
serves; ``.address`` ("127.0.0.1:PORT"), ``.port``, ``.stop(timeout=5.0)``
(graceful, bounded, idempotent); also a context manager. ``serve(config, *,
stop=None, on_ready=None, handle_signals=False)`` is the same server for an
existing event loop.

The recovery cycle
------------------
States (``machine.State``): idle, flushing, wait-stop, wait-strategies,
wait-status, finished, given-up. Events: a fault, each agent's stop / strategy
/ status report, a deadline, an agent's exit. ``machine._TABLE`` maps
``(state, event)`` to its handler; anything else is ORDER_MIX (401).
``finished`` and ``given-up`` are final: a given-up job keeps re-sending
``killMaster`` to agents that subscribe again, and takes no more faults (401).

Agent identity and report attribution
-------------------------------------
A job may have several agents (one per node). An agent is known by
``ClientInfo.agentId`` (extension field 100) or, when that is empty (legacy
clients), by its ``role`` (e.g. ``"master agent"``). Every agent Registers and
Subscribes under that identity; a second live stream for the same identity is
refused with gRPC ``ALREADY_EXISTS``. A report (``Report*`` RPCs, field 100
``agentId``) names its agent; a report without one is attributed to the job's
only agent when it has exactly one, and is answered 409 when there are several.
A ``ReportProcessFault`` without agentId is always accepted (faults are never
dropped for want of a reporter).

Status codes per RPC (``taskd_core.models.Code``)
------------------------------------------------
* ``Init``: 0; 403 recovery off in the job's policy; 409 bad jobId; 500 too many jobs.
* ``Register``: 0 (idempotent); 408 before Init; 409 bad jobId or rankIds.
* ``SubscribeProcessManageSignal``: a stream; gRPC NOT_FOUND for an unregistered
  job or agent (the reference uses UNKNOWN), INVALID_ARGUMENT for bad fields,
  ALREADY_EXISTS for a second stream of one agent.
* ``ReportStopComplete`` / ``ReportRecoverStrategy`` / ``ReportRecoverStatus``:
  0 accepted (also for a repeated report); 400 job or agent not registered;
  401 the report does not fit the cycle step, its uuid (field 101) or its
  members; 409 bad fields or missing agentId in a multi-agent job.
* ``ReportProcessFault``: 0; 400 unregistered; 401 job finished or given up;
  409 bad or empty fault ranks (more than 65 536 too), an unknown ``faultType``,
  or a ``detail`` (field 101) over 64 KiB.
* ``HealthCheck``: always 0 ``"jobId=…, receive HeathCheck"`` (reference typo);
  a known agent's ``ClientInfo.progress`` (field 103, cut to 1000 characters)
  is kept and shown as ``AgentView.progress``.

Fault types (``FaultRank.faultType``)
-------------------------------------
The reference's "0" (on-chip memory, retryable), "1" (the process died) and
"2" (network, retryable), plus TaskD's "3": **hang**. The node agent found
the rank making no progress (stopped or in ``D`` state beyond a bound, silent
past its heartbeat or section timeout, or past a torch elastic file timer),
took its Python stack and killed it; the report's ``detail`` carries the
reason and the stack, which the journal keeps in the ``fault`` event's
``evidence``. A hang is recovered like a death: never by ``retry``, and once
a rank is known dead or hung, a later retryable report does not change its kind.
* ``ReportAgentExit``: 0; 400; 409. ``SetJobPolicy``: 0; 409 invalid value.
  ``QueryStatus``: ``status.code`` 0, or 400 for an unknown job.
* ``ReportWorkerEvents``: 0; 400 job or agent not registered; 403 wrong token;
  409 a malformed event (kind, rank, pid, time) or more than 65 536 events.
* ``QueryEvents``: ``status.code`` 0 with at most 1000 entries after ``afterSeq``;
  400 unknown job; 403 without the job's (or the admin) token; 409 bad jobId.

Metrics
-------
``metrics`` (Prometheus, docs/metrics.md): counters fed from the journal as it
is written, gauges read on the event loop at scrape time, served on
``ControllerConfig.metrics_port`` (HTTPS with the controller's TLS settings).
"""

from __future__ import annotations

import importlib
from typing import Any

# Resolved on first use: launchers import the policy helpers before they may
# import grpc (see taskd_core.forkserver.forksafe), and server imports grpc.
_EXPORTS = {
    "PolicyBook": "taskd_core.controller.policy",
    "load_policies": "taskd_core.controller.policy",
    "ControllerConfig": "taskd_core.controller.server",
    "EmbeddedController": "taskd_core.controller.server",
    "serve": "taskd_core.controller.server",
}

__all__ = ["ControllerConfig", "EmbeddedController", "PolicyBook", "load_policies", "serve"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
