"""First start of a job: taskdrun (and ``taskd run``) against torchrun, launch → workers done, in one run.

A job's first start must not be slower under TaskD than under torchrun
(target: median ratio ≤ 1.1 over the cases below). Every case is a Python
worker that imports torch:

* ``init_method`` (2 workers): gloo ``init_process_group`` through ``env://``,
  then one ``all_reduce`` of a one-hot tensor whose sum must be the world size;
* ``launched`` (1 worker): writes ``torch.distributed.is_torchelastic_launched()``;
* ``init_method-run-path`` (2 workers): ``init_method`` through ``--run-path``, a
  function entry point that torch starts with ``multiprocessing`` (spawn);
* ``train_ddp`` (2 workers): ``examples/train_ddp.py`` for ``--steps`` steps with
  ``--optimizer sgd`` (DDP + ``torch.optim.SGD``; its first step imports ``torch._dynamo``).

The first three are written here as equivalents of torch's own launcher test
scripts (``test/distributed/launcher/bin/test_script_init_method.py`` and
``test_script_is_torchelastic_launched.py`` in torch's repository), which the
torch wheel does not ship. Launchers, each ``--repeats`` times, interleaved and
in a rotating order so that a busy moment of a shared machine does not fall on
one of them: ``torchrun --standalone``, ``taskdrun --standalone`` (fork server,
the default), ``taskdrun --taskd-no-fork-server``, and for the script cases
``taskd run`` with and without its fork server.

Per trial: launch → every worker done (the workers write ``time.time()`` as
their last act; ``train_ddp``: its ``done`` events) and launch → launcher exited.
The table gives medians (min–max) and each launcher's ratio to torchrun's
median; the summary line is the median over the cases of taskdrun's ratio.

Run::

    .venv/bin/python bench/first_start_bench.py --repeats 5 --json /tmp/first_start.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    REPO,
    Children,
    exit_on_sigterm,
    fmt,
    machine,
    markdown_table,
    setup_logging,
    summarize,
    write_json,
)

logger = logging.getLogger("first_start_bench")

BIN = Path(PYTHON).parent
#: Issue 25: taskdrun's (and taskd run's) median ratio to torchrun over the cases, launch → workers done.
TARGET = 1.1
DONE_ENV = "FIRST_START_DONE"
#: Where a failure's outcome names its trial's log.
LOG_PATH = re.compile(r" \(log: [^)]*\)")
_DONE = textwrap.dedent(
    f"""
    def done(rank):
        import os, time
        with open(os.path.join(os.environ[{DONE_ENV!r}], str(rank)), "w") as f:
            f.write(repr(time.time()))
    """
)
#: torch's test_script_init_method.py, written anew: env:// rendezvous, one all_reduce, a check.
INIT_METHOD = (
    textwrap.dedent(
        """
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F


        def main():
            dist.init_process_group(backend="gloo", init_method="env://")
            rank, world = dist.get_rank(), dist.get_world_size()
            t = F.one_hot(torch.tensor(rank), num_classes=world)
            dist.all_reduce(t)
            if torch.sum(t).item() != world:
                raise RuntimeError(f"wrong world size: {torch.sum(t).item()} != {world}")
            done(rank)
        """
    )
    + _DONE
    + '\nif __name__ == "__main__":\n    main()\n'
)
#: torch's test_script_is_torchelastic_launched.py, written anew.
LAUNCHED = (
    textwrap.dedent(
        """
        import os

        import torch.distributed as dist


        def main():
            with open(os.path.join(os.environ[{env!r}], "launched"), "w") as out:
                out.write(str(dist.is_torchelastic_launched()))
            done(int(os.environ["RANK"]))
        """
    ).format(env=DONE_ENV)
    + _DONE
    + '\nif __name__ == "__main__":\n    main()\n'
)


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    nproc: int
    script: str  # file name in the work dir, or "train_ddp"
    run_path: bool = False


CASES = (
    Case("init_method", 2, "init_method.py"),
    Case("launched", 1, "launched.py"),
    Case("init_method-run-path", 2, "init_method.py", run_path=True),
    Case("train_ddp", 2, "train_ddp"),
)
LAUNCHERS = ("torchrun", "taskdrun", "taskdrun-nofork", "taskd-run", "taskd-run-nofork")


def _command(launcher: str, case: Case, work: Path, steps: int) -> list[str] | None:
    """The launch command of ``case`` under ``launcher`` (None: the launcher cannot run it)."""
    if case.script == "train_ddp":
        ckpt = work / "ckpt"
        script = [str(REPO / "examples" / "train_ddp.py"), "--ckpt-dir", str(ckpt), "--steps", str(steps)]
        script += ["--optimizer", "sgd", "--progress", str(work / "progress.jsonl")]
    else:
        script = [str(work / case.script)]
    if launcher.startswith("taskd-run"):
        if case.run_path:
            return None
        flags = ["--no-fork-server"] if launcher.endswith("nofork") else []
        return [str(BIN / "taskd"), "run", "--nproc", str(case.nproc), *flags, "--", PYTHON, *script]
    exe = "torchrun" if launcher == "torchrun" else "taskdrun"
    flags = ["--taskd-no-fork-server"] if launcher == "taskdrun-nofork" else []
    flags += ["--run-path"] if case.run_path else []
    return [str(BIN / exe), "--standalone", f"--nproc-per-node={case.nproc}", *flags, *script]


def _done_times(case: Case, work: Path) -> list[float]:
    if case.script == "train_ddp":
        progress = work / "progress.jsonl"
        if not progress.exists():
            return []
        events = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]
        return [e["time"] for e in events if e["event"] == "done"]
    done = work / "done"
    return [float(p.read_text()) for p in done.iterdir() if p.name.isdigit() and p.read_text()]


def trial(launcher: str, case: Case, root: Path, steps: int, deadline: float) -> dict[str, Any] | None:
    """One launch; seconds from launch to every worker done and to the launcher's exit (None: cannot run)."""
    work = Path(tempfile.mkdtemp(prefix=f"{case.name}-{launcher}-", dir=root))
    command = _command(launcher, case, work, steps)
    if command is None:
        return None
    for name, text in (("init_method.py", INIT_METHOD), ("launched.py", LAUNCHED)):
        (work / name).write_text(text)
    (work / "done").mkdir()
    result: dict[str, Any] = {"launcher": launcher, "case": case.name, "outcome": "ok"}
    with Children() as children:
        t0 = time.time()
        proc = children.start(
            command, log=work / "launcher.log", env={DONE_ENV: str(work / "done")}, cwd=work
        )
        try:
            code = proc.wait(deadline)
        except subprocess.TimeoutExpired:
            result["outcome"] = f"timeout after {deadline:g}s"
            return result
        t_exit = time.time()
    done = _done_times(case, work)
    if code != 0 or len(done) != case.nproc:
        result["outcome"] = (
            f"exit code {code}, {len(done)} of {case.nproc} workers done (log: {work / 'launcher.log'})"
        )
        return result
    result.update(done=max(done) - t0, exit=t_exit - t0)
    return result


