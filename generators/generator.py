"""The run's generator: what samples the policy's versions, held for a whole run.

Not a stage; the stages sample through it. ``open_generator(config, folder,
versions_in_flight=N)`` (``generators/run_generator.py``, which picks the class; this module
is what every class shares) yields a ``Generator`` for the whole run (lockstep: 1 version
in flight; async: ``max_steps_off_policy + 2``) and closes it after, also on failure. Its
face:

- ``policy_for(version, checkpoint)``: the policy acting as ``version``, whose weights are
  ``checkpoint`` (a checkpoint folder; None: the run's start, the base model or
  ``[model].adapter``), made the one version served;
- ``publish(version, checkpoint)``: ``version`` served beside the versions held (LoRA
  adapters) or in place of them (weights reloaded in place);
- ``fault()``: why it cannot sample now (None while it can); ``restart(reason)``; ``close()``.

One class per ``[rollout].backend``:

- ``"vllm"``: ``VLLMGenerator``. With no ``[rollout].base_urls`` rollflow manages one
  server (``rollflow.policy.vllm_server``; its log is the run folder's
  ``logs/vllm-server.log``), or ``[rollout].num_generator_replicas`` of them, each version
  published to all (``rollflow.generators.vllm_generator``). How a version reaches it:
  - full weights: reloaded in place (``VLLMPolicy.reload_weights``) into a server started
    on an untied copy of the base model (``rollflow.policy.vllm_weights``);
  - LoRA, ``[rollout].lora_serving = "merged"`` (the default): each version's adapter is
    merged into the base in float32 (``<run>/serving/policy-v{N}-merged``, only the served
    one kept) and reloaded in place like full weights, on a server without
    ``--enable-lora``, which samples at the base model's speed;
  - LoRA, ``"adapter"``: vLLM's LoRA path, each version loaded as ``policy-<run>-v{N}``
    (``run_adapter_prefix``: runs sharing a server keep their own), ``--max-loras`` =
    versions in flight. Better where many adapters share one server, or where merging and
    reloading a large model's weights each version costs more than the LoRA kernels
    (large models, GPUs).
  With ``base_urls`` the servers are the user's: they must serve the base model with
  ``--enable-lora`` and ``--logprobs-mode processed_logprobs`` (checked on first contact)
  and read the run's checkpoints at the same paths; LoRA versions reach them as adapters,
  and full-weight checkpoints cannot reach them.
- ``"transformers"``: ``LocalGenerator`` loads the checkpoint in this process in
  ``policy_for``; ``publish`` has nothing to send.
- ``"openai"``: ``FixedGenerator``: one fixed policy, for evaluation; it refuses
  ``publish`` (no new weights reach such a server). Tests and the Python API wrap a policy
  of their own in it too.

Faults: a managed server whose process group died, or any server whose ``GET /health``
fails. ``RestartBudget.keep`` is the one decision every sampling caller makes after a
piece of work (a rollout chunk, an async group): keep it, or restart a managed server
(same spec, a fresh port, what it held loaded again; its log says it restarted and why)
and replay the work, at most ``MAX_GENERATOR_RESTARTS`` times per budget; an external
server raises ``GeneratorError`` naming its URL.

Who holds it: the training flow, for the whole run (``flows/train.py``), and the
evaluation flow (``flows/eval.py``); a stage is handed the policy it acts with
(``generators/policy_io.acting_policy``) and never opens one. A caller that
runs several flows or stages in a row can lend them one vLLM generator
(``rollflow.generators.lending.lend``): a server holds gigabytes and is slow to
start, so a test module or a notebook starts it once.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rollflow.config.run import RunConfig
from rollflow.envs.agent import Policy
from rollflow.generators.checkpoints import read_checkpoint
from rollflow.generators.models import policy_model_ref, torch_device, torch_dtype
from rollflow.policy.models import load_causal_lm
from rollflow.policy.sampling import SamplingSettings
from rollflow.storage.runfolder import RunFolder

BATCH_WINDOW_S = 10.0
MAX_GENERATOR_RESTARTS = 2  # per budget: a server that keeps dying is not a transient fault
UNMANAGED_SERVER = (
    "rollflow cannot restart a server it does not manage ([rollout].base_urls): restart it "
    "and resume the run (finished chunks are kept, only the missing ones are replayed)"
)


class GeneratorError(RuntimeError):
    """The generator stopped answering and cannot be (or may no longer be) restarted."""


@dataclass(frozen=True)
class GeneratorFault:
    """Why the generator cannot sample: which server, what happened, whether we may restart it."""

    server: str  # the base URL that stopped answering
    reason: str  # e.g. "was killed by SIGKILL (exit status -9)"
    managed: bool  # ours to restart; False: one of the user's base_urls
    log_path: Path | None = None
    log_tail: str = ""

    def describe(self) -> str:
        owner = "the managed vLLM server" if self.managed else "the vLLM server"
        text = f"{owner} {self.server} {self.reason}"
        if self.log_path is not None:
            text += f"\nlog: {self.log_path}\n--- its tail ---\n{self.log_tail}"
        return text


class Watched(Protocol):
    """What ``RestartBudget`` asks after a piece of work: a generator, or a policy bound to one."""

    def fault(self) -> GeneratorFault | None: ...

    def restart(self, reason: str) -> None: ...


class Sampler(Watched, Protocol):
    """What an acting policy samples on (``generators/policy_io.ActingPolicy``): a run's
    generator, or an async run's (``AsyncGenerator``, which pins each version it is asked for)."""

    def policy_for(self, version: int, checkpoint: Path | None) -> Policy: ...


