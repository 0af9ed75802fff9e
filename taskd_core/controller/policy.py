"""Job recovery policies: validation, the TOML policy file and per-job lookup.

A policy file has a ``[defaults]`` table and one ``[jobs."<job id>"]`` table
per job that differs::

    [defaults]
    strategies = ["recover-live", "recover-in-place", "recover", "dump", "exit"]
    recovery = true
    report_timeout = 900      # seconds each wait for the agents' reports may take
    flush_seconds = 0.1       # window that collects faults arriving together
    max_cycles = 3            # recovery cycles a job may use within cycle_window before it is given up
    cycle_window = 3600       # seconds over which max_cycles counts; 0: the job's whole life
    expected_agents = 0       # 0: whoever registered
    min_nodes = 0             # fewest nodes a job shrinks to on a node loss with no spare; 0: never shrinks
    max_nodes = 0             # most nodes a job grows to by a spare that comes; 0: never grows
    slow_rank = "warn"        # "warn" (journal, metric, status) or "replace" (a spare takes its node)
    slow_rank_bound = 0       # its work per step over its peers' median that makes it slow (0: learned)...
    slow_rank_window = 20     # ...over this many steps (held for three tenths of them)

    [jobs."job-42"]
    strategies = "recover,exit"

Layers, lowest first: :class:`~taskd_core.models.JobPolicy` defaults, the
file's ``[defaults]``, command-line flags, the file's per-job table, and at
run time the ``SetJobPolicy`` RPC.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taskd_core.errors import ConfigError
from taskd_core.models import LADDER, JobPolicy, SlowRankPolicy, Strategy
from taskd_core.values import MAX_INT32, MAX_SECONDS

logger = logging.getLogger(__name__)

#: File key -> JobPolicy attribute.
_FILE_KEYS = {
    "strategies": "strategies",
    "recovery": "recovery_enabled",
    "report_timeout": "report_timeout",
    "flush_seconds": "flush_seconds",
    "max_cycles": "max_cycles",
    "cycle_window": "cycle_window",
    "expected_agents": "expected_agents",
    "min_nodes": "min_nodes",
    "max_nodes": "max_nodes",
    "node_lost_timeout": "node_lost_timeout",
    "spare_wait": "spare_wait",
    "slow_rank": "slow_rank",
    "slow_rank_bound": "slow_rank_bound",
    "slow_rank_window": "slow_rank_window",
}
#: Fewest and most steps of a slow rank's window: a level needs a few, a job reacts within hundreds.
MIN_SLOW_WINDOW, MAX_SLOW_WINDOW = 4, 1000
_FILE_LABELS = {attr: key for key, attr in _FILE_KEYS.items()}


def parse_strategies(value: str | Iterable[str], *, key: str = "strategies") -> tuple[Strategy, ...]:
    """Strategy names (a comma list or a sequence) as ladder-ordered strategies."""
    names = value.split(",") if isinstance(value, str) else list(value)
    chosen: set[Strategy] = set()
    for raw in names:
        # str() of a str-enum member is "Strategy.X", not its value.
        name = raw.value if isinstance(raw, Strategy) else str(raw).strip()
        if not name:
            continue
        try:
            chosen.add(Strategy(name))
        except ValueError:
            raise ConfigError(
                f"{key}: unknown strategy {name!r}; use names from: {', '.join(s.value for s in LADDER)}"
            ) from None
    if not chosen:
        raise ConfigError(f'{key}: no strategy given; name at least one, e.g. "recover,exit"')
    return tuple(s for s in LADDER if s in chosen)


def _number(key: str, value: object, *, minimum: float, integer: bool, exclusive: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
        or not math.isfinite(value)
    ):
        raise ConfigError(f"{key}: expected {'an integer' if integer else 'a number'}, got {value!r}")
    if value < minimum or (exclusive and value == minimum):
        bound = f"greater than {minimum:g}" if exclusive else f"at least {minimum:g}"
        raise ConfigError(f"{key}: must be {bound}, got {value!r}")
    # The wire carries counts as int32; no wait or window of a recovery is longer than a day.
    if value > (MAX_INT32 if integer else MAX_SECONDS):
        bound = str(MAX_INT32) if integer else f"{MAX_SECONDS:g} seconds (a day)"
        raise ConfigError(f"{key}: must be at most {bound}, got {value!r}")
    return float(value)


def updated_policy(
    base: JobPolicy,
    changes: Mapping[str, object],
    *,
    where: str = "",
    labels: Mapping[str, str] | None = None,
) -> JobPolicy:
    """``base`` with ``changes`` (JobPolicy attribute names) applied after validation.

    Error messages name a change as ``where + labels.get(name, name)``, e.g.
    ``[jobs."a"] recovery``, so they point at the key the user wrote.
    """
    clean: dict[str, Any] = {}
    for name, value in changes.items():
        key = f"{where}{(labels or {}).get(name, name)}"
        if name == "strategies":
            clean[name] = parse_strategies(value, key=key)  # type: ignore[arg-type]
        elif name == "recovery_enabled":
            if not isinstance(value, bool):
                raise ConfigError(f"{key}: expected true or false, got {value!r}")
            clean[name] = value
        elif name in ("report_timeout", "node_lost_timeout"):
            clean[name] = _number(key, value, minimum=0, integer=False, exclusive=True)
        elif name in ("flush_seconds", "cycle_window", "spare_wait"):
            clean[name] = _number(key, value, minimum=0, integer=False)
        elif name in ("max_cycles", "expected_agents", "min_nodes", "max_nodes"):
            clean[name] = int(_number(key, value, minimum=0, integer=True))
        elif name == "slow_rank":
            clean[name] = parse_slow_rank(value, key)
        elif name == "slow_rank_bound":
            clean[name] = _slow_rank_bound(key, value)
        elif name == "slow_rank_window":
            window = int(_number(key, value, minimum=MIN_SLOW_WINDOW, integer=True))
            if window > MAX_SLOW_WINDOW:
                raise ConfigError(f"{key}: must be at most {MAX_SLOW_WINDOW} steps, got {window}")
            clean[name] = window
        else:
            raise ConfigError(f"{key}: unknown policy setting; known: {', '.join(_FILE_KEYS)}")
    return dataclasses.replace(base, **clean)


def _slow_rank_bound(key: str, value: object) -> float:
    """A slow rank's bound: above 1, or 0 (the default): learned from the job's own ratios."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and value == 0:
        return 0.0
    if number and value <= 1:  # type: ignore[operator]
        raise ConfigError(f"{key}: must be greater than 1, or 0 to learn it from the job, got {value!r}")
    return _number(key, value, minimum=1, integer=False, exclusive=True)


