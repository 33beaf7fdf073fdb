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
  ``policy-v{version}`` before the rollout (and unloads the previous one); with full
  weights the server restarts on the step's checkpoint folder (``VLLMServer.startup_s``
  says how long that took). With ``base_urls`` the servers are the user's: they must serve
  the base model with ``--enable-lora`` (for LoRA) and
  ``--logprobs-mode processed_logprobs`` (checked on first contact), and read the run
  folder's checkpoints at the same paths; full-weight training cannot reach them.
- ``"openai"``: a chat-completions server, for evaluation only: nothing is loaded here
  and no new weights ever reach the server, so ``rollflow train`` refuses it
  (``check_training_backend``).

Simplified, and why: one managed vLLM server per process (a new model folder or new
flags replace it), since a server holds ~5 GB and two would not fit beside training here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rollflow.envs.agent import Policy
from rollflow.policy.models import ModelRef, hf_model_folder, load_causal_lm, load_tokenizer
from rollflow.policy.sampling import SamplingSettings
from rollflow.policy.vllm_backend import VLLMPolicy, discover_served_model
from rollflow.policy.vllm_server import VLLMServer, VLLMServerSpec, lora_rank_limit
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.checkpoints import (
    Checkpoint,
    CheckpointError,
    base_model_ref,
    latest_checkpoint,
    policy_model_ref,
    torch_dtype,
)
from rollflow.tasks.config import ConfigError, RunConfig

BATCH_WINDOW_S = 10.0
SERVED_MODEL_NAME = "policy"
VLLM_LOG = Path("logs") / "vllm-server.log"


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
    if config.rollout.backend == "vllm":
        yield ActingPolicy(load_vllm_policy(config, folder, step))
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
    model, tokenizer = load_causal_lm(policy_model_ref(config, checkpoint), torch_dtype(config))
    version = 0 if checkpoint is None else checkpoint.policy_version
    # A batch forms once every open episode is waiting for its next action; the window
    # only matters when an environment step is slow. Batches then have the same members
    # on every run, so a replayed chunk reproduces its logprobs bit for bit (the padded
    # shape of a batch changes the floating-point sums).
    return TransformersPolicy(
        model, tokenizer, _sampling_settings(config), version=version, batch_window_s=BATCH_WINDOW_S
    )


# ---------------------------------------------------------------- vLLM


@dataclass
class _Generator:
    """A vLLM policy kept across steps (it knows which adapter its servers hold)."""

    key: tuple[object, ...]
    policy: VLLMPolicy
    server: VLLMServer | None  # None: external servers


_GENERATOR: list[_Generator] = []  # at most one: see the module docstring


def load_vllm_policy(config: RunConfig, folder: RunFolder | None, step: int) -> Policy:
    """The step's vLLM policy, its servers holding the step's weights."""
    checkpoint = step_checkpoint(folder, step)
    ref = policy_model_ref(config, checkpoint)
    version = 0 if checkpoint is None else checkpoint.policy_version
    if config.rollout.base_urls:
        generator = _external_generator(config, ref)
    else:
        generator = _managed_generator(config, folder, ref)
    policy = generator.policy
    policy.settings = _sampling_settings(config)
    if ref.adapter is not None:
        policy.load_adapter(ref.adapter, version)
    else:
        policy.unload_adapter()
    policy.version = version
    return policy


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
    if _GENERATOR and _GENERATOR[0].key == key and _server_running(_GENERATOR[0]):
        return _GENERATOR[0]
    stop_vllm_generator()  # never two servers at once
    log = folder.root / VLLM_LOG if folder is not None else None
    server = VLLMServer(spec, log_path=log, startup_timeout_s=config.rollout.vllm_startup_timeout_s).start()
    policy = VLLMPolicy(
        [server.base_url], load_tokenizer(ref), _sampling_settings(config),
        served_model=spec.served_model_name, stop_token_ids=_stop_token_ids(Path(spec.model_dir)),
        max_lora_rank=spec.max_lora_rank if lora else None,
    )  # fmt: skip
    policy.connect(check_logprobs_mode=False)  # our flags: processed logprobs
    _GENERATOR.append(_Generator(key, policy, server))
    return _GENERATOR[0]


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
        rollout.base_urls, load_tokenizer(ref), _sampling_settings(config), served_model=served,
        stop_token_ids=_stop_token_ids(hf_model_folder(base_model_ref(config))),
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


def _stop_token_ids(model_dir: Path) -> list[int]:
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
