"""What the capture endpoint adds to a step's sampling: the bundled tool-use game played
natively against the same game played by an unmodified openai-SDK agent through it.

Two legs (issue 60's goal: the endpoint adds under 5% to a step's sampling time):

- ``native``: the game (``rollflow.envs.tool_use_game``, with its worked example) played
  by rollflow's own episode loop;
- ``endpoint``: the example agent (``rollflow.envs.openai_agent_example``, as
  ``configs/openai_agent.toml`` names it) playing the same game, every call going through
  the ``openai`` client, HTTP and the capture endpoint (``rollflow.envs.openai_agent``).

Both play step 0's train rollout through the rollout stage itself, on the same policy
backend and model (``--backend``, ``--model``: the 2-layer test model by default, to check
the script; ``bundled`` for SmolLM2-135M), the same tasks (same ids, same step seed: the
summary says whether they matched), the same sampling seeds, groups, episodes per task,
turns and completion budget. The opening prompts render to the same tokens (a test of
``test_envs_openai_agent`` holds that), but the replies diverge once a sample does, so
the legs need not sample the same number of tokens: compare per sampled token as well as
per step.

Each leg runs in a fresh process of its own (``--leg``): load the model (or start a
managed vLLM server), play an untimed warm-up round (one group of another task), then the
timed round. Rounds alternate the legs' order (native first, then endpoint first, ...),
and per-round ratios pair each endpoint run with the native run of its round.

The endpoint's own time per call is separated by timing three nested spans of each call
(in the leg's process, by wrapping, not by editing the code they time): the agent's
``chat.completions.create`` (round trip), ``AgentEpisode.complete`` (the handler, after
HTTP) and the policy session's ``act`` (sampling, in both legs). Handler minus act is the
endpoint's own work (request parsing, message rendering, recording); round trip minus
handler is HTTP and the SDK. With episodes played concurrently on one event loop, both
include waiting for the loop while other episodes run. The wrappers cost microseconds.

Simplified: one step, no training, and the 1-minute load average beside each run as the
only account of other load; on a busy machine read the figures with it. No timed
assertions: the figures are for the README.

    .venv/bin/python bench/agent_endpoint_bench.py [--model bundled] [--groups 4 --episodes 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the parent process imports neither torch nor rollflow's stages
    from rollflow.config.run import RunConfig

REPO = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "agent-endpoint-bench-result "
LEGS = ("native", "endpoint")
EXAMPLE = "rollflow.envs.openai_agent_example"
AGENT_MAX_STEPS = 6  # the example agent's own MAX_STEPS: it stops there whatever rollflow allows
NOTE = ("note: the legs render the same opening prompts but sample different replies, so they "
        "need not sample the same tokens: compare per sampled token as well as per step")  # fmt: skip


@dataclass(frozen=True)
class Size:
    """What every leg plays: the same for both legs of a run."""

    model: str = "tiny"  # "tiny": a 2-layer test model; "bundled": SmolLM2-135M
    backend: str = "transformers"
    groups: int = 2
    episodes: int = 2
    max_turns: int = 2
    max_tokens: int = 16
    concurrency: int = 8


@dataclass(frozen=True)
class LegResult:
    leg: str
    round: int
    wall_s: float  # the step's rollout stage
    cpu_s: float  # this process's CPU time during it (a vLLM server's is not in it)
    episodes: int
    errors: int
    actions: int  # sampled actions, all episodes
    sampled_tokens: int
    task_ids: tuple[str, ...]
    first_actions: tuple[str, ...]  # sorted "episode id: hash(first action's tokens)": ints hash alike anywhere
    act_s: tuple[float, ...]  # each call of a session's act
    round_trip_s: tuple[float, ...] = ()  # endpoint leg, one per agent call, paired with the two below
    handler_s: tuple[float, ...] = ()
    handler_act_s: tuple[float, ...] = ()  # the act inside each handled call (0: refused)
    server_s: float = 0.0  # the endpoint's server starts and stops, summed
    batch_sizes: tuple[int, ...] = ()  # transformers engine: rows of each batch it ran, in order
    prefill_s: float | None = None  # transformers engine: its batches' prefill and decode, summed
    decode_s: float | None = None
    load_start: float = 0.0  # 1-minute load average
    load_end: float = 0.0

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.wall_s

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.wall_s / max(self.sampled_tokens, 1)

    def row(self) -> str:
        return (f"| {self.leg} | {self.round} | {self.wall_s:.2f} | {self.episodes_per_s:.2f} | {self.actions} | "
                f"{self.sampled_tokens} | {self.ms_per_token:.2f} | {_median_ms(self.act_s)} | "
                f"{self.cpu_s:.1f} | {self.batches()} | {self.errors} | {self.load_start:.2f} -> {self.load_end:.2f} |")  # fmt: skip

    def batches(self) -> str:
        """How the engine batched the step: the batches' count, rows, prefill / decode s."""
        if self.prefill_s is None or self.decode_s is None:
            return "n/a"
        rows = ",".join(map(str, self.batch_sizes[:8])) + (",..." if len(self.batch_sizes) > 8 else "")
        return f"{len(self.batch_sizes)}: {rows}; {self.prefill_s:.1f} / {self.decode_s:.1f} s"


