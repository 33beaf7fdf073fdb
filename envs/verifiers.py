"""verifiers environments as rollflow async-style environments (the ``verifiers`` extra).

``[env].name = "rollflow.envs.verifiers:load_environment"`` with ``[env.kwargs]``
``env_id = "my_env"`` and ``env_args = { ... }`` loads a verifiers environment the way
verifiers does (``vf.load_environment(env_id, **env_args)``: the installed module named
``env_id``, "-" read as "_", a Hub id's last part, must define ``load_environment``) and
plays it through rollflow's loop. The classic API is what is adapted: ``SingleTurnEnv``,
``MultiTurnEnv`` and ``ToolEnv`` (and their subclasses), verifiers 0.3.1. 0.4.0 removed
that API (only ``verifiers.v1`` task sets and harnesses are left) and pins ``openai<3``;
the README says why 0.3.1 is the version here.

One episode is one verifiers rollout, with rollflow playing the model:
- opening messages: the dataset row's ``prompt``, as verifiers formats it (its
  ``system_prompt`` and ``few_shot`` already in), after ``init_state`` and ``setup_state``;
- each action becomes a trajectory step (``add_trajectory_step``), then the environment's
  own stop conditions are asked (``is_completed``); if none fires, ``get_prompt_messages``
  runs its ``env_response`` (a ``ToolEnv`` runs the tools the action called), whose
  messages are the next turn's. A ``final_env_response`` ends the episode;
- when a stop condition fires, the rollout is finished as verifiers finishes it
  (``cleanup``, then ``rubric.score_rollout`` and ``rubric.cleanup``): its ``reward`` is the
  episode's reward, its ``metrics`` the components, with ``pass_threshold_met`` (reward >=
  the environment's ``pass_threshold``), and the stop condition's name is kept in the last
  step's metadata (``stop_condition``). Every verifiers ending is ``terminated``: verifiers
  scores a rollout that hit its own ``max_turns`` like any other.

Simplifications, and why:
- Async style (one ``Env`` per episode), because a verifiers ``State`` lives across turns
  and hook style keeps no episode state. A pass is verifiers' own: reward >= the
  environment's ``pass_threshold`` (verifiers' default 0.5; the ``pass_threshold`` kwarg
  replaces it for rollflow's ``passed``, pass@k and validation pass rate, while
  ``pass_threshold_met`` stays verifiers' test), so a rubric's partial credit (a format
  reward) is not a pass. There are no SFT targets (``rollflow sft`` reads hook-style
  environments; the dataset's ``answer`` is not a reply in the parser's format), and
  ``[rollout].max_turns`` must be set (it caps the environment's own ``max_turns``). An
  episode rollflow cuts short (its turn cap, the context, a malformed tool call) is not
  scored: reward 0, as for TextArena.
- Rubrics are scored per rollout: group reward functions (``score_group`` only) are
  refused before anything runs. The environment's ``timeout_seconds`` and token-usage stop
  are not applied (rollflow has its own limits).
- Actions are free text unless the environment has tools; then rollflow's tool-call
  protocol parses them and the calls reach ``env_response`` as verifiers ``ToolCall`` s.
- verifiers' ``Environment.__init__`` installs SIGINT and SIGTERM handlers, which loading
  keeps from replacing rollflow's own (``envs/verifiers_loading.py``).

Splits never overlap: with both ``dataset`` and ``eval_dataset``, training plays the first,
validation the second less any row whose prompt is also a training prompt; with only one,
its distinct prompts are shuffled with ``seed`` and the first ``num_validation`` are
validation. Errors before anything runs, each one line naming ``[env].kwargs``: verifiers
not installed, a module that is missing or has no ``load_environment``, an exception while
loading, an environment whose rubric needs whole groups (``envs/verifiers_loading.py``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from rollflow.envs.checks import require_int
from rollflow.envs.env import AnnotatedStepResult, AsyncEnvSuite, Env
from rollflow.envs.handle import checked_score
from rollflow.envs.types import Message, StepResult, Task, ToolSpec
from rollflow.envs.verifiers_loading import load_verifiers_environment, one_line


# ---------------------------------------------------------------- messages


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else getattr(part, "type", None)
        if kind != "text":
            raise ValueError(f"{where} has a {kind!r} content part; rollflow plays text only")
        parts.append(part["text"] if isinstance(part, Mapping) else part.text)
    return "".join(parts)


def to_rollflow_message(message: Any, where: str) -> Message:
    """A verifiers message (a pydantic model, or a dict) as a rollflow chat message."""
    role = message.get("role")
    out: Message = {"role": "user" if role == "text" else str(role), "content": _text(message.get("content"), where)}
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls:
        out["tool_calls"] = [
            {"id": call.get("id"), "type": "function", "function": {"name": call.get("name"), "arguments": call.get("arguments")}}
            for call in calls
        ]
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id"))
    return out


def to_rollflow_messages(messages: Sequence[Any], where: str) -> list[Message]:
    return [to_rollflow_message(message, f"{where} message {i}") for i, message in enumerate(messages)]


def _tool_spec(tool: Any) -> ToolSpec:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)},
    }


# ---------------------------------------------------------------- one episode


class VerifiersEnv(Env):
    """One verifiers rollout, stepped by rollflow (a fresh object per episode)."""

    def __init__(self, environment: Any, row: Mapping[str, Any]) -> None:
        self.environment = environment
        self.row = dict(row)
        self.checks_tool_protocol = bool(environment.tool_defs)
        self._state: Any = None
        self._prompt: list[Any] = []  # the verifiers messages of the next model call
        self._messages: list[Message] = []
        self._finished = False

    @property
    def tool_specs(self) -> list[ToolSpec]:
        tools = self.environment.tool_defs if self._state is None else self._state["tool_defs"]
        return [_tool_spec(tool) for tool in tools or []]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    def max_episode_turns(self) -> int | None:
        turns = int(self.environment.max_turns)
        return turns if turns > 0 else None

    async def reset(self, task: Task) -> list[Message]:
        from verifiers.legacy.utils.message_utils import maybe_normalize_messages

        env = self.environment
        self._state = await env.init_state(self.row, RollflowPlaysTheModel(), "rollflow-policy", None)
        state = await env.setup_state(self._state)
        self._state = self._state if state is None else state
        if await env.is_completed(self._state):
            raise RuntimeError(f"the rollout ended before the first action ({self._state.get('stop_condition')})")
        self._prompt = maybe_normalize_messages(await env.get_prompt_messages(self._state), field_name="prompt")
        self._messages = to_rollflow_messages(self._prompt, "the prompt")
        self.checks_tool_protocol = bool(self._state["tool_defs"])
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        from verifiers.legacy.utils.message_utils import maybe_normalize_messages, normalize_messages

        if self._state is None:
            raise RuntimeError("step() before reset()")
        env, state = self.environment, self._state
        completion = normalize_messages([dict(message)], field_name="action")
        await env.add_trajectory_step(state, _trajectory_step(self._prompt, completion, state["trajectory_id"]))
        self._messages.append(message)
        if await env.is_completed(state):
            return await self._finish()
        prompt = maybe_normalize_messages(await env.get_prompt_messages(state), field_name="prompt")
        transcript = to_rollflow_messages(prompt, "env_response")
        if transcript[: len(self._messages)] != self._messages:
            raise ValueError(
                "get_prompt_messages returned a prompt that does not extend the transcript; rollflow plays "
                "linear conversations only"
            )
        self._prompt, self._messages = prompt, transcript
        if state.get("final_env_response") is not None and await env.is_completed(state):
            final = maybe_normalize_messages(state["final_env_response"], field_name="final_env_response")
            self._messages.extend(to_rollflow_messages(final, "final_env_response"))
            return await self._finish()
        return AnnotatedStepResult(terminated=False, truncated=False, messages=list(self._messages))

    async def _finish(self) -> StepResult:
        """Finish and score the rollout as verifiers' own ``run_rollout`` does."""
        env, state = self.environment, self._state
        self._finished = True
        await env.cleanup(state)
        if env.score_rollouts:
            await env.rubric.score_rollout(state)
        else:
            await env.rubric.dummy_score_rollout(state)
        await env.rubric.cleanup(state)
        reward = float(state["reward"] or 0.0)
        metrics = {str(name): float(value) for name, value in (state["metrics"] or {}).items()}
        metrics["pass_threshold_met"] = float(reward >= env.pass_threshold)
        return AnnotatedStepResult(
            terminated=True,
            truncated=False,
            messages=list(self._messages),
            reward=reward,
            metrics=metrics,
            metadata={"stop_condition": str(state.get("stop_condition") or "")},
        )

    async def close(self) -> None:
        """A rollout rollflow cut short still runs the environment's cleanup handlers."""
        if self._state is not None and not self._finished:
            self._finished = True
            await self.environment.cleanup(self._state)


