"""Train the agent a user already has: an environment made of their ``openai``-SDK agent code.

``[env] name = "rollflow.envs.openai_agent:load_environment"`` with kwargs naming three
functions of the user's own module, as ``"module:function"``:

- ``agent``: ``async def run(task: dict, client: openai.AsyncOpenAI, model: str) -> Any``,
  the agent as it is. Its client's base URL and key are rollflow's capture endpoint
  (``rollflow.envs.openai_agent_endpoint``); a plain ``def`` gets a synchronous
  ``openai.OpenAI`` client and runs in a thread of its own.
- ``tasks``: ``def tasks(split: str) -> list[dict]`` (``"train"`` / ``"validation"``), each a
  JSON object; its ``"id"``, when given, is the task id (else a hash of the task).
- ``reward``: ``def reward(task: dict, result: Any, messages: list[dict]) -> float | dict``;
  a dict holds the total under ``"reward"`` (or ``"score"``), optionally a pass
  ``"threshold"``, and named components (numbers) under any other key, as other
  environments' scores do. It may be ``async``.

An episode: the endpoint registers the episode under its own key, the agent runs with a
client holding it, every call is sampled by the episode's one ``PolicySession`` (token in,
token out, as the native loop), and the episode's record is built as the native loop
builds it (``EpisodeTrace``): its actions' tokens, the last call's messages and reply as
the transcript, one ``step_metadata`` entry per call, and a last one holding the agent's
return value. So episodes land in the same Parquet tables and train unchanged.

Endings. The agent returned: terminated. A call past ``max_calls`` (capped by
``[rollout].max_turns``) or past the context budget: truncated (``max_turns`` /
``context_overflow``), as the native loop ends an episode that runs out of turns or
context; the agent's own reaction to the refusal does not change that. An error (with its
traceback for the step's ``errors.jsonl``): the agent raised, it returned while one of its
calls was still running, it spent more than ``agent_timeout_s`` (default: the run's
``generation_timeout_s``) outside the endpoint without returning, or the policy failed.

Scoring runs from the stored episode, as rescore does: ``result`` is the agent's return
value as JSON data (a value that is not JSON is given as its ``str``), ``None`` when
rollflow cut the episode short. ``system_prompt``, when given, is added to the system
message of every call (after the agent's own), for instructions the agent does not carry.

Expert. ``expert``, when given, names a fourth function, ``def expert(task: dict,
messages: list[dict], tools: list[dict]) -> dict``: the assistant message (``content``
and/or OpenAI ``tool_calls``) a strong model would answer the agent's call with. It is
only for ``rollflow sft``, which plays the agent against it for expert transcripts
(``rollflow.envs.openai_agent_expert``); training and evaluation never call it.

Tools. ``tool_format`` (default ``"auto"``) picks how the model is asked for calls
(``rollflow.envs.tool_formats``): ``"auto"`` reads the policy's chat template, and one
that renders ``tools=`` in a known family's syntax (``"hermes"``: Qwen2.5/3,
``"llama3_json"``: Llama 3.1+, ``"mistral"``) renders them and that family's parser reads
the replies, so the trained policy serves behind vLLM's own tool parser; a template that
ignores tools (SmolLM2, the bundled model), or a policy behind a server whose template is
not known here, gets rollflow's protocol in the system prompt (``"rollflow"``). Naming a
family forces it. See ``openai_agent_messages`` for what a request may ask.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollflow.envs.agent import Policy
from rollflow.envs.checks import require_int
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import (
    UNSCORED_EPISODE,
    EpisodeLimits,
    EpisodeScore,
    Style,
    TaskItem,
    checked_score,
    describe_error,
    error_score,
)
from rollflow.envs.hooks import check_split
from rollflow.envs.loop import Cleanup, EpisodeTrace, StageFailure, play_safely
from rollflow.envs.openai_agent_endpoint import MODEL_NAME, AgentEpisode, SharedEndpoint
from rollflow.envs.tool_formats import TOOL_FORMAT_CHOICES, chat_template_of, chosen_tool_format
from rollflow.envs.types import Split, Task

DEFAULT_AGENT_TIMEOUT_S = 600.0  # the run's default generation_timeout_s
RESULT_KEY = "agent_result"


@dataclass(frozen=True)
class AgentEnvironment:
    """The three resolved functions of an agent environment and its settings."""

    agent: Callable[..., Any]
    tasks: Callable[[str], Any]
    reward: Callable[..., Any]
    names: Mapping[str, str]  # "agent" / "tasks" / "reward" (/ "expert") -> "module:function"
    system_prompt: str | None = None
    max_calls: int = 10
    agent_timeout_s: float | None = None
    tool_format: str = "auto"  # one of TOOL_FORMAT_CHOICES
    expert: Callable[..., Any] | None = None  # for rollflow sft only (the module note)


def load_environment(
    agent: str,
    tasks: str,
    reward: str,
    system_prompt: str | None = None,
    max_calls: int = 10,
    agent_timeout_s: float | None = None,
    tool_format: str = "auto",
    expert: str | None = None,
) -> AgentEnvironment:
    """The environment of the agent, task and reward functions named ``"module:function"``
    (and the expert's, for SFT)."""
    require_int("max_calls", max_calls, minimum=1)
    if agent_timeout_s is not None and not (isinstance(agent_timeout_s, int | float) and agent_timeout_s > 0):
        raise ValueError(f"agent_timeout_s must be a positive number of seconds, got {agent_timeout_s!r}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise TypeError(f"system_prompt must be text, got {type(system_prompt).__name__}")
    if tool_format not in TOOL_FORMAT_CHOICES:
        raise ValueError(f"tool_format={tool_format!r} is not one of {', '.join(TOOL_FORMAT_CHOICES)}")
    if importlib.util.find_spec("openai") is None:
        raise ModuleNotFoundError("an agent environment hands its agent an openai client: pip install 'rollflow[agent]' (or openai)")
    names = {"agent": agent, "tasks": tasks, "reward": reward}
    functions = {role: _resolve(role, spec, arity) for (role, spec), arity in zip(names.items(), (3, 1, 3), strict=True)}
    if expert is not None:
        names["expert"] = expert
        functions["expert"] = _resolve("expert", expert, 3)
    return AgentEnvironment(
        agent=functions["agent"], tasks=functions["tasks"], reward=functions["reward"], names=names,
        system_prompt=system_prompt, max_calls=max_calls, agent_timeout_s=agent_timeout_s, tool_format=tool_format,
        expert=functions.get("expert"),
    )  # fmt: skip


class AgentEnvironmentHandle:
    """The episode runner's handle (``EnvironmentHandle``) for an ``AgentEnvironment``.

    Its style is "hook": like a hook environment it brings its own turn budget
    (``max_calls``), which ``[rollout].max_turns`` caps.
    """

    style: Style = "hook"

    def __init__(self, env: AgentEnvironment) -> None:
        if not isinstance(env, AgentEnvironment):
            raise TypeError(f"expected an AgentEnvironment, got {type(env).__name__}")
        self.env = env
        self._endpoint = SharedEndpoint()
        self._items: dict[str, tuple[TaskItem, ...]] = {}

    def tasks(self, split: Split) -> list[TaskItem]:
        """``tasks(split)`` as task items, read once per split per handle."""
        check_split(split)
        if split not in self._items:
            self._items[split] = _task_items(self.env.tasks(split), f"{self.env.names['tasks']}({split!r})")
        return list(self._items[split])

    async def play(self, item: TaskItem, policy: Policy, limits: EpisodeLimits) -> EpisodeRollout:
        trace = EpisodeTrace(policy)
        return await play_safely(trace, lambda cleanup: self._play(item, policy, limits, trace, cleanup))

    async def score(self, item: TaskItem, rollouts: Sequence[EpisodeRollout]) -> list[EpisodeScore]:
        return [await self._score(item, rollout) for rollout in rollouts]

    async def _play(
        self, item: TaskItem, policy: Policy, limits: EpisodeLimits, trace: EpisodeTrace, cleanup: Cleanup
    ) -> EpisodeRollout:
        trace.stage = "EpisodeLimits"
        budget = limits.turn_budget(self.env.max_calls)
        trace.stage = "tool_format"
        tool_format = chosen_tool_format(self.env.tool_format, chat_template_of(policy))
        settings = getattr(policy, "settings", None)
        trace.stage = "capture endpoint"
        async with self._endpoint.lease() as endpoint:
            episode = AgentEpisode(
                policy.open_session, trace, budget=budget, system_prompt=self.env.system_prompt,
                run_max_tokens=getattr(settings, "max_completion_tokens", None), tool_format=tool_format,
            )  # fmt: skip
            cleanup.add("PolicySession.close", episode.close_session)
            endpoint.register(episode)
            timeout_s = self.env.agent_timeout_s or getattr(settings, "generation_timeout_s", None)
            trace.stage = self.env.names["agent"]
            try:
                outcome = await run_agent(self.env.agent, _task_dict(item), endpoint.base_url, episode,
                                          timeout_s or DEFAULT_AGENT_TIMEOUT_S)  # fmt: skip
                still_running = episode.in_flight  # before the server's shutdown waits them out
            finally:
                episode.closed = True
        return self._finish(trace, episode, outcome, still_running)

    def _finish(
        self, trace: EpisodeTrace, episode: AgentEpisode, outcome: AgentOutcome, still_running: int
    ) -> EpisodeRollout:
        """The rollout, by the endings in the module docstring."""
        if episode.error is not None:
            return trace.finish(error=episode.error)
        where = self.env.names["agent"]
        if episode.cut is not None:  # rollflow ended it: the agent's reaction does not count
            trace.step_metadata.append({RESULT_KEY: None, "agent_after_cut": outcome.describe()})
            return trace.finish(cause=episode.cut, env_metrics=episode.metrics())
        if outcome.exception is not None:
            raise StageFailure(where, outcome.exception)
        if still_running:
            raise StageFailure(where, RuntimeError(
                f"the agent returned while {still_running} of its calls were still running"))  # fmt: skip
        result = json_result(outcome.result)
        trace.step_metadata.append({RESULT_KEY: result})
        if isinstance(result, str):
            trace.response_text = result
        return trace.finish(terminated=True, env_metrics=episode.metrics())

    async def _score(self, item: TaskItem, rollout: EpisodeRollout) -> EpisodeScore:
        if rollout.error is not None:
            return error_score(UNSCORED_EPISODE)
        where = self.env.names["reward"]
        try:
            result = next((m[RESULT_KEY] for m in reversed(rollout.step_metadata) if RESULT_KEY in m), None)
            arguments = (_task_dict(item), result, [dict(m) for m in rollout.messages])
            if inspect.iscoroutinefunction(self.env.reward):
                value = await self.env.reward(*arguments)
            else:
                value = await asyncio.to_thread(self.env.reward, *arguments)
            return episode_score(value, where)
        except Exception as exc:  # never raises: the episode carries its scorer's error
            return error_score(describe_error(exc, where))


def episode_score(value: object, where: str) -> EpisodeScore:
    """A reward function's answer as a score: a number, or a dict (the module docstring)."""
    if not isinstance(value, Mapping):
        return EpisodeScore(reward=checked_score(value, f"{where} result"), threshold=None)
    totals = [key for key in ("reward", "score") if key in value]
    if len(totals) != 1:
        raise ValueError(f"{where} returned a dict with {totals or 'neither'} of 'reward' / 'score'; it needs one")
    threshold = value.get("threshold")
    return EpisodeScore(
        reward=checked_score(value[totals[0]], f"{where} {totals[0]!r}"),
        threshold=None if threshold is None else checked_score(threshold, f"{where} 'threshold'"),
        components={
            str(name): checked_score(part, f"{where} component {name!r}")
            for name, part in value.items() if name not in ("reward", "score", "threshold")
        },
    )  # fmt: skip


def json_result(result: object) -> Any:
    """The agent's return value as JSON data (as stored and scored), else its ``str``."""
    try:
        return json.loads(json.dumps(result, allow_nan=False))
    except (TypeError, ValueError):
        return str(result)


# ---------------------------------------------------------------- running the agent


@dataclass(frozen=True)
class AgentOutcome:
    result: Any = None
    exception: BaseException | None = None

    def describe(self) -> str:
        if self.exception is not None:
            return f"raised {type(self.exception).__name__}: {self.exception}"[:500]
        return f"returned {json.dumps(json_result(self.result))[:200]}"


async def run_agent(
    agent: Callable[..., Any], task: dict[str, Any], base_url: str, episode: AgentEpisode, timeout_s: float
) -> AgentOutcome:
    """Run the agent on ``task`` with a client of ``episode``'s key; its outcome, never raising
    for the agent's sake. More than ``timeout_s`` spent outside the endpoint is a hang."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[AgentOutcome] = loop.create_future()
    if _is_async(agent):
        running = asyncio.ensure_future(_run_async(agent, task, base_url, episode.key, done))
    else:
        running = None
        _start_thread(agent, task, base_url, episode.key, done, loop)
    try:
        while not done.done():
            idle_s = episode.idle_s()
            if idle_s >= timeout_s:
                where = _where_it_is(running)
                return AgentOutcome(exception=TimeoutError(
                    f"the agent neither called the endpoint nor returned for {timeout_s:g} s "
                    f"(agent_timeout_s){where}"))  # fmt: skip
            await asyncio.wait({done}, timeout=timeout_s - idle_s)
        return done.result()
    finally:
        if running is not None and not running.done():  # a hang or a cancelled run: no task left
            running.cancel()
            await asyncio.wait({running}, timeout=5)


@functools.cache
def _ssl_context() -> Any:
    """One default SSL context for every episode's client. The endpoint is plain HTTP on
    loopback, but an httpx client builds a context (the CA bundle read and parsed) when it is
    made: ~17 ms of the event loop's time per episode, 14% of a small vLLM step's rollout
    (bench/agent_endpoint_bench.py). Sharing it keeps certificate checking as it was."""
    import httpx

    return httpx.create_ssl_context()


def _is_async(agent: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None))


async def _run_async(
    agent: Callable[..., Any], task: dict[str, Any], base_url: str, key: str, done: asyncio.Future[AgentOutcome]
) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=None,
                                http_client=openai.DefaultAsyncHttpxClient(verify=_ssl_context()))  # fmt: skip
    try:
        outcome = AgentOutcome(result=await agent(task, client, MODEL_NAME))
    except Exception as exc:  # the agent's failure is its episode's error
        outcome = AgentOutcome(exception=exc)
    finally:
        await client.close()
    if not done.done():
        done.set_result(outcome)


def _start_thread(
    agent: Callable[..., Any], task: dict[str, Any], base_url: str, key: str,
    done: asyncio.Future[AgentOutcome], loop: asyncio.AbstractEventLoop,
) -> None:  # fmt: skip
    """A sync agent on a daemon thread of its own: a hung one is abandoned, and never holds
    up the loop's shutdown as a pool thread would."""

    def deliver(outcome: AgentOutcome) -> None:
        if not done.done():
            done.set_result(outcome)

    def run() -> None:
        import openai

        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=None,
                               http_client=openai.DefaultHttpxClient(verify=_ssl_context()))  # fmt: skip
        try:
            outcome = AgentOutcome(result=agent(task, client, MODEL_NAME))
        except Exception as exc:  # the agent's failure is its episode's error
            outcome = AgentOutcome(exception=exc)
        finally:
            client.close()
        try:
            loop.call_soon_threadsafe(deliver, outcome)
        except RuntimeError:  # the loop is gone: the episode gave up on this agent
            pass

    threading.Thread(target=run, name=f"agent-{key[-6:]}", daemon=True).start()


def _where_it_is(running: asyncio.Future[None] | None) -> str:
    """Where an async agent waits: the innermost frame of its await chain outside asyncio."""
    if not isinstance(running, asyncio.Task):
        return ""
    library = os.path.dirname(asyncio.__file__)
    frame, awaited = None, running.get_coro()
    while awaited is not None and getattr(awaited, "cr_frame", None) is not None:
        if not awaited.cr_frame.f_code.co_filename.startswith(library):
            frame = awaited.cr_frame
        awaited = getattr(awaited, "cr_await", None)
    if frame is None:
        return ""
    return f"; it waits in {frame.f_code.co_name} at {frame.f_code.co_filename}:{frame.f_lineno}"


# ---------------------------------------------------------------- functions and tasks


def _resolve(role: str, spec: object, arity: int) -> Callable[..., Any]:
    """The function ``spec`` ("module:function") names, checked to take ``arity`` arguments."""
    parts = spec.split(":") if isinstance(spec, str) else []
    if len(parts) != 2 or not all(part.strip() for part in parts):
        raise ValueError(f"{role}={spec!r} must be 'module:function', e.g. 'my_agent:run'")
    module = importlib.import_module(parts[0].strip())
    function = getattr(module, parts[1].strip(), None)
    if not callable(function):
        raise ValueError(f"{role}={spec!r}: module {parts[0]!r} has no function {parts[1]!r}")
    try:
        inspect.signature(function).bind(*range(arity))
    except TypeError as exc:
        raise TypeError(f"{role}={spec!r} must take {arity} positional arguments: {exc}") from exc
    except ValueError:
        pass  # a builtin without a signature: the call itself will tell
    return function


def _task_items(tasks: object, where: str) -> tuple[TaskItem, ...]:
    if not isinstance(tasks, list | tuple):
        raise TypeError(f"{where} returned a {type(tasks).__name__}, not a list of task dicts")
    items: dict[str, TaskItem] = {}
    for index, task in enumerate(tasks):
        if not isinstance(task, Mapping):
            raise TypeError(f"{where}[{index}] is a {type(task).__name__}, not a dict")
        try:
            text = json.dumps(task, sort_keys=True, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}[{index}] is not JSON data: {exc}") from exc
        task_id = str(task["id"]) if task.get("id") is not None else hashlib.sha256(text.encode()).hexdigest()[:16]
        if task_id in items:
            raise ValueError(f"{where}[{index}] has task id {task_id!r} again; ids must be unique in a split")
        items[task_id] = TaskItem(task_id=task_id, payload=Task(prompt=text, metadata=json.loads(text), id=task_id))
    return tuple(items.values())


def _task_dict(item: TaskItem) -> dict[str, Any]:
    """A fresh copy of the task, for the agent or the reward to do with as they like."""
    if not isinstance(item.payload, Task):
        raise TypeError(f"task {item.task_id} holds a {type(item.payload).__name__}; an agent plays Tasks")
    return json.loads(json.dumps(dict(item.payload.metadata)))
