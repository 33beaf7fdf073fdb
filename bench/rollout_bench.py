"""One training step's rollout, engine by engine, each leg in a fresh process of its own.

Every leg plays the same step through the rollout stage itself (so the engine is built as
``rollflow train`` builds it): the bundled tool-use game on the bundled SmolLM2, 8 tasks x 8
episodes, 6 turns, the same seeds and the same tasks (step 0). A leg is a few settings
(``LEGS``):

- ``vllm``: a managed vLLM server, full weights (version 0, the base model);
  ``vllm-2-replicas`` the same on two managed servers, the cores dealt between them;
- ``vllm-lora-merged`` / ``vllm-lora-adapter``: a LoRA run's version 0, a fresh rank-16
  adapter on q/k/v/o as ``[model].adapter`` (peft's default init: the outputs equal the
  base model's, the cost is the adapter's), served as ``[rollout].lora_serving`` says:
  merged into the weights and reloaded in place, or as a vLLM LoRA adapter;
- ``transformers``: the in-process engine, which keeps each episode's KV cache between
  turns; ``transformers-lora`` the same with the adapter; ``transformers-no-kv-reuse``
  re-prefills the whole transcript every turn.

A leg whose setting this checkout's config does not have is skipped with a message.

Each leg runs in its own process (``--leg``), so that no server, warm-up or prefix cache
carries from one leg to the next: start the engine (a fresh vLLM server; not timed, a run
pays it once), play one untimed warm-up episode of one turn (another task, in another run
folder), reset the server's prefix cache, then publish version 0 (timed apart: the merge and
reload of a merged LoRA, an adapter load, the model load of the transformers engine) and
play the step (timed). Legs are repeated and interleaved (A B C D A B C D ...), and the
summary gives per leg the median and the min-max of the step's rollout seconds and
generated tokens/s. Beside each run: the 1-minute load average at its start and end, and
the CPU time other processes used during it (``others``, in cores: /proc/stat's busy time
less this leg's own processes'), which is what says whether a figure was taken on a quiet
machine.

    .venv/bin/python bench/rollout_bench.py [--repeats 3] [--legs vllm,vllm-lora-merged,...]

``--quick`` swaps in a 2-layer test model and 2 tasks x 2 episodes x 2 turns, to check the
script itself. No timed assertions: the figures are for the README.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the parent process imports neither torch nor rollflow's stages
    from rollflow.generators.generator import Generator
    from rollflow.generators.policy_io import ActingPolicy
    from rollflow.storage.runfolder import RunFolder
    from rollflow.config.run import RunConfig

REPO = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "rollout-bench-result "
DEFAULT_LEGS = ("vllm", "vllm-lora-merged", "vllm-lora-adapter", "transformers")
_METRIC = re.compile(r"^(vllm:request_(?:prefill|decode)_time_seconds)_sum\{[^}]*\} ([0-9.e+-]+)$", re.MULTILINE)


@dataclass(frozen=True)
class Leg:
    name: str
    backend: str
    lora: bool = False  # act with a fresh adapter ([model].adapter), trained as LoRA
    rollout: Mapping[str, object] = field(default_factory=dict)  # further [rollout] settings
    kv_reuse: bool = True  # transformers: keep each episode's KV cache between turns


LEGS = {
    leg.name: leg
    for leg in (
        Leg("vllm", "vllm"),
        Leg("vllm-lora-merged", "vllm", lora=True, rollout={"lora_serving": "merged"}),
        Leg("vllm-lora-adapter", "vllm", lora=True, rollout={"lora_serving": "adapter"}),
        Leg("vllm-2-replicas", "vllm", rollout={"num_generator_replicas": 2}),
        Leg("transformers", "transformers"),
        Leg("transformers-lora", "transformers", lora=True),
        Leg("transformers-no-kv-reuse", "transformers", kv_reuse=False),
    )
}


def missing_settings(leg: Leg) -> list[str]:
    """The leg's ``[rollout]`` settings this checkout's config does not have."""
    from rollflow.config.rollout import RolloutConfig

    known = {f.name for f in dataclasses.fields(RolloutConfig)}
    return [f"[rollout].{key}" for key in leg.rollout if key not in known]


@dataclass(frozen=True)
class LegResult:
    leg: str
    repeat: int
    rollout_s: float  # the step's rollout stage
    publish_s: float  # version 0 reaching the engine before it
    start_s: float  # engine start and warm-up, not timed in the step
    episodes: int
    generated_tokens: int
    prompt_tokens: int
    prefill_s: float | None  # vLLM's own, summed over the step's requests
    decode_s: float | None
    load_start: float = 0.0  # 1-minute load average
    load_end: float = 0.0
    others_cores: float = 0.0  # CPU used by other processes during the leg, in cores

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.rollout_s

    def row(self) -> str:
        split = "n/a" if self.prefill_s is None else f"{self.prefill_s:.1f} / {self.decode_s:.1f}"
        return (f"| {self.leg} | {self.repeat} | {self.rollout_s:.1f} | {self.tokens_per_s:.1f} | "
                f"{self.episodes / self.rollout_s * 60:.1f} | {self.publish_s:.1f} | {self.generated_tokens} | "
                f"{self.prompt_tokens} | {split} | {self.load_start:.2f} -> {self.load_end:.2f} | "
                f"{self.others_cores:.2f} |")  # fmt: skip


ROW_HEADER = (
    "| leg | repeat | rollout s | generated tokens/s | episodes/min | publish s | generated | "
    "prompt tokens sent | vLLM prefill / decode s | load start -> end | others (cores) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


# ---------------------------------------------------------------- one leg, in its own process
# Every call into the stages and generators is in this section (their signatures move).


def bench_config(leg: Leg, model_path: str | None, adapter: str | None, quick: bool) -> RunConfig:
    from rollflow.config.rollout import RolloutConfig
    from rollflow.config.run import ModelConfig, RunConfig, ValidationConfig
    from rollflow.config.train import TrainConfig

    rollout = RolloutConfig(
        batch_size=2 if quick else 8, episodes_per_task=2 if quick else 8, max_turns=2 if quick else 6,
        max_model_length=1536, max_completion_tokens=16 if quick else 64, concurrency=4 if quick else 64,
        backend=leg.backend, **leg.rollout,  # type: ignore[arg-type]
    )  # fmt: skip
    return RunConfig(
        model=ModelConfig(path=model_path, adapter=adapter if leg.lora else None),
        rollout=rollout,
        train=TrainConfig(use_lora=leg.lora, lora_rank=4 if quick else 16, lora_alpha=8.0 if quick else 32.0),
        validation=ValidationConfig(validation_interval=0),
    )


def warmup_config(config: RunConfig) -> RunConfig:
    """One episode of one short turn, on another task (another seed draws it)."""
    rollout = dataclasses.replace(config.rollout, batch_size=1, episodes_per_task=1, max_turns=1,
                                  max_completion_tokens=8)  # fmt: skip
    return dataclasses.replace(config, rollout=rollout, train=dataclasses.replace(config.train, seed=config.train.seed + 1))


def fresh_adapter(model_path: str | None, rank: int, alpha: float, dest: Path) -> str:
    """A fresh LoRA adapter on q/k/v/o (B = 0: it acts as the base model) saved at ``dest``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rollflow.policy.models import ModelRef, hf_model_folder

    folder = hf_model_folder(ModelRef(path=model_path))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    get_peft_model(model, lora).save_pretrained(str(dest))
    return str(dest)


