"""One training step's rollout, engine by engine: transformers, vLLM base, vLLM + LoRA adapter.

Each engine plays the same step through the rollout stage itself (``rollout_stage``, so
``open_policy`` builds the engine exactly as ``rollflow train`` does): the bundled tool-use
game on the bundled SmolLM2, 8 tasks x 8 episodes, 6 turns, the same seeds. Printed per
engine: wall time, generated tokens/s, episodes per minute, prefill tokens sent, and for
vLLM the server's own prefill / decode seconds (summed over requests, from ``/metrics``).

- ``transformers``: the in-process backend (``[rollout].backend = "transformers"``), which
  keeps each episode's KV cache between turns (``SamplingSettings.kv_reuse``, the default);
  ``transformers-no-kv-reuse`` re-prefills the whole transcript every turn, as it used to.
- ``vllm``: a managed vLLM server on the base model (step 0).
- ``vllm+lora``: the same server with a fresh rank-16 LoRA adapter on q/k/v/o loaded as
  step 1's checkpoint (peft's default init: the outputs equal the base model's, the cost is
  the adapter's).

The server start is not counted (printed apart): a training run pays it once.

    .venv/bin/python bench/rollout_bench.py [--tiny] [--engines transformers,vllm,vllm+lora]

``--tiny`` swaps in a 2-layer test model and 2 tasks x 2 episodes x 2 turns, to check the
script itself. No timed assertions: the figures are for the README.

Measured 2026-12-01 on the 2-core machine, quiet except for the last leg (another vLLM
test ran beside it), 15 min. The no-KV-reuse leg ran with an idle vLLM server started
(the script's backend check then said "vllm" for it; its figures are the transformers
engine's, and its server columns meant nothing):

    | engine | wall s | generated tokens/s | episodes/min | generated | prompt tokens sent |
    | transformers | 102.0 | 32.7 | 37.6 | 3340 | 36205 |
    | transformers-no-kv-reuse | 133.9 | 24.9 | 28.7 | 3340 | 36205 |
    | vllm | 59.7 | 51.2 | 64.3 | 3060 | 36066 |
    | vllm+lora | 517.1 | 5.8 | 7.4 | 3004 | 36161 |

Again on 2026-12-01 (a later session, AVX2 machine, quiet, one run, server start 36.4 s):

    | engine | wall s | generated tokens/s | episodes/min | generated | prompt tokens sent |
    | transformers | 93.9 | 35.6 | 40.9 | 3340 | 36205 |
    | vllm | 56.7 | 53.9 | 67.7 | 3060 | 36066 |
    | vllm+lora | 127.8 | 23.5 | 30.0 | 3004 | 36161 |

The first run's vllm+lora figure (517 s) was the overlap with another vLLM test, not the
engine.

("prompt tokens sent" counts each action's new context tokens, the same for both
transformers legs; what KV reuse saves is the re-prefill of earlier ones.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from rollflow.policy.models import ModelRef, build_tiny_model, hf_model_folder
from rollflow.policy.transformers_backend import TransformersPolicy
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import table_to_episode_records
from rollflow.tasks import policy_io
from rollflow.tasks.config import ModelConfig, RolloutConfig, RunConfig, TrainConfig, ValidationConfig
from rollflow.tasks.rollout import rollout_stage

_METRIC = re.compile(r"^(vllm:request_(?:prefill|decode)_time_seconds)_sum\{[^}]*\} ([0-9.e+-]+)$", re.M)


@dataclass(frozen=True)
class EngineResult:
    engine: str
    wall_s: float
    episodes: int
    generated_tokens: int
    prompt_tokens: int
    prefill_s: float | None
    decode_s: float | None

    def row(self) -> str:
        rate = self.generated_tokens / self.wall_s
        per_min = self.episodes / self.wall_s * 60
        split = "n/a" if self.prefill_s is None else f"{self.prefill_s:.1f} / {self.decode_s:.1f}"
        return (f"| {self.engine} | {self.wall_s:.1f} | {rate:.1f} | {per_min:.1f} | "
                f"{self.generated_tokens} | {self.prompt_tokens} | {split} |")  # fmt: skip


def bench_config(model_path: str | None, tiny: bool, backend: str) -> RunConfig:
    rollout = RolloutConfig(
        batch_size=2 if tiny else 8, episodes_per_task=2 if tiny else 8, max_turns=2 if tiny else 6,
        max_model_length=1536, max_completion_tokens=16 if tiny else 64, concurrency=4 if tiny else 64,
        backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip
    return RunConfig(
        model=ModelConfig(path=model_path),
        rollout=rollout,
        train=TrainConfig(lora_rank=4 if tiny else 16, lora_alpha=8.0 if tiny else 32.0),
        validation=ValidationConfig(validation_interval=0),
    )


def fresh_adapter_checkpoint(config: RunConfig, folder: RunFolder) -> None:
    """Step 0's checkpoint: a fresh LoRA adapter (version 1), so that step 1 acts with it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = hf_model_folder(ModelRef(path=config.model.path))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    lora = LoraConfig(r=config.train.lora_rank, lora_alpha=config.train.lora_alpha,
                      target_modules=list(config.train.lora_target_modules))  # fmt: skip
    tmp = folder.new_checkpoint_tmp(0)
    get_peft_model(model, lora).save_pretrained(str(tmp))
    (tmp / "version.json").write_text(json.dumps({"policy_version": 1, "step": 0, "use_lora": True}))
    folder.commit_checkpoint(tmp, 0)


