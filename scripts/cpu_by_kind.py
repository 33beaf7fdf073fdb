"""CPU seconds of every process on the machine while a command runs, by kind of process.

The test suite is CPU-bound on two cores (docs/testing.md), so the question "what makes it
slow" is "which processes burn the CPU": vLLM servers, `rollflow` runs, Prefect's temporary
servers, Ray, the pytest workers themselves. Every second this reads each process's CPU
ticks from /proc (a process first seen after the start counts from zero; one that starts
and ends between two reads is missed, and so is a process's last second), names its kind
from its command line or its parent's kind, and at the end prints the totals with the
machine's own busy share (/proc/stat) for comparison, and that share second by second
(``busy_timeline`` in the JSON):

    python3 scripts/cpu_by_kind.py --json /tmp/cpu.json -- make test

Standard library only: it runs beside the command it measures and should cost little
(a read of /proc a second).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def kind_of(command: str, parent_kind: str | None) -> str:
    """The kind of a process, from its command line, else its parent's kind."""
    if "vllm.entrypoints" in command:
        return "vllm-api"
    if parent_kind in ("vllm-api", "vllm-engine"):
        return "vllm-engine"  # the engine core vLLM spawns (and what it starts)
    if "prefect.server.api.server" in command or ("prefect" in command and "server start" in command):
        return "prefect-server"
    if "rollflow.flows.cli" in command or any(Path(part).name == "rollflow" for part in command.split(" ")[:2]):
        return "rollflow-run"
    if any(part in command for part in ("raylet", "gcs_server", "ray::", "/ray/", "default_worker")):
        return "ray"
    if "chrom" in command:
        return "browser"
    if "prefect" in command:
        return "prefect-cli"
    if "pytest" in command or "execnet" in command or "xdist" in command:
        return "pytest"
    if parent_kind is not None and parent_kind != "other":
        return parent_kind  # a pytest worker (xdist starts it as `python -c ...`), a run's helper
    return "other"


def _command(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _processes() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, CPU ticks, start time)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = (Path("/proc") / name / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19]))
    return found


def _machine_busy() -> tuple[int, int]:
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # all but idle and iowait


class Sampler:
    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.kinds: dict[tuple[int, int], str] = {}
        self.last: dict[tuple[int, int], int] = {}
        self.ticks: dict[str, int] = {}
        self.process_ticks: dict[tuple[int, int], int] = {}  # each process's ticks while sampled
        self.commands: dict[tuple[int, int], str] = {}
        self.first = True
        self.min_available_kib: int | None = None
        self.timeline: list[tuple[float, float]] = []  # (epoch seconds, busy share since the last read)
        self._busy = _machine_busy()
        self._stop = threading.Event()

    def sample(self) -> None:
        table = _processes()
        for pid in sorted(table, key=lambda p: table[p][2]):  # parents before their children
            parent, ticks, start = table[pid]
            key = (pid, start)
            if key not in self.kinds:
                up = table.get(parent)
                self.commands[key] = _command(pid)
                self.kinds[key] = kind_of(self.commands[key], self.kinds.get((parent, up[2])) if up else None)
            before = self.last.get(key, ticks if self.first else 0)
            self.last[key] = ticks
            self.ticks[self.kinds[key]] = self.ticks.get(self.kinds[key], 0) + ticks - before
            self.process_ticks[key] = self.process_ticks.get(key, 0) + ticks - before
        self.first = False
        busy, every = _machine_busy()
        self.timeline.append((round(time.time(), 1), round((busy - self._busy[0]) / max(every - self._busy[1], 1), 3)))
        self._busy = (busy, every)
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1])
                self.min_available_kib = min(available, self.min_available_kib or available)

    def processes(self, least_s: float = 0.5) -> list[dict]:
        """Every process that burnt at least ``least_s`` CPU-seconds while sampled, heaviest
        first: its kind, CPU-seconds and command line (cut at 300 characters)."""
        found = [
            {"kind": self.kinds[key], "cpu_s": round(ticks * TICK_S, 1), "command": self.commands[key][:300]}
            for key, ticks in self.process_ticks.items()
            if ticks * TICK_S >= least_s
        ]
        return sorted(found, key=lambda p: -p["cpu_s"])

    def run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    sampler = Sampler()
    busy0, all0 = _machine_busy()
    started = time.monotonic()
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    with subprocess.Popen(command) as process:
        try:  # exited, not yet reaped: the last sample still reads its CPU (else up to a second of it is lost)
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        except BaseException:
            process.kill()
            raise
        sampler.stop()
        thread.join()
        sampler.sample()
        status = process.wait()
    busy1, all1 = _machine_busy()
    cpu = {kind: round(ticks * TICK_S, 1) for kind, ticks in sorted(sampler.ticks.items(), key=lambda kv: -kv[1])}
    started_by_kind: dict[str, int] = {}
    for kind in sampler.kinds.values():
        started_by_kind[kind] = started_by_kind.get(kind, 0) + 1
    figures = {
        "command": command, "exit_status": status, "wall_s": round(time.monotonic() - started, 1),
        "machine_busy_cpu_s": round((busy1 - busy0) * TICK_S, 1),
        "machine_busy_share": round((busy1 - busy0) / max(all1 - all0, 1), 3),
        "min_available_gib": round((sampler.min_available_kib or 0) / 2**20, 2),
        "cpu_s_by_kind": cpu,
        "processes_by_kind": dict(sorted(started_by_kind.items(), key=lambda kv: -kv[1])),
        # (epoch seconds, the machine's busy share over the second before): which stretches
        # left cores idle (scripts/test_cpu_report.py charges them to the tests then running)
        "busy_timeline": sampler.timeline,
        # which processes burnt it (the same vLLM server started 40 times shows as 40 rows)
        "processes": sampler.processes(),
    }  # fmt: skip
    print(json.dumps({k: v for k, v in figures.items() if k not in ("busy_timeline", "processes")}, indent=1), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    sys.exit(status)


if __name__ == "__main__":
    main()