def run(
    cases: Sequence[Case], launchers: Sequence[str], repeats: int, steps: int, deadline: float
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="first-start-") as tmp:
        for rep in range(repeats):
            for case in cases:
                # A rotating order: the same launcher does not always follow the same one.
                shift = (rep + len(results)) % len(launchers)
                for launcher in [*launchers[shift:], *launchers[:shift]]:
                    res = trial(launcher, case, Path(tmp), steps, deadline)
                    if res is None:
                        continue
                    logger.info(
                        "%s %s: %s done %s s, exit %s s",
                        case.name,
                        launcher,
                        res["outcome"],
                        fmt(res.get("done")),
                        fmt(res.get("exit")),
                    )
                    results.append(res)
    return results


def summary(
    results: Sequence[dict[str, Any]], cases: Sequence[Case], launchers: Sequence[str]
) -> dict[str, Any]:
    cells: dict[str, dict[str, Any]] = {}
    for case, launcher in itertools.product(cases, launchers):
        mine = [r for r in results if r["case"] == case.name and r["launcher"] == launcher]
        if not mine:
            continue
        ok = [r for r in mine if r["outcome"] == "ok"]
        cells[f"{case.name}/{launcher}"] = {
            "trials": len(mine),
            "failures": sorted({r["outcome"] for r in mine if r["outcome"] != "ok"}),
            "done": summarize(r["done"] for r in ok).as_dict(),
            "exit": summarize(r["exit"] for r in ok).as_dict(),
        }
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for launcher in launchers:
        if launcher == "torchrun":
            continue
        per_case: dict[str, dict[str, float]] = {}
        for case in cases:
            mine, base = cells.get(f"{case.name}/{launcher}"), cells.get(f"{case.name}/torchrun")
            if mine and base and mine["done"]["n"] and base["done"]["n"]:
                per_case[case.name] = {k: mine[k]["median"] / base[k]["median"] for k in ("done", "exit")}
        if per_case:
            ratios[launcher] = per_case
    overall = {
        launcher: {k: statistics.median(c[k] for c in per_case.values()) for k in ("done", "exit")}
        for launcher, per_case in ratios.items()
    }
    return {"cells": cells, "ratios": ratios, "median_ratio": overall}


