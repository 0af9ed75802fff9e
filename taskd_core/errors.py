"""The one error hierarchy of TaskD.

Every error carries the context that produced it as attributes and a message
that says what to do about it. The controller maps these to wire codes in one
place (:mod:`taskd_core.controller.service`); the CLI maps them to exit codes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar


class TaskdError(Exception):
    """Root of every error TaskD raises on purpose."""


class ConfigError(TaskdError):
    """A setting, policy file or command-line value that cannot be used."""


class ProtocolError(TaskdError):
    """A request or signal whose fields break the wire protocol's rules."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class ControllerUnavailableError(TaskdError):
    """The controller could not be reached before the deadline."""

    def __init__(self, address: str, waited: float, cause: BaseException | None = None) -> None:
        super().__init__(
            f"controller at {address} unreachable for {round(waited, 1):g} s"
            f"{f' ({cause})' if cause else ''}; check that it runs, that the address is right and, if it "
            "serves TLS, that --tls-ca / TASKD_TLS_CA names its CA (and TASKD_TLS_CERT/KEY a client "
            "certificate for mutual TLS)"
        )
        self.address = address
        self.waited = waited
        self.cause = cause


#: What to do about each refusal of :class:`RegistrationRefusedError`.
_REFUSAL_FIXES: dict[int | str, str] = {
    409: "the job id or client fields are invalid; fix the job id (printable, at most 256 characters)",
    410: "this node was declared lost and a spare took its place; start it again with the job's command "
    "line to stand by as a spare",
    500: "the controller serves as many jobs as it can; use another controller or let jobs end first",
    "PERMISSION_DENIED": "this client may not act for the job; check its job token",
    "UNAUTHENTICATED": "the controller wants credentials; give the client its token / TLS settings",
    "UNIMPLEMENTED": "the server at this address is not a TaskD/ClusterD controller; check the address",
    "RESOURCE_EXHAUSTED": "the controller's quota for this job token or host is used up (the message names "
    "the limit and its flag); let other jobs end, or have the controller's operator raise it",
}


class RefusedError(TaskdError):
    """The controller refused a call and no retry can change its answer; ``fixes`` say what to do."""

    fixes: ClassVar[Mapping[int | str, str]] = {}

    def __init__(self, address: str, rpc: str, code: int | str, info: str) -> None:
        fix = self.fixes.get(code, "see the controller's log")
        super().__init__(f"controller at {address} refused {rpc} ({code}: {info}); {fix}")
        self.address = address
        self.rpc = rpc
        self.code = code


class RegistrationRefusedError(RefusedError):
    """The controller refuses to take this client: no retry can change its answer.

    ``code`` is the wire code (409 bad job id, 500 controller full, ...) or
    the gRPC status name (``PERMISSION_DENIED``, ``UNAUTHENTICATED``).
    """

    fixes = _REFUSAL_FIXES


#: What to do about each refusal of :class:`QueryRefusedError`.
_QUERY_FIXES: dict[int | str, str] = {
    **_REFUSAL_FIXES,
    400: "the controller does not know this job; `taskd status` without --job lists the jobs it knows",
    403: "present the job's token (TASKD_JOB_TOKEN) or the controller's admin token (--admin-token-file)",
    409: "a field of the query is out of range; check the job id and the numbers asked for",
    "PERMISSION_DENIED": _REFUSAL_FIXES["UNAUTHENTICATED"],
}


class QueryRefusedError(RefusedError):
    """The controller answered a status or journal query with a refusal (no retry changes it).

    ``code`` is the wire code (400 unknown job, 403 not allowed to see it, 409 bad field)
    or the gRPC status name (``UNAUTHENTICATED``, ``UNIMPLEMENTED`` ...).
    """

    fixes = _QUERY_FIXES


class LauncherInterrupted(TaskdError):
    """A launcher was told to stop (SIGTERM, SIGINT ...) while it waited for something."""

    def __init__(self, what: str, signum: int) -> None:
        super().__init__(f"{what} interrupted by signal {signum}: the launcher is stopping")
        self.signum = signum