class Generator(Sampler, Protocol):
    """What samples the run's policy versions (see the module docstring)."""

    def publish(self, version: int, checkpoint: Path) -> None: ...

    def close(self) -> None: ...


class RestartBudget:
    """The one fault check after a piece of work: keep it, or restart and replay it."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = MAX_GENERATOR_RESTARTS if limit is None else limit
        self.used = 0

    def keep(self, generator: Watched, errored: int, total: int, label: str) -> bool:
        """True: keep the work (every action came from a live server). False: it is
        discarded and the generator was restarted. ``GeneratorError`` when it may not be."""
        fault = generator.fault()
        if fault is None:
            return True
        if not fault.managed and not errored:  # the other replicas served it
            print(f"  {label}: warning: {fault.describe()}", file=sys.stderr, flush=True)
            return True
        lost = f"{label}: {errored} of {total} episodes errored and were not written"
        if not fault.managed:
            raise GeneratorError(f"{lost}: {fault.describe()}; {UNMANAGED_SERVER}")
        if self.used >= self.limit:
            raise GeneratorError(
                f"{lost}: {fault.describe()}\nit died after {self.used} restarts in this stage "
                f"(MAX_GENERATOR_RESTARTS = {self.limit}); look at its log"
            )
        self.used += 1
        print(f"  {lost}; restart {self.used}/{self.limit}: {fault.server} {fault.reason}", file=sys.stderr, flush=True)
        generator.restart(f"{fault.server} {fault.reason} during {label}")
        return not errored


# ---------------------------------------------------------------- the in-process and fixed ones


class FixedGenerator:
    """One policy that never changes: the openai backend's, or one given by a test or the API."""

    def __init__(self, policy: Policy, why: str = "a fixed policy") -> None:
        self.policy, self.why = policy, why

    def policy_for(self, version: int, checkpoint: Path | None) -> Policy:
        return self.policy

    def publish(self, version: int, checkpoint: Path) -> None:
        raise GeneratorError(f"{self.why} receives no new weights (version {version} from {checkpoint})")

    def fault(self) -> GeneratorFault | None:
        return None

    def restart(self, reason: str) -> None:
        raise GeneratorError(f"nothing to restart ({self.why}): {reason}")

    def close(self) -> None:
        pass


class LocalGenerator:
    """The transformers backend: each ``policy_for`` loads its checkpoint in this process."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    def policy_for(self, version: int, checkpoint: Path | None) -> Policy:
        from rollflow.policy.transformers_backend import TransformersPolicy

        config = self.config
        ref = policy_model_ref(config, read_checkpoint(checkpoint) if checkpoint is not None else None)
        model, tokenizer = load_causal_lm(ref, torch_dtype(config), device=torch_device(config))
        # A batch forms once every open episode is waiting for its next action; the window
        # only matters when an environment step is slow. Batches then have the same members
        # on every run, so a replayed chunk reproduces its logprobs bit for bit (the padded
        # shape of a batch changes the floating-point sums).
        return TransformersPolicy(
            model, tokenizer, sampling_settings(config), version=version, batch_window_s=BATCH_WINDOW_S
        )

    def publish(self, version: int, checkpoint: Path) -> None:
        """Nothing to send: the next ``policy_for`` loads the checkpoint."""

    def fault(self) -> GeneratorFault | None:
        return None  # it runs in this process

    def restart(self, reason: str) -> None:
        raise GeneratorError(f"nothing to restart (the transformers backend): {reason}")

    def close(self) -> None:
        pass


def openai_generator(config: RunConfig) -> FixedGenerator:
    from rollflow.policy.openai_backend import OpenAIChatPolicy

    rollout = config.rollout
    if not rollout.base_url or not rollout.api_model:
        raise ValueError("[rollout] backend = \"openai\" needs base_url and api_model")
    policy = OpenAIChatPolicy(base_url=rollout.base_url, model=rollout.api_model, settings=sampling_settings(config),
                              tools_in_system_prompt=rollout.tools_in_system_prompt)
    return FixedGenerator(policy, "an OpenAI-compatible server ([rollout].backend = 'openai')")


# ---------------------------------------------------------------- shared


def sampling_settings(config: RunConfig) -> SamplingSettings:
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


def run_adapter_prefix(folder: RunFolder | None) -> str:
    """``policy-<run id>-<6 hex of its path>``: the run's LoRA adapter names on a server
    (``adapter_name``), so two runs, or an evaluation beside a run, sharing a server never
    replace or unload each other's (the hash tells apart runs whose folders share a name).
    Without a run folder: this process's id."""
    if folder is None:
        return f"policy-pid{os.getpid()}"
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", folder.run_id)
    digest = hashlib.sha256(str(folder.root.resolve()).encode()).hexdigest()[:6]
    return f"policy-{readable}-{digest}"
