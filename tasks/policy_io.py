"""The acting policy of a step, built from the config and the run's checkpoints.

Shared by the stages that play episodes (rollout for training and validation, and the
evaluation flow); not a stage itself. Step ``s`` acts with the newest checkpoint written
before it (policy version ``s`` in a lockstep run), or the base model at step 0.

``[rollout].backend``:

- ``"transformers"``: the model is loaded in this process (``TransformersPolicy``).
- ``"vllm"``: vLLM servers sample (``rollflow.policy.vllm_backend``). With no
  ``[rollout].base_urls`` rollflow manages one server itself
  (``rollflow.policy.vllm_server``): started at the first step that needs it, its log in
  the run folder's ``logs/vllm-server.log``, reused by every later step of the process and
  stopped when the process exits. With LoRA, each step loads its checkpoint's adapter as
  ``policy-<run>-v{version}`` (``run_adapter_prefix``: named by run, so runs sharing a
  server keep their own) before the rollout (and unloads the previous one); with full
  weights the server keeps serving the base model's folder and each step's checkpoint is
  swapped in place (``VLLMPolicy.reload_weights``: vLLM's ``reload_weights`` through
  ``/collective_rpc``, then a prefix-cache reset), which replaced a restart. With ``base_urls`` the servers are the user's: they must serve
  the base model with ``--enable-lora`` (for LoRA) and
  ``--logprobs-mode processed_logprobs`` (checked on first contact), and read the run
  folder's checkpoints at the same paths; full-weight training cannot reach them.
- ``"openai"``: a chat-completions server, for evaluation only: nothing is loaded here
  and no new weights ever reach the server, so ``rollflow train`` refuses it
  (``check_training_backend``).

A generator that stops answering (``generator_fault``: the managed server's process
group died, or any server's ``GET /health`` fails) is the rollout stage's to handle
(``rollflow.tasks.rollout``): ``ActingPolicy.restart_generator`` restarts a managed
server with the same spec (its log, in the run folder when there is one, says it restarted
and why), builds the policy for its new port and reloads the step's adapter under the
same version; external servers are the user's and raise ``GeneratorError`` naming the URL.
A managed server found dead at the start of a stage is restarted the same way.

Simplified, and why: one managed vLLM server per process (a new model folder or new
flags replace it), since a server holds ~5 GB and two would not fit beside training here.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
from transformers import PreTrainedTokenizerBase

from rollflow.envs.agent import Policy
from rollflow.policy.models import ModelRef, hf_model_folder, load_causal_lm, load_tokenizer
from rollflow.policy.procs import fault_point
from rollflow.policy.sampling import SamplingSettings
from rollflow.policy.vllm_backend import VLLMPolicy, adapter_name, discover_served_model
from rollflow.policy.vllm_server import VLLMServer, VLLMServerSpec, lora_rank_limit, untied_serving_folder
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.checkpoints import (
    Checkpoint,
    CheckpointError,
    base_model_ref,
    latest_checkpoint,
    policy_model_ref,
    torch_device,
    torch_dtype,
)
from rollflow.tasks.config import ConfigError, RunConfig

BATCH_WINDOW_S = 10.0
SERVED_MODEL_NAME = "policy"
VLLM_LOG = Path("logs") / "vllm-server.log"
HEALTH_TIMEOUT_S = 10.0
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


class GeneratorWatch(Protocol):
    """What watches a policy's vLLM servers and rebuilds the policy after a restart."""

    def fault(self) -> GeneratorFault | None: ...

    def restart(self, fault: GeneratorFault) -> Policy: ...


