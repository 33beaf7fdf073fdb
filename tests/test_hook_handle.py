"""Hook-style episodes through the runner: each ending, each failure, and group scoring."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from rollflow.envs.agent import PolicyAction
from rollflow.envs.async_handle import AsyncEnvironmentHandle
from rollflow.envs.env import AsyncEnvSuite
from rollflow.envs.handle import UNSCORED_EPISODE, EpisodeLimits, TaskItem
from rollflow.envs.hook_handle import HookEnvironmentHandle, HookEpisodeEnv, hook_task, to_environment_episode
from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.protocol import parse_action
from rollflow.envs.scripted import ScriptedPolicy, constant_policy
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    Message,
    RewardResult,
    TaskExample,
    ToolSpec,
    TruncationCause,
)

PING_SPEC: ToolSpec = {
    "type": "function",
    "function": {"name": "ping", "description": "Answers pong.", "parameters": {"type": "object"}},
}


class PingEnv(EnvironmentMultiTurn):
    """Ends on "done"; a ping tool call gets "pong"; anything else gets "go on".

    ``example.metadata["raise_in"]`` names a hook to raise in, to test failures.
    """

    def __init__(self, turns: int = 4) -> None:
        self.turns = turns
        self.steps_seen: list[str] = []

    def _maybe_raise(self, example: TaskExample, hook: str) -> None:
        if example.metadata.get("raise_in") == hook:
            raise RuntimeError(f"{hook} broke")

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        self._maybe_raise(example, "start_episode")
        return [{"role": "system", "content": "Say done."}, {"role": "user", "content": prompt_text}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return int(example.metadata.get("turns", self.turns))

    def tool_specs(self, example: TaskExample) -> Sequence[ToolSpec]:
        return [PING_SPEC]

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        self._maybe_raise(example, "step_episode")
        self.steps_seen.append(assistant_response)
        assert messages[-1]["content"] == assistant_response  # appended before the step
        turn = sum(m["role"] == "assistant" for m in messages)
        if "done" in assistant_response:
            return EnvironmentStepResult(done=True, final_response_text="DONE", metadata={"turn": turn})
        calls = messages[-1].get("tool_calls", [])
        replies = tuple(
            {"role": "tool", "content": "pong", "tool_call_id": c["id"], "name": "ping"} for c in calls
        ) or ({"role": "user", "content": "go on"},)
        return EnvironmentStepResult(done=False, messages=replies, metadata={"turn": turn})

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        if episode.response_text == "explode":
            raise ValueError("unscorable")
        done = float(episode.response_text == "DONE")
        return RewardResult(
            score=done, threshold=1.0, components={"done": done, "steps": len(episode.metadata["steps"])}
        )


class FreeTextEnv(PingEnv):
    checks_tool_protocol = False


def _item(**metadata: object) -> TaskItem:
    return TaskItem(task_id="t", payload=TaskExample(input="hello", metadata=metadata))


def _play(
    env: EnvironmentMultiTurn, policy: ScriptedPolicy, limits: EpisodeLimits | None = None, **metadata: object
):
    handle = HookEnvironmentHandle(env)
    return asyncio.run(handle.play(_item(**metadata), policy, limits or EpisodeLimits()))


def _script(*texts: str) -> ScriptedPolicy:
    return ScriptedPolicy(lambda messages, turn: texts[min(turn, len(texts) - 1)])


def test_terminated_episode_follows_the_reference_loop() -> None:
    env = PingEnv()
    call = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    policy = _script(call, "thinking", "done now")
    rollout = _play(env, policy)
    assert rollout.terminated and not rollout.truncated and rollout.error is None
    assert rollout.turns == 3
    assert rollout.response_text == "DONE"  # final_response_text overrides the action
    assert [m["role"] for m in rollout.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert rollout.messages[2] == parse_action(call).to_message(call)
    assert rollout.messages[3]["tool_call_id"] == "call_0"
    assert rollout.step_metadata == ({"turn": 1}, {"turn": 2}, {"turn": 3})
    assert policy.opened_tool_specs == [(PING_SPEC,)]
    assert rollout.actions == ()  # a scripted policy gives no tokens


def test_turn_limit_is_the_smaller_of_env_and_limits() -> None:
    by_env = _play(PingEnv(turns=2), constant_policy("hmm"))
    by_limits = _play(PingEnv(turns=5), constant_policy("hmm"), EpisodeLimits(max_turns=3))
    for rollout, turns in ((by_env, 2), (by_limits, 3)):
        assert rollout.truncated and rollout.truncation_cause is TruncationCause.MAX_TURNS
        assert rollout.turns == turns
        assert rollout.response_text == "hmm"


def test_a_hook_episode_is_an_env_that_plays_alike_through_the_async_handle() -> None:
    call = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    env, example = PingEnv(turns=5), TaskExample(input="hello")
    suite = AsyncEnvSuite(
        tasks=[hook_task(example)], val_tasks=[], env_factory=lambda task: HookEpisodeEnv(env, example)
    )
    async_handle = AsyncEnvironmentHandle(suite)
    for script in ((call, "thinking", "done now"), ("hmm",)):
        item = async_handle.tasks("train")[0]
        as_env = asyncio.run(async_handle.play(item, _script(*script), EpisodeLimits(max_turns=9)))
        as_hook = _play(env, _script(*script))
        assert as_env.messages == as_hook.messages and as_env.step_metadata == as_hook.step_metadata
        assert (as_env.response_text, as_env.turns) == (as_hook.response_text, as_hook.turns)
        assert as_env.truncation_cause == as_hook.truncation_cause
        assert as_env.env_reward == 0.0 and as_hook.env_reward is None  # hooks are scored, not stepped
    assert as_hook.truncation_cause is TruncationCause.MAX_TURNS and as_hook.turns == 5


def test_parse_failure_ends_the_episode_without_stepping_the_env() -> None:
    env = PingEnv()
    bad = '<tool_call>{"name": "ping", "arguments": [1]}</tool_call>'
    rollout = _play(env, _script("hmm", bad))
    assert rollout.truncation_cause is TruncationCause.PARSE_FAILURE
    assert env.steps_seen == ["hmm"]
    assert rollout.messages[-1] == {"role": "assistant", "content": bad}
    assert rollout.response_text == bad and rollout.turns == 2


def test_an_env_can_opt_out_of_protocol_checks() -> None:
    env = FreeTextEnv()
    rollout = _play(env, _script("<tool_call>oops", "done"))
    assert rollout.terminated
    assert env.steps_seen == ["<tool_call>oops", "done"]
    assert "tool_calls" not in rollout.messages[2]


def test_context_overflow_keeps_sampled_tokens_and_skips_the_step() -> None:
    env = PingEnv()
    first = PolicyAction(
        text="hmm", token_ids=(5, 6), logprobs=(-0.1, -0.2), prompt_delta_ids=(1, 2, 3), latency_s=0.5
    )
    partial = PolicyAction(
        text="do",
        token_ids=(7,),
        logprobs=(-0.3,),
        prompt_delta_ids=(4,),
        finish_reason="context",
        sampling_attempts=2,
    )
    policy = ScriptedPolicy(lambda messages, turn: [first, partial][turn], version=7)
    rollout = _play(env, policy)
    assert rollout.truncation_cause is TruncationCause.CONTEXT_OVERFLOW
    assert env.steps_seen == ["hmm"]
    assert rollout.turns == 2 and rollout.messages[-1] == {"role": "assistant", "content": "do"}
    assert [a.token_ids for a in rollout.actions] == [(5, 6), (7,)]
    assert [a.finish_reason for a in rollout.actions] == ["stop", "context"]
    assert rollout.actions[1].prompt_delta_ids == (4,) and rollout.actions[1].logprobs == (-0.3,)
    assert rollout.total_tokens == 7
    assert rollout.policy_version == 7 and rollout.sampling_attempts == 3


def test_context_spent_before_sampling_is_not_a_turn() -> None:
    rollout = _play(PingEnv(), ScriptedPolicy(lambda m, t: PolicyAction(text="", finish_reason="context")))
    assert rollout.truncation_cause is TruncationCause.CONTEXT_OVERFLOW
    assert rollout.turns == 0 and rollout.actions == () and len(rollout.messages) == 2


def test_raising_hooks_and_policies_become_errors_naming_where() -> None:
    started = _play(PingEnv(), constant_policy("done"), raise_in="start_episode")
    stepped = _play(PingEnv(), constant_policy("done"), raise_in="step_episode")
    zero_turns = _play(PingEnv(), constant_policy("done"), turns=0)

    def broken(messages: Sequence[Message], turn: int) -> str:
        raise ConnectionError("server gone")

    policy_failed = _play(PingEnv(), ScriptedPolicy(broken))
    assert started.error == "RuntimeError: start_episode broke (in start_episode)"
    assert stepped.error == "RuntimeError: step_episode broke (in step_episode)"
    assert stepped.messages[-1]["content"] == "done" and stepped.turns == 1  # kept for debugging
    assert zero_turns.error is not None and "max_episode_turns returned 0" in zero_turns.error
    assert policy_failed.error == "ConnectionError: server gone (in PolicySession.act)"
    assert not any(r.terminated or r.truncated for r in (started, stepped, zero_turns, policy_failed))


def test_a_step_result_of_the_wrong_type_is_an_error() -> None:
    class Sloppy(PingEnv):
        def step_episode(self, example, messages, assistant_response):  # type: ignore[no-untyped-def]
            return {"done": True}

    rollout = _play(Sloppy(), constant_policy("done"))
    assert rollout.error is not None and "dict, not rollflow.envs.types.EnvironmentStepResult" in rollout.error


def test_async_hooks_are_awaited() -> None:
    class AsyncPing(PingEnv):
        async def step_episode(self, example, messages, assistant_response):  # type: ignore[no-untyped-def, override]
            await asyncio.sleep(0)
            return EnvironmentStepResult(done=True, final_response_text="DONE")

    assert _play(AsyncPing(), constant_policy("x")).terminated


def _group(handle: HookEnvironmentHandle, *scripts: ScriptedPolicy):
    item = _item()
    rollouts = [asyncio.run(handle.play(item, policy, EpisodeLimits(max_turns=2))) for policy in scripts]
    return rollouts, asyncio.run(handle.score(item, rollouts))


def test_group_scoring_isolates_a_raising_score_episode_and_skips_errored_episodes() -> None:
    env = PingEnv()
    handle = HookEnvironmentHandle(env)
    broken = ScriptedPolicy(lambda m, t: 1 / 0)  # type: ignore[arg-type, return-value]
    rollouts, scores = _group(handle, constant_policy("done"), constant_policy("hmm"), broken)
    assert [s.reward for s in scores[:2]] == [1.0, 0.0]
    assert scores[0].threshold == 1.0 and scores[0].components == {"done": 1.0, "steps": 1.0}
    assert scores[1].components["steps"] == 2.0  # max_turns=2 steps
    assert rollouts[2].error is not None and scores[2].error == UNSCORED_EPISODE

    class ExplodingFinal(PingEnv):
        def step_episode(self, example, messages, assistant_response):  # type: ignore[no-untyped-def]
            return EnvironmentStepResult(done=True, final_response_text=assistant_response)

    _, scores = _group(
        HookEnvironmentHandle(ExplodingFinal()), constant_policy("explode"), constant_policy("fine")
    )
    assert scores[0].error == "ValueError: unscorable (in score_episode)"
    assert scores[1].error is None


def test_an_overridden_score_episodes_that_fails_errors_its_whole_group() -> None:
    class GroupScorer(PingEnv):
        def score_episodes(self, example, episodes):  # type: ignore[no-untyped-def]
            if len(episodes) == 3:
                raise RuntimeError("group too big")
            return [RewardResult(score=0.5)]  # one result whatever the group size

    handle = HookEnvironmentHandle(GroupScorer())
    _, scores = _group(handle, *(constant_policy("done") for _ in range(3)))
    assert {s.error for s in scores} == {"RuntimeError: group too big (in score_episodes)"}
    _, scores = _group(handle, constant_policy("done"), constant_policy("done"))
    assert all(s.error is not None and "1 results for 2 episodes" in s.error for s in scores)


def test_a_non_finite_score_is_an_error_score() -> None:
    class NanScorer(PingEnv):
        def score_episode(self, example, episode):  # type: ignore[no-untyped-def]
            return RewardResult(score=float("nan"))

    _, [score] = _group(HookEnvironmentHandle(NanScorer()), constant_policy("done"))
    assert score.error is not None and "finite" in score.error


def test_environment_episode_rebuilt_for_scoring() -> None:
    rollout = _play(PingEnv(), _script("hmm", "done"))
    episode = to_environment_episode(rollout)
    assert episode.messages == rollout.messages and episode.response_text == "DONE"
    assert episode.metadata["steps"] == [{"turn": 1}, {"turn": 2}]
    assert episode.metadata["truncation_cause"] is None and episode.metadata["terminated"] is True
    assert [t.role for t in episode.turns] == [m["role"] for m in rollout.messages]
    assert episode.total_tokens is None and isinstance(episode.latency_ms, int)
    json.dumps(episode.metadata)  # plain data


def test_tasks_come_from_examples_with_stable_ids() -> None:
    env = PingEnv()
    env.dataset = [{"input": "a", "id": "first"}, {"input": "b"}]  # type: ignore[attr-defined]
    items = HookEnvironmentHandle(env).tasks("train")
    assert items[0].task_id == "first"
    assert items[1].task_id == HookEnvironmentHandle(env).tasks("validation")[1].task_id
    assert len(items[1].task_id) == 16
