"""``taskd timeline JOB --out FILE``: a picture of a job's recoveries (PNG or SVG, by extension).

Top panel: the controller's recovery phases (detect → stop → strategy →
restart → resumed → stepping, see :mod:`taskd_core.cli.recovery_view`) and signals,
zoomed on the recoveries. Below: one lane per rank with each worker process
(pid, start, end, exit code), fault marks and the time (and steps, where
workers report them) each fault lost, and a mark where a rank was found
slower than its peers (``slow-rank``).
The journal comes from a running controller or its state file, as for
``taskd events``. Drawn with matplotlib (``pip install 'taskd-core[timeline]'``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
from pathlib import Path
from typing import Any

from taskd_core.cli.events import add_source_options, journal_reader, read_all
from taskd_core.cli.recovery_view import PHASES, JobTimeline, build
from taskd_core.errors import ConfigError, TaskdError

logger = logging.getLogger(__name__)

FORMATS = {".png": "png", ".svg": "svg"}
_PHASE_COLORS = dict(
    zip(PHASES, ("#e6550d", "#fdae6b", "#9e9ac8", "#6baed6", "#74c476", "#238b45"), strict=True)
)
_RUN_COLORS = ("#4c72b0", "#55a868")
#: Lanes up to this many get pid and exit code labels; more would overlap.
_LABELLED_LANES = 16


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "timeline",
        help="draw a job's workers, faults and recovery phases as a PNG or SVG picture",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_source_options(p)
    p.add_argument("--out", required=True, type=Path, metavar="FILE", help="picture to write: *.png or *.svg")
    p.set_defaults(func=run)


def output_format(path: Path) -> str:
    """The picture format for ``path``'s extension; ConfigError for anything else."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"--out {path}: the file name must end in .png or .svg")
    if not path.parent.is_dir():
        raise ConfigError(f"--out {path}: folder {path.parent} does not exist")
    return fmt


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise TaskdError(
            "taskd timeline draws with matplotlib, which is not installed: pip install 'taskd-core[timeline]'"
        ) from None
    matplotlib.use("Agg")  # no display needed, and never a GUI window from a command line tool
    return importlib.import_module("matplotlib.pyplot")


def draw(view: JobTimeline, out: Path) -> None:
    """Write the picture of ``view`` to ``out`` (format by extension)."""
    fmt = output_format(out)
    plt = _pyplot()
    lanes = max(1, len(view.ranks))
    # SVG text stays text (searchable, smaller) instead of glyph outlines.
    with plt.rc_context({"svg.fonttype": "none"}):
        _render(plt, view, out, fmt, lanes)


def _render(plt: Any, view: JobTimeline, out: Path, fmt: str, lanes: int) -> None:
    fig, (top, ax) = plt.subplots(
        2,
        1,
        figsize=(14, 3.2 + 0.17 * max(lanes, 8)),
        gridspec_kw={"height_ratios": (2.2, 0.17 * max(lanes, 8))},
        layout="constrained",
    )
    try:
        _draw_controller(top, view)
        _draw_lanes(ax, view)
        cycles = len(view.cycles)
        fig.suptitle(
            f"job {view.job_id}: {len(view.ranks)} ranks, {cycles} recovery cycle{'s' * (cycles != 1)}"
            f"{f' — {view.outcome}' if view.outcome else ''}",
            fontsize=13,
        )
        fig.savefig(out, format=fmt, dpi=100)
    finally:
        plt.close(fig)


def _recovery_window(view: JobTimeline) -> tuple[float, float]:
    if not view.phases:
        return 0.0, max(view.duration, 1.0)
    start = min(p.start for p in view.phases)
    end = max(p.end for p in view.phases)
    margin = max(0.15 * (end - start), 0.05)
    return max(0.0, start - margin), end + margin


