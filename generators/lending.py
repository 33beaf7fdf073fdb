"""One vLLM generator lent to the flows and stages a caller runs in a row: ``lend``.

A managed server holds gigabytes and takes tens of seconds to start, so a test module, a
notebook or a bench starts one generator and lends it; ``open_generator``
(``generators/run_generator.py``) then yields the lent one to every run it fits (an equal
``generator_key``) and leaves it running when that run closes. The owner opened it and
closes it; nothing outlives the ``with`` of its owner.

Simplified: the lent generators are a process-wide list, not a value handed down the flows,
so a flow's signature stays the production one; the list holds only what a ``with lend``
open in this process put there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from rollflow.config.run import RunConfig
from rollflow.generators.vllm_generator import VLLMGenerator, generator_key
from rollflow.storage.runfolder import RunFolder


_LENT: list[VLLMGenerator] = []  # the innermost last


@contextmanager
def lend(generator: VLLMGenerator) -> Iterator[VLLMGenerator]:
    """While open, ``open_generator`` for a config this generator serves (an equal
    ``generator_key``) yields ``generator`` and leaves it running when it closes: one server
    for the runs and stages a caller starts in a row (a test module, a notebook, a bench).
    The caller opened it and closes it; nothing outlives the ``with`` of its owner."""
    _LENT.append(generator)
    try:
        yield generator
    finally:
        if generator in _LENT:
            _LENT.remove(generator)


def lent_generator(
    config: RunConfig, folder: RunFolder | None, *, versions_in_flight: int, cpus: Sequence[int] = ()
) -> VLLMGenerator | None:
    """The lent generator serving ``config`` on ``cpus``, bound to ``folder`` (its restarts
    log there, its merged versions go there), restarted if its server died since; None when
    none is."""
    key = generator_key(config, versions_in_flight=versions_in_flight, cpus=cpus)
    for lent in reversed(_LENT):
        if lent.key == key and not lent.closed:
            lent.config, lent.folder = config, folder
            dead = [server for server in lent.servers if not server.running]
            if dead:  # died since the last use
                lent.restart(f"{dead[0].base_url} {dead[0].describe_exit()} since its last use")
            return lent
    return None