class RecoveryDisabledError(TaskdError):
    """The controller answered 403: process recovery is off for this job."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"process recovery is disabled for job {job_id!r} (Init answered 403); "
            "enable it in the controller's job policy"
        )
        self.job_id = job_id


class AccessDeniedError(TaskdError):
    """The controller refused this client: no job token, a wrong one, or another live launch owns the job."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"controller at {address} refused the job: {reason} (see docs/security.md)")
        self.address = address
        self.reason = reason


class PluginError(TaskdError):
    """Base of errors about framework adapters."""

    def __init__(self, message: str, *, plugin: str) -> None:
        super().__init__(message)
        self.plugin = plugin


class AdapterNotFoundError(PluginError):
    """No adapter is installed under the requested framework name."""

    def __init__(self, plugin: str, installed: list[str]) -> None:
        have = ", ".join(sorted(installed)) or "none"
        super().__init__(
            f"no TaskD adapter named {plugin!r} is installed (installed: {have}); "
            f"install the distribution that provides entry point {plugin!r} in group 'taskd'",
            plugin=plugin,
        )
        self.installed = installed


class PluginLoadError(PluginError):
    """An adapter's entry point exists but could not be loaded or validated."""

    def __init__(self, plugin: str, distribution: str, cause: BaseException) -> None:
        super().__init__(
            f"TaskD adapter {plugin!r} from distribution {distribution} failed to load: "
            f"{type(cause).__name__}: {cause}; reinstall or fix that distribution",
            plugin=plugin,
        )
        self.distribution = distribution
        self.cause = cause


class FrameworkMissingError(PluginError, ImportError):
    """An adapter, or the framework an adapter drives, is not installed in this environment.

    Also an :class:`ImportError`: msrun treats a failing import of TaskD's seed
    paths as "TaskD not there" and logs the message, which then says what to install.
    """

    def __init__(self, plugin: str, missing: str, install: str) -> None:
        super().__init__(
            f"{missing} is not installed in this environment; install it with: {install}", plugin=plugin
        )
        self.missing = missing
        self.install = install


class WorkerControlError(PluginError):
    """An adapter hook failed to stop, start or inspect workers."""

    def __init__(self, plugin: str, operation: str, reason: str, ranks: tuple[int, ...] = ()) -> None:
        where = f" for local ranks {list(ranks)}" if ranks else ""
        super().__init__(f"adapter {plugin!r} could not {operation}{where}: {reason}", plugin=plugin)
        self.operation = operation
        self.ranks = ranks


class RequestRejected(TaskdError):
    """The controller refuses a request; ``code`` is the wire ``Status.code``
    (a :class:`~taskd_core.models.Code`) and the message says what to fix."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class QuotaExceededError(TaskdError):
    """A tenant of the controller (a job token, a host) used up one of its quotas; ``limit`` names the flag.

    It ends the call with gRPC ``RESOURCE_EXHAUSTED`` (not a ``Status`` code: the
    reference has none for it, and every client treats a gRPC error as a failed call).
    """

    def __init__(self, message: str, *, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class DuplicateSubscriberError(RequestRejected):
    """A second live signal subscription for the same agent of a job."""


class IllegalTransition(TaskdError):
    """The state machine tried a transition its table does not declare: a bug in the controller."""


class StreamError(TaskdError):
    """A stream between two processes of a job broke, timed out, or its peer could not prove the job's key."""


class NotLeaderError(TaskdError):
    """This controller replica does not lead: another one serves (``leader``: its address, or "")."""

    def __init__(self, message: str, *, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


class LeadershipLostError(NotLeaderError):
    """A leading replica may no longer write: its lease expired or another replica took over."""


class StateStoreError(TaskdError):
    """The controller's state store (etcd) refused a request."""

    def __init__(self, where: str, what: str, cause: str = "", fix: str = "see etcd's log") -> None:
        super().__init__(f"{where}: {what}{f' ({cause})' if cause else ''}; {fix}")
        self.where = where
        self.cause = cause


class StateUnavailableError(StateStoreError):
    """The controller's state store (etcd) did not answer in time."""

    def __init__(self, where: str, what: str, cause: str = "") -> None:
        super().__init__(
            where,
            what,
            cause,
            "check that etcd runs there, that the address is right and, if it serves TLS, "
            "the --etcd-cacert/--etcd-cert/--etcd-key files",
        )


class SnapshotError(TaskdError):
    """A memory snapshot that cannot be written, found or trusted: the next rung (peer copy, disk) is used."""
