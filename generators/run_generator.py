"""Which generator a run gets, and its life: ``open_generator``.

``generators/generator.py`` says what a generator is and holds what every backend shares;
``generators/vllm_generator.py`` is the vLLM one. This module sits above both, so neither
imports the other's chooser: the import graph has no circle here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from rollflow.config.run import RunConfig
from rollflow.generators.generator import Generator, LocalGenerator, openai_generator
from rollflow.generators.lending import lent_generator
from rollflow.generators.managed_server import ServerHost
from rollflow.generators.vllm_generator import start_vllm_generator
from rollflow.storage.runfolder import RunFolder


@contextmanager
def open_generator(
    config: RunConfig, folder: RunFolder | None, *, versions_in_flight: int, host: ServerHost | None = None,
    cpus: Sequence[int] = (),
) -> Iterator[Generator]:  # fmt: skip
    """The run's generator (see the module docstring), closed afterwards, also on failure;
    a vLLM generator lent by the caller (``lending.lend``) is used and left running.
    ``host``: where a vLLM generator's managed servers start (None: this machine); ``cpus``:
    the cores they are bound to (empty: every core; an async run's split)."""
    if config.rollout.backend == "openai":
        generator: Generator = openai_generator(config)
    elif config.rollout.backend == "vllm":
        lent = lent_generator(config, folder, versions_in_flight=versions_in_flight, cpus=cpus)
        if lent is not None:
            yield lent
            return
        generator = start_vllm_generator(config, folder, versions_in_flight=versions_in_flight, host=host, cpus=cpus)
    else:
        generator = LocalGenerator(config)
    try:
        yield generator
    finally:
        generator.close()