def server_times() -> tuple[float, float] | None:
    """Summed prefill and decode seconds of the managed server's requests so far."""
    generator = policy_io._GENERATOR[0] if policy_io._GENERATOR else None
    if generator is None or generator.server is None:
        return None
    text = httpx.get(generator.server.base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    sums = {name: float(value) for name, value in _METRIC.findall(text)}
    return sums.get("vllm:request_prefill_time_seconds", 0.0), sums.get("vllm:request_decode_time_seconds", 0.0)


def run_engine(engine: str, model_path: str | None, tiny: bool, workdir: Path) -> EngineResult:
    backend = "transformers" if engine.startswith("transformers") else "vllm"
    config = bench_config(model_path, tiny, backend)
    run_dir = workdir / engine.replace("+", "-")
    step = 0
    if engine == "vllm+lora":
        fresh_adapter_checkpoint(config, RunFolder(run_dir))
        step = 1
    if backend == "vllm" and not policy_io._GENERATOR:  # start the server outside the timing
        started = time.monotonic()
        policy_io.load_vllm_policy(config, None, 0)
        print(f"vLLM server start: {time.monotonic() - started:.1f} s", file=sys.stderr)
    given: TransformersPolicy | None = None
    if engine == "transformers-no-kv-reuse":
        given = policy_io.load_transformers_policy(config, None, 0)
        assert isinstance(given, TransformersPolicy)
        given.settings = dataclasses.replace(given.settings, kv_reuse=False)
    before = server_times() if backend == "vllm" else None
    started = time.monotonic()
    rollout_stage(config, run_dir, step, policy=given)
    wall_s = time.monotonic() - started
    after = server_times() if backend == "vllm" else None
    episodes = table_to_episode_records(RunFolder(run_dir).read_stage(step, "episodes"))
    actions = [a for e in episodes for a in e.rollout.actions]
    prefill = decode = None
    if before is not None and after is not None:
        prefill, decode = after[0] - before[0], after[1] - before[1]
    return EngineResult(
        engine, wall_s, len(episodes), sum(len(a.token_ids) for a in actions),
        sum(len(a.prompt_delta_ids) for a in actions), prefill, decode,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer test model: check the script")
    parser.add_argument("--engines", default="transformers,transformers-no-kv-reuse,vllm,vllm+lora")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    model_path = None
    if args.tiny:  # vLLM's CPU attention needs heads of at least 32
        model_path = str(build_tiny_model(workdir / "tiny-model", hidden_size=64, num_heads=2))
    results = []
    try:
        for engine in args.engines.split(","):
            results.append(run_engine(engine, model_path, args.tiny, workdir))
            print(results[-1].row(), file=sys.stderr)
    finally:
        policy_io.stop_vllm_generator()
        shutil.rmtree(workdir, ignore_errors=True)
    print("| engine | wall s | generated tokens/s | episodes/min | generated | prompt tokens sent | vLLM prefill / decode s |")
    print("|---|---|---|---|---|---|---|")
    for result in results:
        print(result.row())


if __name__ == "__main__":
    main()