@contextmanager
def open_engine(config: RunConfig, folder: RunFolder) -> Iterator[Generator]:
    """The leg's generator (a vLLM one started here, or the in-process one), lent while
    open, so that opening it again for the step's own folder finds the warm server."""
    from rollflow.generators.lending import lend
    from rollflow.generators.run_generator import open_generator
    from rollflow.generators.vllm_generator import VLLMGenerator

    with open_generator(config, folder, versions_in_flight=1) as engine:
        if isinstance(engine, VLLMGenerator):
            with lend(engine):
                yield engine
        else:
            yield engine


def play(config: RunConfig, run_dir: Path, acting: ActingPolicy) -> Path:
    """Step 0's train rollout of ``run_dir``, acting with ``acting``."""
    from rollflow.storage.runfolder import RunFolder
    from rollflow.tasks.rollout import rollout_stage

    return rollout_stage(config, RunFolder(run_dir).step_paths(0).episodes, 0, "train", acting)


def step_episodes(run_dir: Path) -> list[Any]:
    from rollflow.storage.runfolder import RunFolder
    from rollflow.storage.schemas import table_to_episode_records

    return table_to_episode_records(RunFolder(run_dir).read_stage(0, "episodes"))


def server_times(engine: object) -> tuple[float, float] | None:
    """Summed prefill and decode seconds of the managed servers' requests so far."""
    import httpx

    servers = getattr(engine, "servers", None)
    if not servers:
        return None
    prefill = decode = 0.0
    for server in servers:
        text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=30).text
        sums = {name: float(value) for name, value in _METRIC.findall(text)}
        prefill += sums.get("vllm:request_prefill_time_seconds", 0.0)
        decode += sums.get("vllm:request_decode_time_seconds", 0.0)
    return prefill, decode


