"""The acting policy of a stage: a generator's policy for the checkpoint the stage acts with.

Shared by the stages that play episodes (rollout for training and validation, and the
evaluation flow); not a stage itself. Step ``s`` acts with the newest checkpoint written
before it (policy version ``s`` in a lockstep run), or the base model at step 0: the
checkpoint the step's train stage starts from too (``RunFolder.starting_checkpoint``).

The flow builds the policy a stage acts with: ``acting_policy(config, generator,
checkpoint)`` asks the flow's generator (a ``Sampler``, ``rollflow.generators.generator``)
for that checkpoint's version and binds the two in an ``ActingPolicy``, which the rollout
stage asks after each chunk whether the generator still samples (``fault``) and has
restart it (``restart``: the same version again on a fresh server). A plain ``Policy``
(tests, the Python API) acts as ``ActingPolicy.fixed(policy)``: nothing to watch. A stage
never opens a generator (or starts a server) for itself; ``"openai"`` is evaluation only,
and ``rollflow train`` refuses it (``config/checks.check_training_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig
from rollflow.envs.agent import Policy
from rollflow.generators.checkpoints import Checkpoint, read_checkpoint
from rollflow.generators.generator import FixedGenerator, Generator, GeneratorError, GeneratorFault, Sampler
from rollflow.storage.runfolder import RunFolder


@dataclass
class ActingPolicy:
    """A policy, the generator it samples on, and the version it acts as.

    ``generator`` None: nothing to watch or restart. ``restart`` brings the generator back
    and acts with the same version (``checkpoint``) again.
    """

    policy: Policy
    generator: Sampler | None = None
    version: int = 0
    checkpoint: Path | None = None

    @classmethod
    def fixed(cls, policy: Policy) -> ActingPolicy:
        """A policy of the caller's own (a test's, the Python API's): nothing to watch or restart."""
        return cls(policy, FixedGenerator(policy), getattr(policy, "version", 0))

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


def acting_policy(config: RunConfig, generator: Sampler, checkpoint: Path | None) -> ActingPolicy:
    """``generator``'s policy acting as ``checkpoint``'s version (None: the run's start,
    version 0), bound to it (see the module docstring)."""
    found = read_checkpoint(checkpoint) if checkpoint is not None else None
    if config.rollout.base_urls and found is not None and not found.use_lora:
        raise ConfigError(
            "[rollout].base_urls: full-weight checkpoints cannot reach external vLLM servers; "
            "train with [train].use_lora = true, or leave base_urls empty for a managed server"
        )
    version = 0 if found is None else found.policy_version
    return ActingPolicy(generator.policy_for(version, checkpoint), generator, version, checkpoint)


def step_policy(generator: Generator, folder: RunFolder | None, step: int) -> Policy:
    """``generator``'s policy for the checkpoint step ``step`` acts with."""
    checkpoint = step_checkpoint(folder, step)
    version = 0 if checkpoint is None else checkpoint.policy_version
    return generator.policy_for(version, None if checkpoint is None else checkpoint.path)


def step_checkpoint(folder: RunFolder | None, step: int) -> Checkpoint | None:
    """The checkpoint step ``step`` acts with, read: step - 1's (``RunFolder.starting_checkpoint``,
    which refuses an older one), or None (the base) at step 0 or without a folder."""
    path = folder.starting_checkpoint(step) if folder is not None else None
    return read_checkpoint(path) if path is not None else None