def _draw_controller(ax: Any, view: JobTimeline) -> None:
    left, right = _recovery_window(view)
    ax.set_xlim(left, right)
    ax.set_ylim(-0.6, 2.6)
    ax.set_yticks([0, 1.6], ["phases", "signals"])
    ax.set_xlabel("seconds since the job's first event (zoomed on the recoveries)")
    for phase in view.phases:
        ax.barh(0, phase.end - phase.start, left=phase.start, height=0.7, color=_PHASE_COLORS[phase.name])
        ax.text(
            (phase.start + phase.end) / 2,
            0,
            f"{phase.end - phase.start:.2f}s",
            ha="center",
            va="center",
            fontsize=7,
            clip_on=True,
        )
    for cycle in view.cycles:
        length = f" in {cycle.end - cycle.start:.2f} s" if cycle.end is not None else ""
        ax.text(
            cycle.start,
            0.55,
            f"cycle {cycle.number}: {cycle.strategy or '-'}, {cycle.outcome}{length}",
            fontsize=8,
            va="bottom",
            clip_on=True,
        )
    for i, sig in enumerate(view.signals):
        ax.axvline(sig.time, color="#888888", linewidth=0.6, linestyle=":")
        label = f"{sig.signal_type} {sig.strategy}".strip()
        ax.text(sig.time, 1.25 + 0.45 * (i % 3), label, fontsize=7, rotation=0, clip_on=True)
    handles = [ax.barh(0, 0, color=c, label=name) for name, c in _PHASE_COLORS.items()]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncols=len(handles), frameon=False)
    ax.grid(axis="x", linewidth=0.3)


def _draw_lanes(ax: Any, view: JobTimeline) -> None:
    lanes = len(view.ranks)
    y = {rank: i for i, rank in enumerate(view.ranks)}
    labelled = lanes <= _LABELLED_LANES
    end = max(view.duration, 1e-3)
    counts: dict[int, int] = {}
    faulted = {(f.rank, f.time) for f in view.faults}
    for run in view.incarnations:
        nth = counts[run.rank] = counts.get(run.rank, -1) + 1
        stop = run.end if run.end is not None else end
        ax.barh(y[run.rank], stop - run.start, left=run.start, height=0.62, color=_RUN_COLORS[nth % 2])
        if labelled:
            ax.text(
                run.start,
                y[run.rank],
                f" pid {run.pid}",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )
        # A fault's exit code goes with its mark; other non-zero ends (stopped workers) only on small jobs.
        if run.exit_code not in (None, 0) and labelled and (run.rank, stop) not in faulted:
            ax.text(stop, y[run.rank] + 0.38, f"exit {run.exit_code}", fontsize=6, ha="right", clip_on=True)
    for cycle in view.cycles:
        ax.axvspan(cycle.start, cycle.end if cycle.end is not None else end, color="#e6550d", alpha=0.08)
    for fault in view.faults:
        ax.plot(fault.time, y[fault.rank], marker="X", color="#d62728", markersize=9, zorder=5)
        lost = "never back" if fault.lost is None else f"{fault.back} after {fault.lost:.2f} s"
        if fault.steps_lost is not None:
            lost += f", {fault.steps_lost} step{'s' * (fault.steps_lost != 1)} lost"
        code = "" if fault.exit_code is None else f"exit {fault.exit_code}, "
        ax.text(
            fault.time,
            y[fault.rank] - 0.4,
            f" fault ({code}{lost})",
            fontsize=7,
            color="#d62728",
            va="bottom",
        )
    for mark in view.slow:
        ax.plot(mark.time, y[mark.rank], marker="v", color="#9467bd", markersize=9, zorder=5)
        ax.text(
            mark.time,
            y[mark.rank] + 0.42,
            f" slow ({mark.ratio:.1f}x its peers' work, step {mark.step})",
            fontsize=7,
            color="#9467bd",
            va="top",
        )
    for sig in view.signals:
        ax.axvline(sig.time, color="#888888", linewidth=0.5, linestyle=":")
    step = 1 if lanes <= _LABELLED_LANES else max(1, lanes // 16)
    ticks = list(range(0, lanes, step))
    ax.set_yticks(ticks, [f"rank {view.ranks[i]}" for i in ticks], fontsize=8 if labelled else 7)
    ax.set_ylim(lanes - 0.5, -0.7)
    ax.set_xlim(0, end * 1.02)
    ax.set_xlabel("seconds since the job's first event")
    ax.grid(axis="x", linewidth=0.3)


def run(args: argparse.Namespace) -> int:
    output_format(args.out)
    with journal_reader(args) as read:
        events = read_all(read)
    view = build(args.job, events)
    if not view.ranks:
        raise TaskdError(
            f"job {args.job!r} has no worker events in its journal; agents older than this controller "
            "do not report them, so there is nothing to draw"
        )
    draw(view, args.out)
    print(args.out)
    return 0