def _trajectory_step(prompt: list[Any], completion: list[Any], trajectory_id: str) -> dict[str, Any]:
    """verifiers' ``TrajectoryStep`` for one action; rollflow keeps the tokens, not verifiers."""
    return {
        "prompt": prompt,
        "completion": completion,
        "response": None,
        "tokens": None,
        "reward": None,
        "advantage": None,
        "is_truncated": False,
        "trajectory_id": trajectory_id,
        "extras": {},
    }


def _client_class() -> type:
    from verifiers.legacy.clients.client import Client

    class _RollflowPlaysTheModel(Client):  # type: ignore[misc]
        """The client ``init_state`` requires; rollflow's policy answers instead, so any call
        verifiers makes to it (a model call from inside the environment) is an error."""

        def __init__(self) -> None:
            self._client = None
            self._config = None

        def setup_client(self, config: Any) -> Any:
            return None

        async def _refuse(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the verifiers environment asked its client for a model response; rollflow's policy plays the model")

        to_native_tool = to_native_prompt = get_native_response = _refuse
        raise_from_native_response = from_native_response = get_response = _refuse

        async def close(self) -> None:
            return None

    return _RollflowPlaysTheModel


def RollflowPlaysTheModel() -> Any:  # noqa: N802  (builds the class on first use: verifiers is optional)
    global _CLIENT_CLASS
    if _CLIENT_CLASS is None:
        _CLIENT_CLASS = _client_class()
    return _CLIENT_CLASS()


_CLIENT_CLASS: type | None = None


# ---------------------------------------------------------------- tasks and splits


def _rows(environment: Any, which: str) -> list[dict[str, Any]]:
    dataset = environment.build_dataset() if which == "dataset" else environment.build_eval_dataset()
    return [] if dataset is None else [dict(row) for row in dataset]


def _prompt_key(row: Mapping[str, Any]) -> str:
    return json.dumps(to_rollflow_messages(_normalized(row["prompt"]), "prompt"), sort_keys=True, ensure_ascii=False)


def _normalized(prompt: Any) -> list[Any]:
    from verifiers.legacy.utils.message_utils import normalize_messages

    return normalize_messages(prompt, field_name="prompt")


def split_rows(
    environment: Any, num_validation: int, seed: int
) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[str, dict[str, Any]]]]:
    """(train, validation) as ``(source, row)`` pairs that never share a prompt."""
    train_rows, eval_rows = _rows(environment, "dataset"), _rows(environment, "eval_dataset")
    if train_rows and eval_rows:
        train_keys = {_prompt_key(row) for row in train_rows}
        validation = [("eval_dataset", row) for row in eval_rows if _prompt_key(row) not in train_keys]
        return [("dataset", row) for row in train_rows], validation[:num_validation]
    source, rows = ("dataset", train_rows) if train_rows else ("eval_dataset", eval_rows)
    keys = list(dict.fromkeys(_prompt_key(row) for row in rows))
    if len(keys) <= num_validation:
        raise ValueError(
            f"[env].kwargs num_validation = {num_validation}: the environment's only dataset ({source}) has "
            f"{len(keys)} distinct prompts, which leaves none to train on"
        )
    random.Random(seed).shuffle(keys)
    held_out = set(keys[:num_validation])
    train = [(source, row) for row in rows if _prompt_key(row) not in held_out]
    validation, seen = [], set()
    for row in rows:
        key = _prompt_key(row)
        if key in held_out and key not in seen:
            validation.append((source, row))
            seen.add(key)
    return train, validation


