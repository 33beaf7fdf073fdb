"""The ``rollflow`` command line (subcommands are added by each area)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    raise SystemExit("rollflow: the command line is being built")


if __name__ == "__main__":
    sys.exit(main())
