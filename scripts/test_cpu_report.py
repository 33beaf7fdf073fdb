"""Where the test suite's CPU goes, by module and by test, from a run with a CPU log.

The suite is CPU-bound on a 2-core machine (docs/testing.md): its wall time follows the CPU
seconds its tests spend, not their durations, which include waiting and the other worker's
load. ``tests/conftest.py`` logs each test's CPU when ``ROLLFLOW_TEST_CPU_LOG`` is set:

    ROLLFLOW_TEST_CPU_LOG=/tmp/cpu make test
    .venv/bin/python scripts/test_cpu_report.py /tmp/cpu [--top 30] [--timeline KIND.json]

It prints two Markdown tables: CPU seconds by module (the test process's own work, and the
child processes it reaped: servers and runs it started and stopped), and the tests that
spent the most. The own CPU is exact. The children's is approximate: a child is charged to
the test that reaps it, and Python reaps a child nobody waited for when it next starts a
subprocess, which can be a later test; a child adopted by init is not counted at all, so
the log undercounts the servers and runs a test SIGKILLs. ``scripts/cpu_by_kind.py``
counts every process on the machine, by kind, for the whole run.

With ``--timeline`` (the JSON ``scripts/cpu_by_kind.py --json`` wrote for the same run) it
also charges the machine's idle cores to the tests then running: "idle core-s" is the sum
over the seconds a test ran of the cores nobody used. Idle cores are wall time the suite
could have spent on other tests; a test that sleeps or polls while the other worker runs one
process is where they come from. Both tests running at an idle second are charged with it,
so read the column as "idle happened while this ran", and compare a test's own and children's
CPU with its test time to tell which of the two waited.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TestCpu:
    test: str
    own_s: float
    children_s: float
    wall_s: float
    start: float | None = None  # epoch seconds (logs written before it was recorded lack it)
    idle_core_s: float = 0.0

    @property
    def module(self) -> str:
        return self.test.split("::", 1)[0].rsplit("/", 1)[-1]

    @property
    def total_s(self) -> float:
        return self.own_s + self.children_s


def read_log(prefix: Path) -> list[TestCpu]:
    """Every worker's lines (``PREFIX.<worker>.jsonl``)."""
    files = sorted(prefix.parent.glob(f"{prefix.name}.*.jsonl"))
    if not files:
        raise SystemExit(f"no {prefix}.*.jsonl: run the tests with ROLLFLOW_TEST_CPU_LOG={prefix}")
    rows = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                data = json.loads(line)
                rows.append(TestCpu(data["test"], data["own_cpu_s"], data["children_cpu_s"], data["wall_s"],
                                    data.get("start")))
            except (ValueError, KeyError) as error:
                raise SystemExit(f"{path}:{number}: not a CPU log line ({error}): {line[:200]}") from None
    return rows


def charge_idle(rows: list[TestCpu], timeline: list[tuple[float, float]], cores: int) -> None:
    """Set each row's ``idle_core_s`` from the busy timeline: each sample covers the interval
    since the one before it, and a test is charged the idle cores of the part it overlaps."""
    for row in rows:
        if row.start is None:
            raise SystemExit(f"{row.test}: the CPU log has no start times (a log from before they were recorded)")
        end, idle = row.start + row.wall_s, 0.0
        for (t0, _), (t1, busy) in zip(timeline, timeline[1:]):
            overlap = min(t1, end) - max(t0, row.start)
            if overlap > 0:
                idle += overlap * (1.0 - busy) * cores
        row.idle_core_s = idle


def by_module(rows: list[TestCpu]) -> list[tuple[str, float, float, float, float]]:
    """(module, own, children, wall, idle core-s) summed, the most CPU first."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for row in rows:
        sums[row.module][0] += row.own_s
        sums[row.module][1] += row.children_s
        sums[row.module][2] += row.wall_s
        sums[row.module][3] += row.idle_core_s
    return sorted(((m, *v) for m, v in sums.items()), key=lambda r: -(r[1] + r[2]))  # type: ignore[misc]


def report(rows: list[TestCpu], top: int, idle: bool = False) -> str:
    own = sum(r.own_s for r in rows)
    children = sum(r.children_s for r in rows)
    lines = [
        f"{len(rows)} tests: {own + children:,.0f} CPU-s ({own:,.0f} in the test processes, "
        f"{children:,.0f} in the children they reaped), {sum(r.wall_s for r in rows):,.0f} s of test time",
        "",
        "| module | CPU-s | own | children | test time (s) |" + (" idle core-s |" if idle else ""),
        "|---|---|---|---|---|" + ("---|" if idle else ""),
    ]
    for module, m_own, m_children, m_wall, m_idle in by_module(rows)[:top]:
        lines.append(f"| `{module}` | {m_own + m_children:.0f} | {m_own:.0f} | {m_children:.0f} | {m_wall:.0f} |"
                     + (f" {m_idle:.0f} |" if idle else ""))
    lines += ["", "| # | test | CPU-s | own | children | test time (s) |", "|---|---|---|---|---|---|"]
    for rank, row in enumerate(sorted(rows, key=lambda r: -r.total_s)[:top], 1):
        lines.append(f"| {rank} | `{_name(row)}` | {row.total_s:.0f} | {row.own_s:.0f} | {row.children_s:.0f} | {row.wall_s:.0f} |")
    if idle:
        lines += ["", f"Idle cores: {sum(r.idle_core_s for r in rows):,.0f} core-s charged (a second shared by "
                  "two tests counts for both)", "",
                  "| # | test | idle core-s | CPU-s | test time (s) |", "|---|---|---|---|---|"]
        for rank, row in enumerate(sorted(rows, key=lambda r: -r.idle_core_s)[:top], 1):
            lines.append(f"| {rank} | `{_name(row)}` | {row.idle_core_s:.0f} | {row.total_s:.0f} | {row.wall_s:.0f} |")
    return "\n".join(lines)


def _name(row: TestCpu) -> str:
    return row.test.rsplit("/", 1)[-1][:110]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", type=Path, help="the ROLLFLOW_TEST_CPU_LOG the suite ran with")
    parser.add_argument("--top", type=int, default=30, help="rows per table")
    parser.add_argument("--timeline", type=Path, help="scripts/cpu_by_kind.py's JSON of the same run: charge idle cores")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="the machine's cores (default: this one's)")
    args = parser.parse_args()
    rows = read_log(args.prefix)
    if args.timeline:
        figures = json.loads(args.timeline.read_text())
        if "busy_timeline" not in figures:
            raise SystemExit(f"{args.timeline}: no busy_timeline (written by an older scripts/cpu_by_kind.py)")
        charge_idle(rows, [tuple(x) for x in figures["busy_timeline"]], args.cores)
    print(report(rows, args.top, idle=bool(args.timeline)))


if __name__ == "__main__":
    main()