ROW_HEADER = (
    "| leg | round | rollout wall s | episodes/s | actions | sampled tokens | ms / sampled token | "
    "act ms/call, median | process CPU s | engine batches: rows; prefill / decode s | episode errors | "
    "load start -> end |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _median_ms(values: Sequence[float]) -> str:
    return f"{1000 * statistics.median(values):.1f}" if values else "n/a"


# ---------------------------------------------------------------- one leg, in its own process


def leg_env(leg: str, max_turns: int) -> tuple[str, dict[str, Any]]:
    """The leg's ``[env]`` name and kwargs: the game, or the example agent playing it."""
    if leg == "native":
        return "rollflow.envs.tool_use_game:load_environment", {"worked_example": True, "max_turns": max_turns}
    return "rollflow.envs.openai_agent:load_environment", {
        "agent": f"{EXAMPLE}.agent:run", "tasks": f"{EXAMPLE}.game:tasks", "reward": f"{EXAMPLE}.game:reward",
        "max_calls": max_turns,
    }  # fmt: skip


def bench_config(leg: str, size: Size, model_path: str | None) -> RunConfig:
    from rollflow.config.rollout import RolloutConfig
    from rollflow.config.run import EnvConfig, ModelConfig, RunConfig, ValidationConfig
    from rollflow.config.train import TrainConfig

    name, kwargs = leg_env(leg, size.max_turns)
    rollout = RolloutConfig(
        batch_size=size.groups, episodes_per_task=size.episodes, max_turns=size.max_turns, max_model_length=2048,
        max_completion_tokens=size.max_tokens, concurrency=size.concurrency, backend=size.backend,  # type: ignore[arg-type]
    )  # fmt: skip
    return RunConfig(
        model=ModelConfig(path=model_path, dtype="float32"), env=EnvConfig(name=name, kwargs=kwargs), rollout=rollout,
        train=TrainConfig(seed=0), validation=ValidationConfig(validation_interval=0),
    )  # fmt: skip


def warmup_config(config: RunConfig) -> RunConfig:
    """One group of another task (another seed draws it): untimed."""
    return dataclasses.replace(
        config, rollout=dataclasses.replace(config.rollout, batch_size=1),
        train=dataclasses.replace(config.train, seed=config.train.seed + 1),
    )  # fmt: skip


@dataclass
class CallTimes:
    """The timed spans of one leg's calls (see the module docstring)."""

    act_s: list[float] = field(default_factory=list)
    handled: list[tuple[str, float, float]] = field(default_factory=list)  # (episode key, handler s, its act s)
    round_trips: list[tuple[str, float]] = field(default_factory=list)  # (episode key, round trip s)
    server_s: list[float] = field(default_factory=list)  # each start and each stop of the endpoint's server


_ACT_IN_CALL: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("act_in_call", default=None)


def _timed(call: Callable[..., Any], record: Callable[[Any, float], None]) -> Callable[..., Any]:
    """``call`` (a coroutine function) with its wall time passed to ``record(first arg, s)``."""

    async def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            record(args[0] if args else None, time.perf_counter() - start)

    return timed


def time_sessions(policy: Any, times: CallTimes) -> None:
    """Time every ``act`` of the sessions ``policy`` opens from now on."""
    open_session = policy.open_session

    def record(_: Any, seconds: float) -> None:
        times.act_s.append(seconds)
        if (inside := _ACT_IN_CALL.get()) is not None:  # the endpoint's handler is waiting on it
            inside.append(seconds)

    def timed_open_session(tool_specs: Any) -> Any:
        session = open_session(tool_specs)
        session.act = _timed(session.act, record)
        return session

    policy.open_session = timed_open_session


@contextmanager
def timing_the_endpoint(times: CallTimes) -> Iterator[None]:
    """Time each agent call's round trip and the endpoint's handling of it, by episode key."""
    from openai.resources.chat.completions import AsyncCompletions

    from rollflow.envs.openai_agent_endpoint import AgentEpisode, CaptureEndpoint

    complete, create = AgentEpisode.complete, AsyncCompletions.create
    start, stop = CaptureEndpoint.start, CaptureEndpoint.stop

    async def timed_complete(episode: AgentEpisode, body: object) -> Any:
        inside = _ACT_IN_CALL.set([])
        start = time.perf_counter()
        try:
            return await complete(episode, body)
        finally:
            times.handled.append((episode.key, time.perf_counter() - start, sum(_ACT_IN_CALL.get() or ())))
            _ACT_IN_CALL.reset(inside)

    def record_round_trip(resource: Any, seconds: float) -> None:
        times.round_trips.append((str(resource._client.api_key), seconds))

    def record_server(_: Any, seconds: float) -> None:
        times.server_s.append(seconds)

    AgentEpisode.complete = timed_complete  # type: ignore[method-assign]
    AsyncCompletions.create = _timed(create, record_round_trip)  # type: ignore[method-assign]
    CaptureEndpoint.start, CaptureEndpoint.stop = _timed(start, record_server), _timed(stop, record_server)  # type: ignore[method-assign]
    try:
        yield
    finally:
        AgentEpisode.complete, AsyncCompletions.create = complete, create  # type: ignore[method-assign]
        CaptureEndpoint.start, CaptureEndpoint.stop = start, stop  # type: ignore[method-assign]


def paired_calls(times: CallTimes) -> list[tuple[float, float, float]]:
    """(round trip, handler, act) per agent call: an episode's calls are sequential, so its
    n-th round trip is its n-th handled call."""
    by_key: dict[str, list[tuple[float, float]]] = {}
    for key, handler_s, act_s in times.handled:
        by_key.setdefault(key, []).append((handler_s, act_s))
    calls = []
    for key, round_trip_s in times.round_trips:
        handled = by_key.get(key)
        if not handled:
            raise AssertionError(f"a call of episode key ...{key[-6:]} came back without being handled")
        calls.append((round_trip_s, *handled.pop(0)))
    left = sum(len(v) for v in by_key.values())
    assert left == 0, f"{left} handled calls have no round trip"
    return calls


def run_leg(leg: str, size: Size, round_number: int, workdir: Path) -> LegResult:
    from rollflow.generators.policy_io import acting_policy
    from rollflow.generators.run_generator import open_generator
    from rollflow.policy.models import build_tiny_model
    from rollflow.storage.runfolder import RunFolder
    from rollflow.storage.schemas import table_to_episode_records
    from rollflow.tasks.rollout import rollout_stage

    model_path = str(build_tiny_model(workdir / "tiny-model")) if size.model == "tiny" else None
    config = bench_config(leg, size, model_path)
    warm_dir, step_dir = workdir / "warm-up", workdir / "step"
    times = CallTimes()
    with open_generator(config, RunFolder(step_dir), versions_in_flight=1) as engine:  # a vLLM one starts here
        rollout_stage(warmup_config(config), RunFolder(warm_dir).step_paths(0).episodes, 0, "train",
                      acting_policy(config, engine, None))  # fmt: skip
        reset_prefix_cache(engine)  # the warm-up's prompts leave nothing for the step to hit
        acting = acting_policy(config, engine, None)
        time_sessions(acting.policy, times)
        stats = batch_counters(acting.policy)
        first_batch = len(stats.batches) if stats is not None else 0
        with timing_the_endpoint(times) if leg == "endpoint" else contextlib.nullcontext():
            cpu, started = time.process_time(), time.perf_counter()
            rollout_stage(config, RunFolder(step_dir).step_paths(0).episodes, 0, "train", acting)
            wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    reports = stats.batches[first_batch:] if stats is not None else []
    episodes = table_to_episode_records(RunFolder(step_dir).read_stage(0, "episodes"))
    actions = [a for e in episodes for a in e.rollout.actions]
    calls = paired_calls(times) if leg == "endpoint" else []
    return LegResult(
        leg=leg, round=round_number, wall_s=wall_s, cpu_s=cpu_s, episodes=len(episodes),
        errors=sum(e.rollout.error is not None for e in episodes), actions=len(actions),
        sampled_tokens=sum(len(a.token_ids) for a in actions), task_ids=tuple(sorted({e.task_id for e in episodes})),
        first_actions=tuple(sorted(f"{e.episode_id}: {hash(e.rollout.actions[0].token_ids)}"
                                   for e in episodes if e.rollout.actions)),  # fmt: skip
        act_s=tuple(times.act_s), round_trip_s=tuple(c[0] for c in calls), handler_s=tuple(c[1] for c in calls),
        handler_act_s=tuple(c[2] for c in calls), server_s=sum(times.server_s),
        batch_sizes=tuple(stats.batch_sizes[first_batch:]) if stats is not None else (),
        prefill_s=sum(b.prefill_s for b in reports) if stats is not None else None,
        decode_s=sum(b.decode_s for b in reports) if stats is not None else None,
    )  # fmt: skip


def batch_counters(policy: object) -> Any:
    """The transformers engine's batch counters (``.batches``, ``.batch_sizes``), or None: a
    vLLM policy's ``stats`` count requests and tokens, not the server's batches."""
    stats = getattr(policy, "stats", None)
    return stats if hasattr(stats, "batches") and hasattr(stats, "batch_sizes") else None


def reset_prefix_cache(engine: object) -> None:
    from rollflow.policy.vllm_admin import reset_prefix_cache as reset

    for server in getattr(engine, "servers", None) or ():
        reset(server.base_url.removesuffix("/v1"))


# ---------------------------------------------------------------- the legs, round by round


def leg_order(rounds: int) -> list[tuple[int, str]]:
    """Every leg once a round, the order alternating: native first in odd rounds."""
    return [(number, leg) for number in range(1, rounds + 1) for leg in (LEGS if number % 2 else LEGS[::-1])]


def size_arguments(size: Size) -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in dataclasses.asdict(size).items()]