def reset_prefix_cache(engine: object) -> None:
    from rollflow.policy.vllm_admin import reset_prefix_cache as reset

    for server in getattr(engine, "servers", None) or ():
        reset(server.base_url.removesuffix("/v1"))


def run_leg(leg: Leg, workdir: Path, quick: bool, repeat: int) -> LegResult:
    from rollflow.generators.policy_io import ActingPolicy, acting_policy
    from rollflow.generators.run_generator import open_generator
    from rollflow.policy.models import build_tiny_model
    from rollflow.storage.runfolder import RunFolder

    model_path = None
    if quick:  # vLLM's CPU attention needs heads of at least 32
        model_path = str(build_tiny_model(workdir / "tiny-model", hidden_size=64, num_heads=2))
    adapter = None
    if leg.lora:
        adapter = fresh_adapter(model_path, 4 if quick else 16, 8.0 if quick else 32.0, workdir / "adapter")
    config = bench_config(leg, model_path, adapter, quick)
    warm_dir, step_dir = workdir / "warm-up", workdir / "step"
    started = time.monotonic()
    with open_engine(config, RunFolder(warm_dir)) as engine:
        play(warmup_config(config), warm_dir, acting_policy(warmup_config(config), engine, None))
        reset_prefix_cache(engine)  # the warm-up's prompts leave nothing for the step to hit
        start_s = time.monotonic() - started
        started = time.monotonic()
        with open_generator(config, RunFolder(step_dir), versions_in_flight=1) as engine:  # the lent one, for vLLM
            policy = engine.policy_for(0, None)  # version 0: base, or base + [model].adapter
            publish_s = time.monotonic() - started
            acting = acting_policy(config, engine, None)  # version 0
            if leg.backend == "transformers":
                policy.settings = dataclasses.replace(policy.settings, kv_reuse=leg.kv_reuse)
                acting = ActingPolicy.fixed(policy)
            before = server_times(engine)
            started = time.monotonic()
            play(config, step_dir, acting)
            rollout_s = time.monotonic() - started
            after = server_times(engine)
    episodes = step_episodes(step_dir)
    actions = [a for e in episodes for a in e.rollout.actions]
    split = (after[0] - before[0], after[1] - before[1]) if before and after else (None, None)
    return LegResult(
        leg.name, repeat, rollout_s, publish_s, start_s, len(episodes), sum(len(a.token_ids) for a in actions),
        sum(len(a.prompt_delta_ids) for a in actions), *split,
    )  # fmt: skip