def _task(env_id: str, source: str, row: Mapping[str, Any]) -> Task:
    messages = to_rollflow_messages(_normalized(row["prompt"]), "prompt")
    users = [m["content"] for m in messages if m["role"] == "user"]
    answer = row.get("answer")
    answer = answer if answer is None or isinstance(answer, str | int | float | bool) else str(answer)
    return Task(
        prompt=users[-1] if users else json.dumps(messages, ensure_ascii=False),
        target=answer,
        metadata={"library": "verifiers", "environment": env_id, "source": source,
                  "example_id": int(row["example_id"]), "answer": answer},
        id=f"verifiers/{env_id}/{source}/{int(row['example_id']):05d}",
    )  # fmt: skip


def load_environment(
    env_id: str,
    env_args: Mapping[str, Any] | None = None,
    num_train: int | None = None,
    num_validation: int = 50,
    seed: int = 0,
    pass_threshold: float | None = None,
) -> AsyncEnvSuite:
    """The verifiers environment ``env_id`` built with ``env_args``: ``num_train`` training
    rows (all when None) and ``num_validation`` validation rows (see the module docstring).
    An episode passes when its reward is at least ``pass_threshold`` (None: the
    environment's own ``pass_threshold``)."""
    if num_train is not None:
        require_int("[env].kwargs num_train", num_train, minimum=1)
    require_int("[env].kwargs num_validation", num_validation, minimum=0)
    require_int("[env].kwargs seed", seed, minimum=0)
    if pass_threshold is not None:
        checked_score(pass_threshold, "[env].kwargs pass_threshold")
    environment = load_verifiers_environment(env_id, dict(env_args or {}))
    try:
        train, validation = split_rows(environment, num_validation, seed)
        train_tasks = [(_task(env_id, source, row), row) for source, row in train[:num_train]]
        val_tasks = [(_task(env_id, source, row), row) for source, row in validation]
    except ValueError:  # ours, naming the setting
        raise
    except Exception as exc:
        raise ValueError(f"[env].kwargs: verifiers environment {env_id!r}'s dataset could not be read: {one_line(exc)}") from None
    rows = {str(task.id): row for task, row in (*train_tasks, *val_tasks)}
    return AsyncEnvSuite(
        tasks=tuple(task for task, _ in train_tasks),
        val_tasks=tuple(task for task, _ in val_tasks),
        env_factory=lambda task: VerifiersEnv(environment, rows[str(task.id)]),
        pass_threshold=float(environment.pass_threshold if pass_threshold is None else pass_threshold),
    )
