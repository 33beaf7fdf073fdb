"""Async-style episodes through the runner: endings, failures, and close() every time."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rollflow.envs.agent import PolicyAction
from rollflow.envs.async_handle import AsyncEnvironmentHandle
from rollflow.envs.env import AsyncEnvSuite, Env
from rollflow.envs.handle import UNSCORED_EPISODE, EpisodeLimits, TaskItem
from rollflow.envs.scripted import ScriptedPolicy, constant_policy
from rollflow.envs.tools import run_tool_calls
from rollflow.envs.types import Message, StepResult, Task, ToolResult, ToolSpec, TruncationCause, tool_to_spec


class EchoTool:
    name = "echo"
    description = "Echo the text back; stop=true asks to end the episode."
    parameters_schema: dict[str, Any] = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "stop": {"type": "boolean"}},
        "required": ["text"],
    }

    async def execute(self, arguments: str) -> ToolResult:
        values = json.loads(arguments)
        return ToolResult(content=values["text"], should_stop=values.get("stop", False))


class EchoEnv(Env):
    """Final answer == target terminates with reward 1; three tool errors truncate (cause env).

    ``task.metadata["raise_in"]`` names a method to raise in; ``closed`` counts closes.
    """

    closed = 0

    def __init__(self, task: Task) -> None:
        self._raise_in = task.metadata.get("raise_in")
        self._messages: list[Message] = []
        self._task = task
        self._errors = 0
        self._tools = {"echo": EchoTool()}

    async def reset(self, task: Task) -> list[Message]:
        if self._raise_in == "reset":
            raise OSError("reset broke")
        self._messages = [{"role": "user", "content": task.prompt}]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        if self._raise_in == "step":
            raise OSError("step broke")
        self._messages.append(message)
        calls = message.get("tool_calls", [])
        if not calls:
            correct = message["content"].strip() == str(self._task.target)
            return StepResult(
                True, False, list(self._messages), reward=float(correct), metrics={"correct": float(correct)}
            )
        outcome = await run_tool_calls(self._tools, calls)
        self._messages.extend(outcome.messages)
        self._errors += outcome.errors
        if outcome.stop_requested:
            return StepResult(True, True, list(self._messages), reward=0.25)  # terminated wins
        if self._errors >= 3:
            return StepResult(False, True, list(self._messages), reward=-1.0, metrics={"tool_errors": 3.0})
        return StepResult(False, False, list(self._messages))

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [tool_to_spec(tool) for tool in self._tools.values()]

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        EchoEnv.closed += 1
        if self._raise_in == "close":
            raise OSError("close broke")


def _handle() -> AsyncEnvironmentHandle:
    tasks = [Task(prompt="say 7", target=7)]
    return AsyncEnvironmentHandle(AsyncEnvSuite(tasks=tasks, val_tasks=tasks, env_factory=EchoEnv))


def _play(policy: ScriptedPolicy, max_turns: int | None = 4, **metadata: Any):
    EchoEnv.closed = 0
    item = TaskItem(task_id="t", payload=Task(prompt="say 7", target=7, metadata=metadata))
    return asyncio.run(_handle().play(item, policy, EpisodeLimits(max_turns=max_turns)))


def _script(*texts: str) -> ScriptedPolicy:
    return ScriptedPolicy(lambda messages, turn: texts[min(turn, len(texts) - 1)])


ECHO = '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
BAD_ECHO = '<tool_call>{"name": "echo", "arguments": {}}</tool_call>'


def test_terminated_reads_reward_and_metrics_from_the_ending_step() -> None:
    policy = _script(ECHO, "7")
    rollout = _play(policy)
    assert rollout.terminated and rollout.env_reward == 1.0 and rollout.env_metrics == {"correct": 1.0}
    assert [m["role"] for m in rollout.messages] == ["user", "assistant", "tool", "assistant"]
    assert rollout.messages[1]["tool_calls"][0]["function"]["name"] == "echo"
    assert rollout.messages[2]["content"] == "hi" and rollout.response_text == "7"
    assert policy.opened_tool_specs[0][0]["function"]["name"] == "echo"
    assert EchoEnv.closed == 1


def test_a_tool_stop_request_the_env_honours_terminates() -> None:
    rollout = _play(
        _script('<tool_call>{"name": "echo", "arguments": {"text": "x", "stop": true}}</tool_call>')
    )
    assert rollout.terminated and rollout.env_reward == 0.25


def test_env_truncation_has_cause_env_and_its_reward() -> None:
    rollout = _play(constant_policy(BAD_ECHO), max_turns=5)
    assert rollout.truncation_cause is TruncationCause.ENV
    assert rollout.env_reward == -1.0 and rollout.env_metrics == {"tool_errors": 3.0}
    assert rollout.turns == 3
    assert rollout.messages[2]["content"].startswith("tool_error: arguments of echo do not match its schema")
    assert EchoEnv.closed == 1


def test_max_turns_truncation_reads_the_last_step_and_closes() -> None:
    rollout = _play(constant_policy(ECHO), max_turns=2)
    assert rollout.truncation_cause is TruncationCause.MAX_TURNS and rollout.turns == 2
    assert rollout.env_reward == 0.0 and rollout.env_metrics == {}
    assert EchoEnv.closed == 1


def test_parse_failure_and_context_overflow_end_without_a_step_and_close() -> None:
    parse = _play(_script(ECHO, "<tool_call>{oops</tool_call>"))
    assert parse.truncation_cause is TruncationCause.PARSE_FAILURE
    assert parse.messages[-1] == {"role": "assistant", "content": "<tool_call>{oops</tool_call>"}
    assert EchoEnv.closed == 1
    overflow = _play(ScriptedPolicy(lambda m, t: PolicyAction(text="", finish_reason="context")))
    assert overflow.truncation_cause is TruncationCause.CONTEXT_OVERFLOW and overflow.turns == 0
    assert EchoEnv.closed == 1


@pytest.mark.parametrize(
    ("raise_in", "error"),
    [
        ("reset", "OSError: reset broke (in Env.reset)"),
        ("step", "OSError: step broke (in Env.step)"),
        ("close", "OSError: close broke (in Env.close)"),
    ],
)
def test_env_failures_are_errors_and_close_still_runs(raise_in: str, error: str) -> None:
    rollout = _play(constant_policy("7"), raise_in=raise_in)
    assert rollout.error == error
    assert not rollout.terminated
    assert EchoEnv.closed == 1


def test_a_factory_that_raises_and_a_missing_turn_limit_are_errors() -> None:
    def factory(task: Task) -> Env:
        raise LookupError("no env for you")

    handle = AsyncEnvironmentHandle(AsyncEnvSuite(tasks=[Task("p")], val_tasks=[], env_factory=factory))
    item = handle.tasks("train")[0]
    failed = asyncio.run(handle.play(item, constant_policy("x"), EpisodeLimits(max_turns=1)))
    assert failed.error == "LookupError: no env for you (in env_factory)"
    unlimited = _play(constant_policy("7"), max_turns=None)
    assert unlimited.error is not None and "need a turn limit" in unlimited.error
    assert EchoEnv.closed == 0  # nothing was built


def test_cancellation_still_closes_the_env() -> None:
    async def cancelled_episode() -> None:
        EchoEnv.closed = 0
        item = _handle().tasks("train")[0]
        slow = ScriptedPolicy(lambda m, t: "7", delay_s=10)
        task = asyncio.ensure_future(_handle().play(item, slow, EpisodeLimits(max_turns=1)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_episode())
    assert EchoEnv.closed == 1


def test_scores_are_the_ending_rewards() -> None:
    handle = _handle()
    item = handle.tasks("train")[0]
    policies = [_script("7"), _script("8"), constant_policy(ECHO), ScriptedPolicy(lambda m, t: 1 / 0)]  # type: ignore[arg-type, return-value]
    rollouts = [asyncio.run(handle.play(item, p, EpisodeLimits(max_turns=2))) for p in policies]
    scores = asyncio.run(handle.score(item, rollouts))
    assert [s.reward for s in scores] == [1.0, 0.0, 0.0, 0.0]
    assert scores[0].components == {"correct": 1.0} and scores[0].threshold is None
    assert scores[3].error == UNSCORED_EPISODE and scores[2].error is None


def test_the_suites_pass_threshold_is_every_scores_threshold() -> None:
    tasks = [Task(prompt="say 7", target=7)]
    handle = AsyncEnvironmentHandle(AsyncEnvSuite(tasks=tasks, val_tasks=tasks, env_factory=EchoEnv, pass_threshold=1.0))
    item = handle.tasks("train")[0]
    rollouts = [asyncio.run(handle.play(item, p, EpisodeLimits(max_turns=2))) for p in (_script("7"), _script("8"))]
    assert [(s.reward, s.threshold) for s in asyncio.run(handle.score(item, rollouts))] == [(1.0, 1.0), (0.0, 1.0)]
    with pytest.raises(ValueError, match=r"AsyncEnvSuite.pass_threshold must be a finite number, got 'won'"):
        AsyncEnvSuite(tasks=tasks, val_tasks=[], env_factory=EchoEnv, pass_threshold="won")  # type: ignore[arg-type]


def test_suite_validation_and_splits() -> None:
    with pytest.raises(TypeError, match=r"tasks\[0\] is str, not rollflow\.envs\.types\.Task"):
        AsyncEnvSuite(tasks=["p"], val_tasks=[], env_factory=EchoEnv)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one training task"):
        AsyncEnvSuite(tasks=[], val_tasks=[], env_factory=EchoEnv)
    with pytest.raises(TypeError, match="env_factory must be callable"):
        AsyncEnvSuite(tasks=[Task("p")], val_tasks=[], env_factory=3)  # type: ignore[arg-type]
    suite = AsyncEnvSuite(tasks=[Task("a", id="a1")], val_tasks=[Task("b")], env_factory=EchoEnv)
    handle = AsyncEnvironmentHandle(suite)
    assert [i.task_id for i in handle.tasks("train")] == ["a1"]
    assert handle.tasks("validation")[0].payload == Task("b")


class TickEnv(Env):
    """Never ends on its own: step ``n`` answers "tick n" with reward ``n / 10`` and metric ``tick``.

    ``delta=True`` makes ``step`` return only the new messages instead of the whole history.
    """

    def __init__(self, delta: bool = False) -> None:
        self._delta = delta
        self._messages: list[Message] = []

    async def reset(self, task: Task) -> list[Message]:
        self._messages = [{"role": "user", "content": task.prompt}]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        tick = sum(m["role"] == "assistant" for m in self._messages) + 1
        new: list[Message] = [message, {"role": "user", "content": f"tick {tick}"}]
        self._messages.extend(new)
        returned = new if self._delta else list(self._messages)
        return StepResult(False, False, returned, reward=tick / 10, metrics={"tick": float(tick)})

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def _play_ticks(delta: bool, max_turns: int):
    handle = AsyncEnvironmentHandle(
        AsyncEnvSuite(tasks=[Task("go")], val_tasks=[], env_factory=lambda task: TickEnv(delta))
    )
    item = handle.tasks("train")[0]
    rollout = asyncio.run(handle.play(item, constant_policy("next"), EpisodeLimits(max_turns=max_turns)))
    return rollout, asyncio.run(handle.score(item, [rollout]))[0]


def test_a_turn_budget_ending_keeps_the_last_steps_reward_and_metrics() -> None:
    rollout, score = _play_ticks(delta=False, max_turns=3)
    assert rollout.truncation_cause is TruncationCause.MAX_TURNS and rollout.turns == 3
    assert rollout.env_reward == 0.3 and rollout.env_metrics == {"tick": 3.0}
    assert score.reward == 0.3 and score.components == {"tick": 3.0}


def test_a_step_history_extending_the_previous_one_is_the_transcript() -> None:
    rollout, _ = _play_ticks(delta=False, max_turns=2)
    assert [m["content"] for m in rollout.messages] == ["go", "next", "tick 1", "next", "tick 2"]


def test_a_step_returning_only_the_new_messages_fails_the_episode_naming_env_step() -> None:
    rollout, score = _play_ticks(delta=True, max_turns=3)
    assert rollout.error is not None and not rollout.truncated
    assert rollout.error.startswith("ValueError: Env.step returned 2 messages that do not start with")
    assert "only the new messages" in rollout.error and "(in Env.step)" in rollout.error
    assert rollout.turns == 1 and score.error == UNSCORED_EPISODE
