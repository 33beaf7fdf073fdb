"""Start a stdio MCP server tied to the process that started it: ``launcher.py PARENT_PID PIDFILE COMMAND [ARGS...]``.

The SDK's stdio client starts the server itself (``anyio.open_process``), so we cannot hand
it a ``preexec_fn``; it runs this file instead, which
1. asks the kernel to SIGKILL it when the thread that started it ends (``PR_SET_PDEATHSIG``,
   kept across ``exec``): that thread is the MCP pool's event-loop thread, which lives as long
   as the rollflow process, so a SIGKILLed or OOM-killed run leaves no server behind even
   before the run's watchdog (``rollflow.policy.procs``) sweeps its process tree;
2. exits at once if that process already died before the ``prctl`` (nobody would signal);
3. writes its pid to PIDFILE (the pool watches the server by it, and tests check it is gone);
4. ``exec`` s the server's command, which keeps the pid, stdin and stdout.

Run with ``python -I``: it imports the standard library only and starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        sys.exit("usage: launcher.py PARENT_PID PIDFILE COMMAND [ARGS...]")
    parent, pidfile, command = int(argv[0]), argv[1], argv[2:]
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:
            os._exit(1)
    with open(pidfile, "w", encoding="utf-8") as out:
        out.write(str(os.getpid()))
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"cannot start {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