@dataclass
class ActingPolicy:
    """A policy plus a way to fix its sampling seed (a no-op for policies without one).

    ``generator``: watches the vLLM servers this policy samples on (None: nothing to watch
    or restart): ``VLLMStep`` for lockstep, the async generator's own for its validation.
    """

    policy: Policy
    generator: GeneratorWatch | None = None

    def reseed(self, seed: int) -> None:
        reseed = getattr(self.policy, "reseed", None)
        if callable(reseed):
            reseed(seed)

    def generator_fault(self) -> GeneratorFault | None:
        """None while every generator server answers (always None for other backends)."""
        return None if self.generator is None else self.generator.fault()

    def restart_generator(self, fault: GeneratorFault) -> None:
        """Restart the managed server and act with it; ``GeneratorError`` for external ones."""
        if self.generator is None:
            raise GeneratorError(f"nothing to restart: {fault.describe()}")
        self.policy = self.generator.restart(fault)


@dataclass(frozen=True)
class VLLMStep:
    """What rebuilds a step's vLLM policy after its server was restarted."""

    config: RunConfig
    folder: RunFolder | None
    step: int

    def fault(self) -> GeneratorFault | None:
        return generator_fault()

    def restart(self, fault: GeneratorFault) -> Policy:
        if not fault.managed or not _GENERATOR or _GENERATOR[0].server is None:
            raise GeneratorError(f"{fault.describe()}; {UNMANAGED_SERVER}")
        _restart_managed(_GENERATOR[0], self.folder, f"{fault.server} {fault.reason} during a rollout")
        return load_vllm_policy(self.config, self.folder, self.step)  # the step's adapter again


@contextmanager
def open_policy(
    config: RunConfig, folder: RunFolder | None, step: int, given: Policy | ActingPolicy | None = None
) -> Iterator[ActingPolicy]:
    """The policy that acts at ``step`` (``given`` wins: tests, the Python API, an async
    run's validation, which comes with its generator's watch)."""
    if isinstance(given, ActingPolicy):
        yield given
        return
    if given is not None:
        yield ActingPolicy(given)
        return
    if config.rollout.backend == "openai":
        yield ActingPolicy(_openai_policy(config))
        return
    if config.rollout.backend == "vllm":
        yield ActingPolicy(load_vllm_policy(config, folder, step), VLLMStep(config, folder, step))
        return
    yield ActingPolicy(load_transformers_policy(config, folder, step))


def check_training_backend(config: RunConfig) -> None:
    """Refuse a backend that cannot train: ``"openai"`` would never see new weights."""
    if config.rollout.backend == "openai":
        raise ConfigError(
            "[rollout].backend = 'openai' cannot train: no new weights ever reach the server, "
            "so every step would sample the starting policy (off-policy, every episode stamped "
            "version 0). Use backend = 'vllm' (a managed server, or your own with base_urls); "
            "'openai' is for `rollflow eval`"
        )


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


def load_transformers_policy(config: RunConfig, folder: RunFolder | None, step: int) -> Policy:
    from rollflow.policy.transformers_backend import TransformersPolicy

    checkpoint = step_checkpoint(folder, step)
    model, tokenizer = load_causal_lm(
        policy_model_ref(config, checkpoint), torch_dtype(config), device=torch_device(config)
    )
    version = 0 if checkpoint is None else checkpoint.policy_version
    # A batch forms once every open episode is waiting for its next action; the window
    # only matters when an environment step is slow. Batches then have the same members
    # on every run, so a replayed chunk reproduces its logprobs bit for bit (the padded
    # shape of a batch changes the floating-point sums).
    return TransformersPolicy(
        model, tokenizer, sampling_settings(config), version=version, batch_window_s=BATCH_WINDOW_S
    )


# ---------------------------------------------------------------- vLLM


@dataclass
class _Generator:
    """A vLLM policy kept across steps (it knows which adapter its servers hold)."""

    key: tuple[object, ...]
    policy: VLLMPolicy
    server: VLLMServer | None  # None: external servers
    tokenizer: PreTrainedTokenizerBase | None = None  # managed: to rebuild the policy on a restart
    weights: str | None = None  # a full-weight checkpoint reloaded into the server (None: its own)


_GENERATOR: list[_Generator] = []  # at most one: see the module docstring


