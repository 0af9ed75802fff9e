"""How much of a shared controller one tenant may use: quotas and rate limits, free of I/O.

A *tenant* is the job token a request carries once some job holds it, else
(no token, or a token no job holds yet, as in a job's first ``Init``) the host
the request comes from (its *peer*). Every request takes one unit from its
tenant's request bucket; every journal byte a token's jobs write is taken from
that token's journal bucket. Jobs are counted per token and per peer (the
host whose ``Init`` claimed them), agents per token and in all. So a noisy
tenant runs into its own limits, and everyone else keeps registering; a flood
without the job's token is limited by its host, never by the job's own
token. A refusal names the limit and the flag that sets it
(:class:`~taskd_core.errors.QuotaExceededError`, gRPC ``RESOURCE_EXHAUSTED``).

The defaults are far above what real jobs use: a job of a thousand nodes
sends a few hundred requests a second (health checks every 5 s, a burst of
reports per recovery) and journals kilobytes per cycle.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from taskd_core.errors import ConfigError, QuotaExceededError

#: Buckets kept per kind (tokens, peers); beyond it the least recently used is dropped (it starts full again).
MAX_TENANTS = 65_536


@dataclass(frozen=True, slots=True)
class Quotas:
    """A controller's per-tenant limits (``taskd controller --max-...`` flags)."""

    #: jobs one token may hold (``--max-jobs-per-token``).
    jobs_per_token: int = 256
    #: jobs one host may have claimed (``--max-jobs-per-peer``): how many tokens one host can bring.
    jobs_per_peer: int = 1024
    #: agents the jobs of one token may register (``--max-agents-per-token``).
    agents_per_token: int = 16_384
    #: agents the jobs one host claimed may register (``--max-agents-per-peer``).
    agents_per_peer: int = 32_768
    #: agents of every job together (``--max-agents``).
    agents: int = 65_536
    #: requests a second one tenant may send on average (``--max-requests-per-second``);
    #: bursts of ten times as many pass.
    requests_per_second: float = 500.0
    #: journal bytes a second one token's jobs (a host's, for jobs without a token) may write on
    #: average (``--max-journal-bytes-per-second``); bursts of 64 times as many pass.
    journal_bytes_per_second: float = 1024.0 * 1024.0

    def __post_init__(self) -> None:
        for name in ("jobs_per_token", "jobs_per_peer", "agents_per_token", "agents_per_peer", "agents"):
            if getattr(self, name) < 1:
                raise ConfigError(f"quota {name} must be at least 1, not {getattr(self, name)}")
        if not (self.requests_per_second > 0 and self.journal_bytes_per_second > 0):
            raise ConfigError("rate limits must be greater than 0")

    @property
    def request_burst(self) -> float:
        return 10.0 * self.requests_per_second

    @property
    def journal_burst(self) -> float:
        return 64.0 * self.journal_bytes_per_second


class Bucket:
    """A token bucket: ``rate`` units a second, at most ``burst`` saved up; it may run into debt."""

    __slots__ = ("burst", "level", "rate", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.stamp = now

    def refill(self, now: float) -> float:
        if now > self.stamp:
            self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)
        return self.level

    def take(self, now: float, amount: float = 1.0) -> bool:
        """Take ``amount`` if there is that much; whether it was taken."""
        if self.refill(now) < amount:
            return False
        self.level -= amount
        return True

    def charge(self, now: float, amount: float) -> None:
        """Take ``amount`` whatever is left (what was done is paid for later)."""
        self.refill(now)
        self.level -= amount


class _Buckets:
    """Buckets by key, the least recently used dropped beyond :data:`MAX_TENANTS`."""

    def __init__(self, rate: float, burst: float) -> None:
        self._rate = rate
        self._burst = burst
        self._items: OrderedDict[str, Bucket] = OrderedDict()

    def get(self, key: str, now: float) -> Bucket:
        bucket = self._items.get(key)
        if bucket is None:
            bucket = self._items[key] = Bucket(self._rate, self._burst, now)
            if len(self._items) > MAX_TENANTS:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(key)
        return bucket


class RateLimits:
    """The request and journal buckets of every tenant; used from the controller's event loop only."""

    def __init__(self, quotas: Quotas) -> None:
        self.quotas = quotas
        self._requests = _Buckets(quotas.requests_per_second, quotas.request_burst)
        self._journal = _Buckets(quotas.journal_bytes_per_second, quotas.journal_burst)

    def admit(self, tenant: str, what: str, now: float, *, journals: bool) -> None:
        """Take one request of ``tenant`` (a token digest or ``peer:HOST``), described as ``what``.

        :raises QuotaExceededError: its requests, or (``journals``) its journal bytes, are used up.
        """
        if journals and self._journal.get(tenant, now).refill(now) < 0:
            raise QuotaExceededError(
                f"{what} wrote more than {self.quotas.journal_bytes_per_second:.0f} journal bytes a second; "
                "wait, or raise the controller's --max-journal-bytes-per-second",
                limit="--max-journal-bytes-per-second",
            )
        if not self._requests.get(tenant, now).take(now):
            raise QuotaExceededError(
                f"{what} sent more than {self.quotas.requests_per_second:g} requests a second; "
                "slow down, or raise the controller's --max-requests-per-second",
                limit="--max-requests-per-second",
            )

    def journalled(self, tenant: str, size: int, now: float) -> None:
        """A job of ``tenant`` wrote ``size`` journal bytes."""
        self._journal.get(tenant, now).charge(now, size)