def table(data: dict[str, Any], cases: Sequence[Case], launchers: Sequence[str]) -> str:
    """Medians (min–max) per case and launcher, each with its ratio to torchrun's, and the trials that counted."""
    rows = []
    for case, launcher in itertools.product(cases, launchers):
        cell = data["cells"].get(f"{case.name}/{launcher}")
        if cell is None:
            continue
        ratio = data["ratios"].get(launcher, {}).get(case.name, {})
        rows.append(
            [
                case.name,
                launcher,
                _range(cell["done"]),
                fmt(ratio.get("done")) if ratio else "1" if launcher == "torchrun" else "N/A",
                _range(cell["exit"]),
                fmt(ratio.get("exit")) if ratio else "1" if launcher == "torchrun" else "N/A",
                f"{cell['done']['n']}/{cell['trials']}",
            ]
        )
    return markdown_table(
        ["case", "launcher", "launch → workers done, s", "ratio", "launch → exit, s", "ratio", "ok"], rows
    )


def failure_reasons(cell: dict[str, Any]) -> list[str]:
    """A cell's distinct failure outcomes without their log paths (each trial has its own)."""
    return sorted({LOG_PATH.sub("", reason) for reason in cell["failures"]})


def render(data: dict[str, Any], cases: Sequence[Case], launchers: Sequence[str]) -> str:
    lines = [table(data, cases, launchers), ""]
    for key, cell in data["cells"].items():
        for reason in cell["failures"]:
            lines.append(f"{key} failed: {reason}")
    for launcher, overall in data["median_ratio"].items():
        lines.append(
            f"{launcher} / torchrun, median over the cases: launch → workers done {fmt(overall['done'])}, "
            f"launch → exit {fmt(overall['exit'])} (target for taskdrun and taskd-run: ≤ {TARGET:g})"
        )
    return "\n".join(lines)


def _range(s: dict[str, float]) -> str:
    if not s["n"]:
        return "N/A"
    return f"{fmt(s['median'])} ({fmt(s['min'])}–{fmt(s['max'])})"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--repeats", type=int, default=5, help="trials per case and launcher (default: %(default)s)"
    )
    p.add_argument("--cases", default=",".join(c.name for c in CASES), help="from %(default)s")
    p.add_argument(
        "--launchers", default=",".join(LAUNCHERS), help="from %(default)s (torchrun is the baseline)"
    )
    p.add_argument("--steps", type=int, default=20, help="train_ddp steps (default: %(default)s)")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds one launch may take")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    exit_on_sigterm()
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in args.cases.split(",") if n not in by_name] + [
        n for n in args.launchers.split(",") if n not in LAUNCHERS
    ]
    if unknown or args.repeats < 1:
        p.error(
            f"unknown case or launcher: {', '.join(unknown)}" if unknown else "--repeats must be at least 1"
        )
    cases = [by_name[n] for n in args.cases.split(",")]
    launchers = ["torchrun", *(n for n in args.launchers.split(",") if n != "torchrun")]
    before = os.getloadavg()
    results = run(cases, launchers, args.repeats, args.steps, args.deadline)
    data = summary(results, cases, launchers)
    data.update(
        machine=machine(), load_before=before, load_after=os.getloadavg(), command=sys.argv, trials=results
    )
    write_json(args.json, data)
    print(render(data, cases, launchers))
    print(f"load average before {before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