def load_vllm_policy(config: RunConfig, folder: RunFolder | None, step: int) -> Policy:
    """The step's vLLM policy, its servers holding the step's weights."""
    checkpoint = step_checkpoint(folder, step)
    ref = policy_model_ref(config, checkpoint)
    version = 0 if checkpoint is None else checkpoint.policy_version
    # Full-weight training: one server for the whole run, each version swapped in place
    full_weights = not config.train.use_lora and ref.adapter is None
    if config.rollout.base_urls:
        generator = _external_generator(config, ref)
    elif full_weights:  # the server keeps serving one folder; each version is swapped in
        generator = _managed_generator(config, folder, full_weight_serving_ref(config))
    else:
        generator = _managed_generator(config, folder, ref)
    policy = generator.policy
    policy.settings = sampling_settings(config)
    if ref.adapter is not None:
        fault_point("weight_publish")  # tests: a kill while the step's weights go to the server
        policy.load_adapter(ref.adapter, version, adapter_name(run_adapter_prefix(folder), version))
    else:
        policy.unload_adapter()
    wanted = str(ref.path) if full_weights and checkpoint is not None else None
    if generator.server is not None and generator.weights != wanted:  # None: the spec's own folder
        seconds = policy.reload_weights(wanted or generator.server.spec.model_dir, version)
        generator.weights = wanted
        print(f"  vLLM: version {version}'s weights reloaded in place in {seconds:.1f}s", file=sys.stderr, flush=True)
    policy.version = version
    return policy


def full_weight_serving_ref(config: RunConfig) -> ModelRef:
    """What a full-weight run's managed server loads: the base model, untied when its
    output layer is tied (``rollflow.policy.vllm_server.untied_serving_folder``)."""
    base = base_model_ref(config)
    return ModelRef(path=str(untied_serving_folder(hf_model_folder(ModelRef(path=base.path, gguf_file=base.gguf_file)))))


def _managed_generator(config: RunConfig, folder: RunFolder | None, ref: ModelRef) -> _Generator:
    lora = config.train.use_lora or config.model.adapter is not None
    spec = VLLMServerSpec(
        model_dir=str(hf_model_folder(ModelRef(path=ref.path, gguf_file=ref.gguf_file))),
        served_model_name=config.rollout.api_model or SERVED_MODEL_NAME,
        max_model_len=config.rollout.max_model_length,
        enable_lora=lora,
        max_lora_rank=lora_rank_limit(config.train.lora_rank) if lora else 16,
        kvcache_space_gib=config.rollout.vllm_kvcache_space_gib,
        python=config.rollout.vllm_python,
    )
    key = ("managed", spec)
    if _GENERATOR and _GENERATOR[0].key == key:
        kept = _GENERATOR[0]
        if kept.server is not None and not kept.server.running:  # died since the last stage
            _restart_managed(kept, folder, f"{kept.server.base_url} {kept.server.describe_exit()} between stages")
        return kept
    stop_vllm_generator()  # never two servers at once
    log = folder.root / VLLM_LOG if folder is not None else None
    server = VLLMServer(spec, log_path=log, startup_timeout_s=config.rollout.vllm_startup_timeout_s).start()
    tokenizer = load_tokenizer(ref)
    policy = managed_policy(server, tokenizer, sampling_settings(config))
    _GENERATOR.append(_Generator(key, policy, server, tokenizer))
    return _GENERATOR[0]


def managed_policy(
    server: VLLMServer, tokenizer: PreTrainedTokenizerBase, settings: SamplingSettings
) -> VLLMPolicy:
    spec = server.spec
    policy = VLLMPolicy(
        [server.base_url], tokenizer, settings, served_model=spec.served_model_name,
        stop_token_ids=stop_token_ids(Path(spec.model_dir)),
        max_lora_rank=spec.max_lora_rank if spec.enable_lora else None,
    )  # fmt: skip
    policy.connect(check_logprobs_mode=False)  # our flags: processed logprobs
    return policy