def parse_slow_rank(value: object, key: str = "slow_rank") -> SlowRankPolicy:
    """What a slow rank gets: ``warn`` or ``replace``."""
    name = value.value if isinstance(value, SlowRankPolicy) else value
    try:
        policy = SlowRankPolicy(name)
    except ValueError:
        known = ", ".join(repr(p.value) for p in SlowRankPolicy)
        raise ConfigError(f"{key}: expected one of {known}, got {value!r}") from None
    return policy


def _from_table(base: JobPolicy, table: object, where: str) -> JobPolicy:
    if not isinstance(table, dict):
        raise ConfigError(f"{where.strip()}: expected a table of settings, got {table!r}")
    changes: dict[str, object] = {}
    for key, value in table.items():
        if key not in _FILE_KEYS:
            raise ConfigError(f"{where}{key}: unknown policy key; known keys: {', '.join(_FILE_KEYS)}")
        changes[_FILE_KEYS[key]] = value
    return updated_policy(base, changes, where=where, labels=_FILE_LABELS)


def policy_to_dict(policy: JobPolicy) -> dict[str, Any]:
    """A JSON-ready form, for the state file."""
    return {
        "strategies": [s.value for s in policy.strategies],
        "recovery_enabled": policy.recovery_enabled,
        "report_timeout": policy.report_timeout,
        "flush_seconds": policy.flush_seconds,
        "max_cycles": policy.max_cycles,
        "cycle_window": policy.cycle_window,
        "expected_agents": policy.expected_agents,
        "min_nodes": policy.min_nodes,
        "max_nodes": policy.max_nodes,
        "node_lost_timeout": policy.node_lost_timeout,
        "spare_wait": policy.spare_wait,
        "slow_rank": policy.slow_rank.value,
        "slow_rank_bound": policy.slow_rank_bound,
        "slow_rank_window": policy.slow_rank_window,
    }


def policy_from_dict(data: Mapping[str, Any]) -> JobPolicy:
    return updated_policy(JobPolicy(), data, where="state file: ")


def validated(policy: JobPolicy, where: str = "") -> JobPolicy:
    """A policy built in code, checked like a file's (strategy names become Strategy)."""
    return updated_policy(
        JobPolicy(), {name: getattr(policy, name) for name in _FILE_KEYS.values()}, where=where
    )


@dataclass(frozen=True, slots=True)
class PolicyBook:
    """The controller's configured policies: defaults plus per-job overrides."""

    defaults: JobPolicy = field(default_factory=JobPolicy)
    jobs: Mapping[str, JobPolicy] = field(default_factory=dict)

    def for_job(self, job_id: str) -> JobPolicy:
        return self.jobs.get(job_id, self.defaults)


def load_policies(path: str | Path | None = None, **overrides: object) -> PolicyBook:
    """Build the policy book from an optional TOML file and command-line overrides.

    ``overrides`` are JobPolicy attribute names; they beat the file's
    ``[defaults]`` but not its per-job tables.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(
                f"policy file {path}: cannot read it ({exc.strerror}); check --policy"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"policy file {path}: not valid TOML ({exc}); fix the syntax") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"policy file {path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
                "TOML files are UTF-8, save it as UTF-8"
            ) from None
    unknown = set(data) - {"defaults", "jobs"}
    if unknown:
        raise ConfigError(
            f"policy file {path}: unknown table(s) {', '.join(sorted(unknown))}; "
            'only [defaults] and [jobs."<job id>"] are allowed'
        )
    defaults = _from_table(JobPolicy(), data.get("defaults", {}), "[defaults] ")
    defaults = updated_policy(defaults, overrides)
    jobs_table = data.get("jobs", {})
    if not isinstance(jobs_table, dict):
        raise ConfigError('jobs: expected tables like [jobs."<job id>"], got a plain value')
    jobs = {job: _from_table(defaults, table, f'[jobs."{job}"] ') for job, table in jobs_table.items()}
    logger.debug("policies: defaults %s, %d job override(s)", defaults, len(jobs))
    return PolicyBook(defaults, jobs)