def run_leg_process(leg: str, size: Size, round_number: int) -> LegResult:
    """``leg`` in a fresh process of its own; its result with the load average around it."""
    load_start = os.getloadavg()[0]
    command = [sys.executable, str(Path(__file__).resolve()), "--leg", leg, "--round", str(round_number)]
    done = subprocess.run(command + size_arguments(size), capture_output=True, text=True, cwd=REPO, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"leg {leg} failed (exit status {done.returncode}); its output:\n"
                           f"{done.stdout[-1500:]}{done.stderr[-2500:]}")  # fmt: skip
    fields = json.loads(lines[-1].removeprefix(RESULT_PREFIX))
    result = LegResult(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    return dataclasses.replace(result, load_start=load_start, load_end=os.getloadavg()[0])


def spread(values: Sequence[float], unit: str = "", digits: int = 2) -> str:
    return (f"{statistics.median(values):.{digits}f}{unit} "
            f"({min(values):.{digits}f}{unit} to {max(values):.{digits}f}{unit})")  # fmt: skip


def summary(results: Sequence[LegResult]) -> str:
    """Per leg: median (min to max) over its runs."""
    lines = [
        "| leg | runs | rollout wall s | episodes/s | sampled tokens | ms / sampled token | act ms/call, median "
        + "| episode errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for leg in LEGS:
        runs = [r for r in results if r.leg == leg]
        if runs:
            lines.append(
                f"| {leg} | {len(runs)} | {spread([r.wall_s for r in runs])} | "
                f"{spread([r.episodes_per_s for r in runs])} | "
                f"{spread([r.sampled_tokens for r in runs], digits=0)} | {spread([r.ms_per_token for r in runs])} | "
                f"{_median_ms([s for r in runs for s in r.act_s])} | {sum(r.errors for r in runs)} |"
            )  # fmt: skip
    return "\n".join(lines)


def overhead(results: Sequence[LegResult]) -> list[str]:
    """The endpoint leg over the native leg of the same round, per step and per sampled token."""
    by_round = {(r.round, r.leg): r for r in results}
    rounds = sorted(n for n, leg in by_round if leg == "native" and (n, "endpoint") in by_round)
    pairs = [(by_round[(n, "native")], by_round[(n, "endpoint")]) for n in rounds]
    if not pairs:
        return ["overhead: no round has both legs"]
    per_step = [100 * (e.wall_s / n.wall_s - 1) for n, e in pairs]
    per_token = [100 * (e.ms_per_token / n.ms_per_token - 1) for n, e in pairs]
    tasks = {r.task_ids for r in results}
    alike = [len(set(n.first_actions) & set(e.first_actions)) for n, e in pairs]
    return [
        f"endpoint over native, per step (rollout wall): {spread(per_step, '%', 1)}, {len(pairs)} paired rounds",
        f"endpoint over native, per sampled token: {spread(per_token, '%', 1)}",
        f"same tasks in every run: {'yes' if len(tasks) == 1 else 'NO: ' + ' / '.join(','.join(t) for t in tasks)}",
        f"episodes whose first action both legs sampled alike (same prompt, same seed): {min(alike)} to {max(alike)} "
        f"of {pairs[0][0].episodes} a round",
        NOTE,
    ]


def per_call(results: Sequence[LegResult]) -> list[str]:
    """The endpoint leg's calls: the medians of their spans, and what they add up to per run."""
    runs = [r for r in results if r.leg == "endpoint" and r.round_trip_s]
    if not runs:
        return []
    calls = [c for r in runs for c in zip(r.round_trip_s, r.handler_s, r.handler_act_s, strict=True)]
    served = [c for c in calls if c[2] > 0]  # a refused call (the budget spent) samples nothing
    outside = [sum(rt - act for rt, _, act in zip(r.round_trip_s, r.handler_s, r.handler_act_s, strict=True))
               for r in runs]  # fmt: skip
    return [
        "| endpoint calls | calls | round trip ms | handler ms | act ms | endpoint's own ms (handler - act) "
        + "| HTTP + SDK ms (round trip - handler) |",
        "|---|---|---|---|---|---|---|",
        f"| sampled, median | {len(served)} | {_median_ms([c[0] for c in served])} | "
        f"{_median_ms([c[1] for c in served])} | "
        f"{_median_ms([c[2] for c in served])} | {_median_ms([c[1] - c[2] for c in served])} | "
        f"{_median_ms([c[0] - c[1] for c in served])} |",
        f"| refused, median | {len(calls) - len(served)} | {_median_ms([c[0] for c in calls if c[2] == 0])} | "
        f"{_median_ms([c[1] for c in calls if c[2] == 0])} | n/a | n/a | n/a |",
        f"time outside act summed over a run's calls (overlapping: episodes run at once): {spread(outside, ' s')}",
        f"the endpoint's server, started and stopped once a chunk: {spread([r.server_s for r in runs], ' s')} a run",
    ]  # fmt: skip


def check_size(parser: argparse.ArgumentParser, size: Size) -> None:
    if not 1 <= size.max_turns <= AGENT_MAX_STEPS:
        parser.error(f"--max-turns must be 1 to {AGENT_MAX_STEPS}: "
                     f"the example agent stops after {AGENT_MAX_STEPS} calls")  # fmt: skip
    if min(size.groups, size.episodes, size.max_tokens, size.concurrency) < 1:
        parser.error("--groups, --episodes, --max-tokens and --concurrency must be at least 1")
    vllm_python = os.environ.get("ROLLFLOW_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python"
    if size.backend == "vllm" and not Path(vllm_python).exists():
        parser.error(f"--backend vllm needs vLLM's Python at {vllm_python} (make vllm-setup)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "bundled"), default=Size.model)
    parser.add_argument("--backend", choices=("transformers", "vllm"), default=Size.backend)
    parser.add_argument("--groups", type=int, default=Size.groups, help="tasks in the step")
    parser.add_argument("--episodes", type=int, default=Size.episodes, help="episodes per task")
    parser.add_argument("--max-turns", type=int, default=Size.max_turns, help="calls per episode")
    parser.add_argument("--max-tokens", type=int, default=Size.max_tokens, help="max_completion_tokens")
    parser.add_argument("--concurrency", type=int, default=Size.concurrency, help="episodes played at once")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds, each leg once a round")
    parser.add_argument("--leg", choices=LEGS, help=argparse.SUPPRESS)  # run one leg here and print its result
    parser.add_argument("--round", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = Size(args.model, args.backend, args.groups, args.episodes, args.max_turns, args.max_tokens, args.concurrency)
    check_size(parser, size)
    if args.leg:
        workdir = Path(tempfile.mkdtemp(prefix="agent-endpoint-bench-"))
        try:
            result = run_leg(args.leg, size, args.round, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(RESULT_PREFIX + json.dumps(dataclasses.asdict(result)), flush=True)
        return 0
    load = os.getloadavg()[0]
    print(f"agent endpoint bench: {size}, {args.repeats} rounds, load {load:.2f} at the start", flush=True)
    print(ROW_HEADER, flush=True)
    results = []
    for number, leg in leg_order(args.repeats):
        try:
            results.append(run_leg_process(leg, size, number))
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
        print(results[-1].row(), flush=True)
    print()
    print(summary(results))
    print()
    print("\n".join(overhead(results) + [""] + per_call(results)))
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