def _restart_managed(generator: _Generator, folder: RunFolder | None, reason: str) -> None:
    """The same spec on a fresh server; a new policy for its port (counters carried over)."""
    server, tokenizer = generator.server, generator.tokenizer
    assert server is not None and tokenizer is not None
    print(f"  vLLM: restarting the managed server: {reason}", file=sys.stderr, flush=True)
    server.restart(reason, log_path=folder.root / VLLM_LOG if folder is not None else None)
    print(f"  vLLM: restarted, healthy after {server.startup_s:.1f} s", file=sys.stderr, flush=True)
    old = generator.policy
    generator.weights = None  # a fresh server holds its spec's weights again
    generator.policy = managed_policy(server, tokenizer, old.settings)
    generator.policy.stats = old.stats


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


def generator_fault() -> GeneratorFault | None:
    """Why the kept vLLM generator cannot sample now; None when every server answers."""
    if not _GENERATOR:
        return None
    return server_fault(_GENERATOR[0].server, _GENERATOR[0].policy.base_urls)


def server_fault(server: VLLMServer | None, base_urls: Sequence[str]) -> GeneratorFault | None:
    """Why ``server`` (managed) or the user's ``base_urls`` (``server`` None) cannot sample."""
    if server is None:
        for url in base_urls:
            problem = _health_problem(url)
            if problem is not None:
                return GeneratorFault(url, problem, managed=False)
        return None
    url = base_urls[0]
    problem = None if server.running else server.describe_exit()
    problem = problem or _health_problem(url)
    if problem is None:
        return None
    return GeneratorFault(url, problem, managed=True, log_path=server.log_path, log_tail=server.log_tail())


def _health_problem(base_url: str) -> str | None:
    """None when ``GET /health`` answers 200, else what went wrong."""
    url = base_url.removesuffix("/v1") + "/health"
    try:
        response = httpx.get(url, timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError as error:
        return f"stopped answering (GET {url}: {type(error).__name__}: {error})"
    if response.status_code != 200:
        return f"is unhealthy (GET {url} answered HTTP {response.status_code})"
    return None


def _external_generator(config: RunConfig, ref: ModelRef) -> _Generator:
    rollout = config.rollout
    if ref.adapter is None and ref != base_model_ref(config):
        raise ConfigError(
            "[rollout].base_urls: full-weight checkpoints cannot reach external vLLM servers; "
            "train with [train].use_lora = true, or leave base_urls empty for a managed server"
        )
    key = ("external", rollout.base_urls, rollout.api_model)
    if _GENERATOR and _GENERATOR[0].key == key:
        return _GENERATOR[0]
    stop_vllm_generator()
    served = rollout.api_model or discover_served_model(rollout.base_urls[0])
    policy = VLLMPolicy(
        rollout.base_urls, load_tokenizer(ref), sampling_settings(config), served_model=served,
        stop_token_ids=stop_token_ids(hf_model_folder(base_model_ref(config))),
    )  # fmt: skip
    policy.connect(check_logprobs_mode=True)
    _GENERATOR.append(_Generator(key, policy, None))
    return _GENERATOR[0]


def stop_vllm_generator() -> None:
    """Stop the managed server, if one runs, and forget the kept policy."""
    while _GENERATOR:
        server = _GENERATOR.pop().server
        if server is not None:
            server.stop()


def _server_running(generator: _Generator) -> bool:
    return generator.server is not None and generator.server.running


def stop_token_ids(model_dir: Path) -> list[int]:
    """The end tokens ``generation_config.json`` declares (vLLM stops on them too)."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except OSError:  # no generation config: the tokenizer's eos alone
        return []
    if eos is None:
        return []
    return [int(token) for token in (eos if isinstance(eos, list) else [eos])]


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


def _openai_policy(config: RunConfig) -> Policy:
    from rollflow.policy.openai_backend import OpenAIChatPolicy

    rollout = config.rollout
    if not rollout.base_url or not rollout.api_model:
        raise ValueError("[rollout] backend = \"openai\" needs base_url and api_model")
    return OpenAIChatPolicy(
        base_url=rollout.base_url,
        model=rollout.api_model,
        settings=sampling_settings(config),
    )
