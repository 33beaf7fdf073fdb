"""The acting policy of a step, built from the config and the run's checkpoints.

Shared by the stages that play episodes (rollout for training and validation, and the
evaluation flow); not a stage itself. Step ``s`` acts with the newest checkpoint written
before it (policy version ``s`` in a lockstep run), or the base model at step 0.

``[rollout].backend = "openai"`` plays against an OpenAI-compatible server instead (a
vLLM server, a hosted model): nothing is loaded here, the server holds the weights, and
the episodes carry whatever token ids and logprobs the server returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rollflow.envs.agent import Policy
from rollflow.policy.models import load_causal_lm
from rollflow.policy.sampling import SamplingSettings
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.checkpoints import CheckpointError, latest_checkpoint, policy_model_ref, torch_dtype
from rollflow.tasks.config import RunConfig


BATCH_WINDOW_S = 10.0


@dataclass
class ActingPolicy:
    """A policy plus a way to fix its sampling seed (a no-op for policies without one)."""

    policy: Policy

    def reseed(self, seed: int) -> None:
        reseed = getattr(self.policy, "reseed", None)
        if callable(reseed):
            reseed(seed)


@contextmanager
def open_policy(
    config: RunConfig, folder: RunFolder | None, step: int, given: Policy | None = None
) -> Iterator[ActingPolicy]:
    """The policy that acts at ``step`` (``given`` wins: tests, the Python API)."""
    if given is not None:
        yield ActingPolicy(given)
        return
    if config.rollout.backend == "openai":
        yield ActingPolicy(_openai_policy(config))
        return
    yield ActingPolicy(load_transformers_policy(config, folder, step))


def load_transformers_policy(config: RunConfig, folder: RunFolder | None, step: int) -> Policy:
    from rollflow.policy.transformers_backend import TransformersPolicy

    checkpoint = latest_checkpoint(folder, before_step=step) if folder is not None else None
    if folder is not None and step > 0 and (checkpoint is None or checkpoint.step != step - 1):
        found = "none" if checkpoint is None else f"step {checkpoint.step}"
        raise CheckpointError(
            f"{folder.root}: step {step} acts with the checkpoint of step {step - 1}, "
            f"but the newest one before it is {found}"
        )
    model, tokenizer = load_causal_lm(policy_model_ref(config, checkpoint), torch_dtype(config))
    version = 0 if checkpoint is None else checkpoint.policy_version
    # A batch forms once every open episode is waiting for its next action; the window
    # only matters when an environment step is slow. Batches then have the same members
    # on every run, so a replayed chunk reproduces its logprobs bit for bit (the padded
    # shape of a batch changes the floating-point sums).
    return TransformersPolicy(
        model, tokenizer, _sampling_settings(config), version=version, batch_window_s=BATCH_WINDOW_S
    )


def _sampling_settings(config: RunConfig) -> SamplingSettings:
    rollout = config.rollout
    return SamplingSettings(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        max_completion_tokens=rollout.max_completion_tokens,
        max_model_length=rollout.max_model_length,
        seed=config.train.seed,
        generation_timeout_s=rollout.generation_timeout_s,
        max_sampling_attempts=rollout.max_sampling_attempts,
    )


def _openai_policy(config: RunConfig) -> Policy:
    from rollflow.policy.openai_backend import OpenAIChatPolicy

    rollout = config.rollout
    if not rollout.base_url or not rollout.api_model:
        raise ValueError("[rollout] backend = \"openai\" needs base_url and api_model")
    return OpenAIChatPolicy(
        base_url=rollout.base_url,
        model=rollout.api_model,
        settings=_sampling_settings(config),
    )
