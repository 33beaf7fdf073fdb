"""One process at a time per run folder: an ``flock`` on ``run.lock`` inside it.

``acquire_run_folder`` takes the lock before anything in the folder is discarded, frozen or
written, and holds it until ``release_run_folder`` (or the process ends). A second process
on the same folder (``rollflow train --run-dir``, ``resume``, the pipeline, a rescore of the
same name) is refused at once with ``RunFolderBusyError``, naming the holder's PID (written
into the file); it never waits, since a run beside itself would write every stage twice.
The lock is the kernel's, so it goes with its process however that ends, SIGKILL and OOM
included: a stale ``run.lock`` is just a file, and the next run takes it. Within one
process it is reentrant (the CLI opens the run before Prefect starts, then the flow opens
it again): nested holders count, and the last one out releases it. Simplified: only
processes that share the folder's filesystem see each other (two machines on one NFS
folder may not).
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rollflow.storage.errors import StorageError

LOCK_FILE = "run.lock"

_lock_guard = threading.Lock()
_held_locks: dict[Path, tuple[int, int]] = {}  # resolved folder -> (open fd, nested holders)


class RunFolderBusyError(StorageError):
    """Another process runs this folder; the message names its PID."""


@contextmanager
def run_folder_lock(root: Path) -> Iterator[None]:
    """Hold ``root``'s lock for the body (creating ``root``); see the module docstring."""
    acquire_run_folder(root)
    try:
        yield
    finally:
        release_run_folder(root)


def acquire_run_folder(root: Path) -> None:
    """Take ``root``'s lock for this process, or count one more holder; refuse at once if
    another process holds it."""
    key = Path(root).resolve()
    with _lock_guard:
        if key in _held_locks:
            fd, count = _held_locks[key]
            _held_locks[key] = (fd, count + 1)
            return
        key.mkdir(parents=True, exist_ok=True)
        fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderBusyError(
                f"{key} is in use by another rollflow process (PID {holder}, see {key / LOCK_FILE}): "
                f"two processes on one run folder would write every stage twice; wait for it to end "
                f"or stop it (kill {holder}), then resume"
            ) from None
        pid = f"{os.getpid()}\n".encode()
        if os.pread(fd, 32, 0) != pid:  # this process's own PID already: no rewrite, no new mtime
            os.ftruncate(fd, 0)
            os.pwrite(fd, pid, 0)
        _held_locks[key] = (fd, 1)


def release_run_folder(root: Path) -> None:
    """Drop one holder; the last one closes the file, which releases the lock."""
    key = Path(root).resolve()
    with _lock_guard:
        fd, count = _held_locks[key]
        if count > 1:
            _held_locks[key] = (fd, count - 1)
            return
        del _held_locks[key]
        os.close(fd)


def run_folder_in_use(root: Path) -> bool:
    """Whether another process holds ``root``'s lock now: a run going on there (this
    process's own holds are reentrant, as for ``acquire_run_folder``, so they do not count).

    Probed by taking a shared lock and dropping it at once, so it never waits; a run that
    starts in that instant is refused as if the folder were busy (microseconds)."""
    key = Path(root).resolve()
    with _lock_guard:
        if key in _held_locks:
            return False
    try:
        fd = os.open(key / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file: no rollflow process ever ran there
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # which drops the probe's shared lock
    return False
