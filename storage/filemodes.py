"""Model folders get the file modes of ordinary files: ``0666`` less the process's umask.

safetensors (0.8 measured) writes every file ``0600`` whatever the umask, so every
``*.safetensors`` a ``save_pretrained`` writes is unreadable to anyone but its owner (a
vLLM server under another user, a colleague, a deployment). Checkpoints, exports and SFT
policies call ``give_ordinary_modes`` on their folder before it is renamed into place.

The umask is read from ``/proc/self/status`` where there is one: setting it to read it
(``os.umask``) would change it for a moment for every thread of the process.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC_STATUS = Path("/proc/self/status")


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it."""
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: set and put back at once
    os.umask(mask)
    return mask


def give_ordinary_modes(folder: Path) -> None:
    """Every regular file under ``folder`` gets the mode ``open()`` gives a new file."""
    mode = 0o666 & ~current_umask()
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                os.chmod(path, mode)
