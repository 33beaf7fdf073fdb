"""One training at a time per machine: a Prefect global concurrency limit around heavy work.

A nightly pipeline and a run someone starts by hand must never share the CPU or GPU, so
every flow that trains or evaluates (train, SFT, eval, the pipeline) holds one slot of the global
concurrency limit ``rollflow-training`` (created with 1 slot when missing; an operator
may raise it with ``prefect gcl update rollflow-training --limit 2`` on a bigger box).
A second flow waits for the slot, its log says so, and it starts when the first ends.

The slot is reentrant within a thread, where a flow's subflows run: the pipeline holds it and its subflows (SFT,
GRPO, evaluation) run inside it without asking again, which would deadlock.

A killed holder's slot is a lease that expires ``LEASE_S`` after its last renewal (the
Prefect server's repossessor frees it), so a retried run waits at most about that long
for the slot its crashed attempt held. 60 s is the shortest lease a Prefect server accepts
(it answers 422 to less).

Only where a Prefect server is configured (``PREFECT_API_URL``: deployments, workers, a
shared server): that is where several flows can meet. A run on Prefect's temporary local
server (plain ``rollflow train`` on a laptop) takes no slot: its server dies with it, and
with it the background service that frees a crashed holder's lease, so a slot taken there
could block the next run of that ``PREFECT_HOME`` for good.

Every heavy flow passes here, whatever started it (the CLI, a deployment's worker,
Python), so this is also where the process's watchdog starts (``rollflow.policy.procs``):
if the process is killed, the servers its flow started are ended with it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rollflow.policy.procs import start_watchdog

TRAINING_LIMIT = "rollflow-training"
LEASE_S = 60.0

_held = threading.local()  # .depth: nested holders in this thread


def ensure_training_limit(slots: int = 1) -> None:
    """Create the limit with ``slots`` slots unless it exists (an existing one is kept)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(TRAINING_LIMIT)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=TRAINING_LIMIT, limit=slots))
            except ObjectAlreadyExists:
                pass  # another run made it between the read and the create: theirs is kept


def server_configured() -> bool:
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


@contextmanager
def one_training_at_a_time(what: str) -> Iterator[None]:
    """Hold the machine's training slot for the body (at once if this thread holds it;
    a no-op without a configured Prefect server)."""
    start_watchdog()  # once per process
    if not server_configured():
        yield
        return
    if getattr(_held, "depth", 0) > 0:
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    from prefect import get_run_logger
    from prefect.concurrency.sync import concurrency

    ensure_training_limit()
    get_run_logger().info("%s: waiting for the machine's training slot (%s)", what, TRAINING_LIMIT)
    with concurrency(TRAINING_LIMIT, occupy=1, strict=True, lease_duration=LEASE_S):
        get_run_logger().info("%s: holds the training slot", what)
        _held.depth = 1
        try:
            yield
        finally:
            _held.depth = 0
