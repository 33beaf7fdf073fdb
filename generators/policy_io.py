"""The acting policy of a step: a generator's policy for the checkpoint the step acts with.

Shared by the stages that play episodes (rollout for training and validation, and the
evaluation flow); not a stage itself. Step ``s`` acts with the newest checkpoint written
before it (policy version ``s`` in a lockstep run), or the base model at step 0
(``step_checkpoint``).

``open_policy(config, folder, step, source)`` asks ``source`` (a ``Generator``,
``rollflow.generators.generator``) for that version's policy and binds the two in an
``ActingPolicy``, which the rollout stage asks after each chunk whether the generator
still samples (``fault``) and has restart it (``restart``: the same version again on a
fresh server). ``source`` may also be a plain ``Policy`` (tests, the Python API: wrapped
in a ``FixedGenerator``, nothing to watch), or an ``ActingPolicy`` already bound (an async
run's validation, ``AsyncGenerator.pinned_for_validation``). With no ``source`` the
stage opens the backend's generator for itself (``open_generator``: a vLLM one lent by the
caller, else a new server, stopped when the stage ends); ``"openai"`` is evaluation only,
and ``rollflow train`` refuses it (``config/checks.check_training_backend``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig
from rollflow.envs.agent import Policy
from rollflow.generators.checkpoints import Checkpoint, CheckpointError, latest_checkpoint
from rollflow.generators.generator import FixedGenerator, Generator, GeneratorError, GeneratorFault
from rollflow.generators.run_generator import open_generator
from rollflow.storage.runfolder import RunFolder


@dataclass
class ActingPolicy:
    """A policy, the generator it samples on, and the version it acts as.

    ``generator`` None: nothing to watch or restart. ``restart`` brings the generator back
    and acts with the same version (``checkpoint``) again.
    """

    policy: Policy
    generator: Generator | None = None
    version: int = 0
    checkpoint: Path | None = None

    def reseed(self, seed: int) -> None:
        reseed = getattr(self.policy, "reseed", None)
        if callable(reseed):
            reseed(seed)

    def fault(self) -> GeneratorFault | None:
        """None while every generator server answers (always None for other backends)."""
        return None if self.generator is None else self.generator.fault()

    def restart(self, reason: str) -> None:
        """Restart the managed server and act with it; ``GeneratorError`` for external ones."""
        if self.generator is None:
            raise GeneratorError(f"nothing to restart: {reason}")
        self.generator.restart(reason)
        self.policy = self.generator.policy_for(self.version, self.checkpoint)


@contextmanager
def open_policy(
    config: RunConfig, folder: RunFolder | None, step: int, source: Generator | Policy | ActingPolicy | None = None
) -> Iterator[ActingPolicy]:
    """The policy that acts at ``step``, from ``source`` (see the module docstring)."""
    if isinstance(source, ActingPolicy):
        yield source
        return
    if source is not None and not hasattr(source, "policy_for"):  # a plain policy
        yield ActingPolicy(source, FixedGenerator(source), getattr(source, "version", 0))
        return
    checkpoint = step_checkpoint(folder, step)
    if config.rollout.base_urls and checkpoint is not None and not checkpoint.use_lora:
        raise ConfigError(
            "[rollout].base_urls: full-weight checkpoints cannot reach external vLLM servers; "
            "train with [train].use_lora = true, or leave base_urls empty for a managed server"
        )
    version = 0 if checkpoint is None else checkpoint.policy_version
    path = None if checkpoint is None else checkpoint.path
    if source is not None:
        yield ActingPolicy(source.policy_for(version, path), source, version, path)
        return
    with open_generator(config, folder, versions_in_flight=1) as generator:
        yield ActingPolicy(generator.policy_for(version, path), generator, version, path)


def step_policy(generator: Generator, folder: RunFolder | None, step: int) -> Policy:
    """``generator``'s policy for the checkpoint step ``step`` acts with."""
    checkpoint = step_checkpoint(folder, step)
    version = 0 if checkpoint is None else checkpoint.policy_version
    return generator.policy_for(version, None if checkpoint is None else checkpoint.path)


def step_checkpoint(folder: RunFolder | None, step: int) -> Checkpoint | None:
    """The checkpoint step ``step`` acts with: step - 1's, or None (the base) at step 0."""
    checkpoint = latest_checkpoint(folder, before_step=step) if folder is not None else None
    if folder is not None and step > 0 and (checkpoint is None or checkpoint.step != step - 1):
        found = "none" if checkpoint is None else f"step {checkpoint.step}"
        raise CheckpointError(
            f"{folder.root}: step {step} acts with the checkpoint of step {step - 1}, "
            f"but the newest one before it is {found}"
        )
    return checkpoint