# ---------------------------------------------------------------- the legs, interleaved


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (every core), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_leg_process(leg: Leg, quick: bool, repeat: int, stderr: int | None = None) -> LegResult:
    """``leg`` in a fresh process of its own; its result with the machine's load around it."""
    load_start, busy, ours, started = os.getloadavg()[0], busy_seconds(), children_cpu_seconds(), time.monotonic()
    command = [sys.executable, str(Path(__file__).resolve()), "--leg", leg.name, "--repeat", str(repeat)]
    done = subprocess.run(command + (["--quick"] if quick else []), stdout=subprocess.PIPE, stderr=stderr,
                          text=True, cwd=REPO, check=False)  # fmt: skip
    wall = time.monotonic() - started
    others = max(0.0, (busy_seconds() - busy) - (children_cpu_seconds() - ours)) / wall
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"leg {leg.name} failed (exit status {done.returncode}); its output:\n{done.stdout[-2000:]}")
    result = LegResult(**json.loads(lines[-1].removeprefix(RESULT_PREFIX)))
    return dataclasses.replace(result, load_start=load_start, load_end=os.getloadavg()[0], others_cores=others)


def interleaved(legs: Sequence[Leg], repeats: int) -> list[tuple[int, Leg]]:
    """A B C A B C ...: every leg once per round, ``repeats`` rounds."""
    return [(repeat, leg) for repeat in range(1, repeats + 1) for leg in legs]


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def summary(results: Sequence[LegResult]) -> str:
    """Per leg, in first-run order: runs, median (min-max) of rollout s and tokens/s, and more."""
    lines = [
        "| leg | runs | rollout s, median (min-max) | generated tokens/s, median (min-max) | publish s, median "
        + "| load at starts, max | others (cores), max |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r.leg for r in results):
        runs = [r for r in results if r.leg == name]
        lines.append(
            f"| {name} | {len(runs)} | {spread([r.rollout_s for r in runs])} | {spread([r.tokens_per_s for r in runs])} | "
            f"{statistics.median(r.publish_s for r in runs):.1f} | {max(r.load_start for r in runs):.2f} | "
            f"{max(r.others_cores for r in runs):.2f} |"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", "--tiny", action="store_true", help="a 2-layer test model: check the script")
    parser.add_argument("--legs", default=",".join(DEFAULT_LEGS), help=f"from {', '.join(LEGS)}")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of interleaved legs")
    parser.add_argument("--leg", help=argparse.SUPPRESS)  # run one leg here and print its result
    parser.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.leg:
        workdir = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
        try:
            result = run_leg(LEGS[args.leg], workdir, args.quick, args.repeat)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(RESULT_PREFIX + json.dumps(dataclasses.asdict(result)), flush=True)
        return 0
    legs = []
    for name in args.legs.split(","):
        if name not in LEGS:
            parser.error(f"unknown leg {name!r}: choose from {', '.join(LEGS)}")
        if missing := missing_settings(LEGS[name]):
            print(f"skipping leg {name}: this checkout's config has no {', '.join(missing)}", file=sys.stderr)
            continue
        legs.append(LEGS[name])
    results: list[LegResult] = []
    failed: set[str] = set()
    print(ROW_HEADER, file=sys.stderr)
    for repeat, leg in interleaved(legs, args.repeats):
        if leg.name in failed:
            continue
        try:
            results.append(run_leg_process(leg, args.quick, repeat))
        except RuntimeError as error:  # the other legs still run
            print(f"{error}\nleg {leg.name}: no further runs", file=sys.stderr)
            failed.add(leg.name)
            continue
        print(results[-1].row(), file=sys.stderr, flush=True)
    print(ROW_HEADER)
    for result in results:
        print(result.row())
    print()
    print(summary(results))
    return 1 if failed or not results else 0


if __name__ == "__main__":
    raise SystemExit(main())
