"""Finding, loading and calling framework adapters.

Adapters are found through the entry-point group ``taskd``; each entry point
is loaded in isolation, so one broken distribution cannot hide the others,
and every failure names the adapter, its distribution and the cause.
:class:`Adapter` is the typed facade the core calls instead of ``pm.hook``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata

import pluggy

from taskd_core.errors import AdapterNotFoundError, FrameworkMissingError, PluginLoadError, WorkerControlError
from taskd_core.models import Strategy, WorkerStatus
from taskd_core.plugins import hookspecs
from taskd_core.plugins._markers import PROJECT

logger = logging.getLogger(__name__)


def _entry_points() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=PROJECT))


def _distribution(ep: metadata.EntryPoint) -> str:
    dist = ep.dist
    return f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"


def _instantiate(name: str, ep: metadata.EntryPoint) -> object:
    try:
        obj = ep.load()
        # A class is the usual entry point: adapters hold their workers' state.
        return obj() if isinstance(obj, type) else obj
    except FrameworkMissingError:
        raise
    except Exception as exc:  # whatever a third-party import raises is the plugin's failure to load
        raise PluginLoadError(name, _distribution(ep), exc) from exc


class Adapter:
    """One framework adapter, called through typed methods (tox's facade over ``pm.hook``)."""

    def __init__(self, name: str, plugin: object) -> None:
        self.name = name
        self.plugin = plugin
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(hookspecs)
        try:
            self._pm.register(plugin, name=name)
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(name, type(plugin).__module__, exc) from exc

    def _call(self, operation: str, hook: str, ranks: Sequence[int] = (), **kwargs: object) -> object:
        try:
            result = getattr(self._pm.hook, hook)(**kwargs)
        except WorkerControlError:
            raise
        except Exception as exc:  # an adapter's failure becomes one error type naming it
            raise WorkerControlError(
                self.name, operation, f"{type(exc).__name__}: {exc}", tuple(ranks)
            ) from exc
        if result is None:
            raise WorkerControlError(
                self.name, operation, f"no implementation of {hook} answered; implement it in the adapter"
            )
        return result

    def strategies(self) -> tuple[Strategy, ...]:
        raw = self._call("declare its strategies", "taskd_strategies")
        if isinstance(raw, str) or not isinstance(raw, Sequence):
            raise WorkerControlError(
                self.name, "declare its strategies", "taskd_strategies must return a list of names"
            )
        out: list[Strategy] = []
        for item in raw:
            try:
                out.append(Strategy(item))
            except ValueError:
                logger.warning("adapter %s declares unknown strategy %r; ignored", self.name, item)
        return tuple(out)

    def stop(self, local_ranks: Sequence[int] | None, timeout: float) -> None:
        ranks = tuple(local_ranks) if local_ranks is not None else None
        self._call("stop workers", "taskd_stop_workers", ranks or (), local_ranks=ranks, timeout=timeout)

    def restart_all(self) -> None:
        self._call("restart all workers", "taskd_restart_all")

    def restart_list(self, local_ranks: Sequence[int]) -> None:
        ranks = tuple(local_ranks)
        self._call("restart workers", "taskd_restart_list", ranks, local_ranks=ranks)

    def resize(self, node_rank: int, nodes: int) -> None:
        self._call("change the job's nodes", "taskd_resize", node_rank=node_rank, nodes=nodes)

    def begin_round(self, round_no: int) -> None:
        self._call("begin a live recovery round", "taskd_begin_round", round_no=round_no)

    def await_round(self, round_no: int, timeout: float) -> bool:
        return bool(
            self._call("await a live recovery round", "taskd_await_round", round_no=round_no, timeout=timeout)
        )

    def monitor(self) -> dict[int, WorkerStatus]:
        raw = self._call("monitor workers", "taskd_monitor")
        if not isinstance(raw, Mapping) or not all(isinstance(v, WorkerStatus) for v in raw.values()):
            raise WorkerControlError(
                self.name, "monitor workers", "taskd_monitor must return {local_rank: WorkerStatus}"
            )
        return dict(raw)


def load_adapter(name: str, instance: object | None = None) -> Adapter:
    """The adapter registered under ``name``.

    :param instance: an adapter object the caller built itself (a launcher
        that owns the workers); otherwise the entry point ``name`` in group
        ``taskd`` is loaded and, when it is a class, instantiated without arguments.
    """
    if instance is not None:
        return Adapter(name, instance)
    eps = _entry_points()
    matches = [ep for ep in eps if ep.name == name]
    if not matches:
        raise AdapterNotFoundError(name, sorted({ep.name for ep in eps}))
    if len(matches) > 1:
        logger.warning(
            "adapter %s is provided by several distributions (%s); using %s",
            name,
            ", ".join(_distribution(ep) for ep in matches),
            _distribution(matches[0]),
        )
    return Adapter(name, _instantiate(name, matches[0]))


@dataclass(frozen=True, slots=True)
class InstalledAdapter:
    """One entry point of group ``taskd`` as ``taskd plugins`` shows it.

    ``unavailable`` says what to install when the adapter's framework is
    missing; ``error`` why an adapter that should work does not.
    """

    name: str
    distribution: str
    value: str
    strategies: tuple[str, ...] = ()
    unavailable: str = ""
    error: str = ""


def list_adapters() -> list[InstalledAdapter]:
    """Every installed adapter with its distribution and declared strategies; broken ones carry ``error``."""
    out = []
    for ep in sorted(_entry_points(), key=lambda e: e.name):
        try:
            strategies = tuple(s.value for s in Adapter(ep.name, _instantiate(ep.name, ep)).strategies())
            out.append(InstalledAdapter(ep.name, _distribution(ep), ep.value, strategies))
        except FrameworkMissingError as exc:
            out.append(InstalledAdapter(ep.name, _distribution(ep), ep.value, unavailable=str(exc)))
        except (PluginLoadError, WorkerControlError) as exc:
            out.append(InstalledAdapter(ep.name, _distribution(ep), ep.value, error=str(exc)))
    return out


def adapter_distributions() -> dict[str, tuple[str, ...]]:
    """``"<distribution> <version>"`` of every installed adapter, with the adapter names it provides.

    Read from distribution metadata only: no adapter is imported.
    """
    out: dict[str, tuple[str, ...]] = {}
    for ep in sorted(_entry_points(), key=lambda e: e.name):
        dist = _distribution(ep)
        out[dist] = (*out.get(dist, ()), ep.name)
    return out
