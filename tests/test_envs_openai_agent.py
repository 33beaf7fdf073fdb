"""An unmodified openai-SDK agent as an environment: the capture endpoint, driven by the real
``openai`` client, records token-exact episodes, and the failures are episode data.

The agents below are plain functions of this module, named to the environment as
``test_envs_openai_agent:<name>``, as a user names theirs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from rollflow.envs.agent import PolicyAction
from rollflow.envs.episode import ActionTokens, EpisodeRollout
from rollflow.envs.handle import EnvironmentHandle, EpisodeLimits
from rollflow.envs.openai_agent import episode_score
from rollflow.envs.openai_agent_endpoint import AgentEpisode, SharedEndpoint
from rollflow.envs.openai_agent_messages import RequestError, parse_request, reply_for, transcript_messages
from rollflow.envs.protocol import describe_tools
from rollflow.envs.loop import EpisodeTrace
from rollflow.envs.runner import load_environment_handle, play_groups
from rollflow.envs.scripted import ScriptedPolicy
from rollflow.envs.tool_use_game import GAME_TOOL_SPECS, expert_policy, generate_examples
from rollflow.envs.tracebacks import keeping_tracebacks
from rollflow.envs.types import Message, ToolSpec, TruncationCause
from rollflow.envs.tool_formats import TemplateTool, template_tools
from rollflow.policy.sampling import SamplingSettings
from rollflow.storage.query import open_run_sql, run_query
from tiny_run import train_tiny_on

SPEC = "rollflow.envs.openai_agent:load_environment"
HERE = "test_envs_openai_agent"
SEEN: dict[str, list[Any]] = {}  # what each agent observed, by task id
LOOKUP: ToolSpec = GAME_TOOL_SPECS[1]


def tasks(split: str) -> list[dict[str, Any]]:
    return [{"id": f"{split}-{i}", "question": f"How many crates are at depot {i}?"} for i in range(2)]


def reward(task: dict[str, Any], result: Any, messages: list[dict[str, Any]]) -> float:
    return float(len([m for m in messages if m["role"] == "assistant"]))


def opening(task: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": task["question"]}]


async def two_calls(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> str:
    messages = opening(task)
    first = await client.chat.completions.create(model=model, messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And then?"}]
    second = await client.chat.completions.create(model=model, messages=messages)
    SEEN.setdefault(task["id"], []).extend([first, second])
    return second.choices[0].message.content or ""


def two_calls_sync(task: dict[str, Any], client: openai.OpenAI, model: str) -> str:
    messages = opening(task)
    first = client.chat.completions.create(model=model, messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=model, messages=messages)
    SEEN.setdefault(task["id"], []).extend([first, second])
    return second.choices[0].message.content or ""


async def rewrites_history(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> str:
    first = await client.chat.completions.create(model=model, messages=opening(task))
    fresh = [{"role": "user", "content": "Forget that. " + task["question"]}]  # a sub-agent's own thread
    second = await client.chat.completions.create(model=model, messages=fresh)
    SEEN.setdefault(task["id"], []).extend([first, second])
    return second.choices[0].message.content or ""


async def uses_a_tool(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> str:
    messages = opening(task)
    first = await client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP])
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "17"})
    second = await client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP])
    SEEN.setdefault(task["id"], []).extend([first, second])
    return second.choices[0].message.content or ""


async def changes_its_tools(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> str:
    messages = opening(task)
    first = await client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP])
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Now count."}]
    second = await client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP, GAME_TOOL_SPECS[0]])
    return second.choices[0].message.content or ""


async def raises(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> str:
    await client.chat.completions.create(model=model, messages=opening(task))
    raise ValueError("the agent broke on purpose")


async def asks_what_is_refused(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> str:
    """Each refused request, then one good call: the episode goes on after a refusal."""
    refused: list[tuple[int, str]] = []
    asks: list[dict[str, Any]] = [
        {"stream": True}, {"n": 2}, {"tool_choice": "required", "tools": [LOOKUP]}, {"stop": ["\n"]}, {"max_tokens": 1},
    ]
    for extra in asks:
        try:
            await client.chat.completions.create(model=model, messages=opening(task), **extra)
        except openai.APIStatusError as exc:
            refused.append((exc.status_code, exc.message))
    stranger = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="rf-not-a-key", max_retries=0)
    try:
        await stranger.chat.completions.create(model=model, messages=opening(task))
    except openai.APIStatusError as exc:
        refused.append((exc.status_code, exc.message))
    finally:
        await stranger.close()
    models = await client.models.list()
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=opening(task), temperature=0.0, seed=3, max_tokens=4096)
    answer = raw.parse()
    SEEN.setdefault(task["id"], []).extend([refused, [m.id for m in models.data], answer, dict(raw.headers)])
    return answer.choices[0].message.content or ""


async def loops_forever(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> str:
    messages = opening(task)
    while True:  # never stops on its own: the call budget ends it
        reply = await client.chat.completions.create(model=model, messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]


async def hangs(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> str:
    SEEN.setdefault(task["id"], []).append(str(client.base_url))
    await client.chat.completions.create(model=model, messages=opening(task))
    await asyncio.sleep(3600)
    return "never"


def hangs_sync(task: dict[str, Any], client: openai.OpenAI, model: str) -> str:
    client.chat.completions.create(model=model, messages=opening(task))
    time.sleep(2)  # past the test's agent_timeout_s; the abandoned thread then ends by itself
    return "late"


async def leaves_a_call_running(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> str:
    call = asyncio.ensure_future(client.chat.completions.create(model=model, messages=opening(task)))
    SEEN.setdefault(task["id"], []).append(call)
    await asyncio.sleep(0.2)  # the call is being served (the policy takes 1 s) when the agent returns
    return "done"


# ---------------------------------------------------------------- helpers


class RecordingPolicy:
    """The real policy, passed through; it keeps each session's messages and actions."""

    def __init__(self, policy: Any) -> None:
        self.policy, self.version = policy, policy.version
        self.settings = policy.settings
        self.codec = getattr(policy, "codec", None)  # its chat template picks the tool format
        self.calls: list[tuple[list[Message], PolicyAction]] = []

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> Any:
        session, calls = self.policy.open_session(tool_specs), self.calls

        class Recording:
            async def act(self, messages: Sequence[Message]) -> PolicyAction:
                action = await session.act(messages)
                calls.append((list(messages), action))
                return action

            async def close(self) -> None:
                await session.close()

        return Recording()


def agent_handle(agent: str, **kwargs: Any) -> EnvironmentHandle:
    return load_environment_handle(SPEC, {"agent": f"{HERE}:{agent}", "tasks": f"{HERE}:tasks",
                                          "reward": f"{HERE}:reward", **kwargs})  # fmt: skip


def play_one(handle: EnvironmentHandle, policy: Any, max_turns: int | None = None) -> EpisodeRollout:
    item = handle.tasks("train")[0]
    SEEN.pop(item.task_id, None)
    ((rollout,),) = asyncio.run(play_groups(handle, [item], 1, policy, EpisodeLimits(max_turns=max_turns), 1))
    return rollout


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir: Path) -> Any:
    from rollflow.policy.models import ModelRef, load_causal_lm
    from rollflow.policy.sampling import SamplingSettings
    from rollflow.policy.transformers_backend import TransformersPolicy

    model, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    return TransformersPolicy(model, tokenizer, SamplingSettings(max_completion_tokens=12, max_model_length=1024))


def spelled(policy: Any, *pieces: Sequence[int]) -> str:
    """What the ids spell, piece by piece, as the codec keeps an episode's text."""
    return "".join(policy.tokenizer.decode(list(ids), skip_special_tokens=False,
                                           clean_up_tokenization_spaces=False) for ids in pieces)  # fmt: skip


def as_tokens(action: PolicyAction) -> ActionTokens:
    return ActionTokens(action.prompt_delta_ids, action.reset, action.token_ids, action.logprobs, action.finish_reason)


# ---------------------------------------------------------------- (a) token-exact episodes


@pytest.mark.parametrize("agent", ["two_calls", "two_calls_sync"])
def test_an_agents_two_calls_are_one_token_exact_sample(agent: str, tiny_policy: Any) -> None:
    recording = RecordingPolicy(tiny_policy)
    rollout = play_one(agent_handle(agent), recording)
    assert rollout.error is None and rollout.terminated, rollout.error
    (first, first_action), (second, second_action) = recording.calls
    assert list(rollout.actions) == [as_tokens(first_action), as_tokens(second_action)]
    assert not second_action.reset and rollout.env_metrics["agent_resets"] == 0
    # the second call's context is the first's prompt and sampled ids, then only what is new:
    # exactly the chat template's render of the history the agent sent back
    context = (first_action.prompt_delta_ids, first_action.token_ids, second_action.prompt_delta_ids)
    assert spelled(tiny_policy, *context) == tiny_policy.codec.render_text(second, ())
    replies = SEEN["train-0"]
    for reply, action in zip(replies, (first_action, second_action), strict=True):
        assert reply.choices[0].message.content == action.text == tiny_policy.codec.action_text(action.token_ids)
        assert reply.usage.completion_tokens == len(action.token_ids)
    assert rollout.messages[-1] == {"role": "assistant", "content": second_action.text}
    assert rollout.step_metadata[-1] == {"agent_result": second_action.text}
    assert rollout.policy_version == tiny_policy.version and rollout.turns == 2


def test_a_rewritten_history_starts_a_new_sample(tiny_policy: Any) -> None:
    recording = RecordingPolicy(tiny_policy)
    rollout = play_one(agent_handle("rewrites_history"), recording)
    assert rollout.error is None and rollout.terminated
    (_, first_action), (second, second_action) = recording.calls
    assert [a.reset for a in rollout.actions] == [False, True]
    assert rollout.env_metrics["agent_resets"] == 1 and rollout.env_metrics["agent_calls"] == 2
    assert spelled(tiny_policy, second_action.prompt_delta_ids) == tiny_policy.codec.render_text(second, ())
    assert [m["content"] for m in rollout.messages] == ["Forget that. How many crates are at depot 0?", second_action.text]


# ---------------------------------------------------------------- (b) tools


def test_a_protocol_call_becomes_openai_tool_calls_and_a_malformed_one_stays_text() -> None:
    text = 'Let me look.\n<tool_call>{"name": "lookup", "arguments": {"key": "crates"}}</tool_call>'
    reply = reply_for(text, cut_by_length=False, call_number=3, reads_tools=True)
    call = {"id": "call_3_0", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "crates"}'}}
    assert reply.message == {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}
    assert reply.finish_reason == "tool_calls" and reply.parse_error is None
    assert reply.transcript_message == {"role": "assistant", "content": text, "tool_calls": [call]}
    broken = reply_for('<tool_call>{"name": "lookup"', cut_by_length=True, call_number=0, reads_tools=True)
    assert broken.message == {"role": "assistant", "content": '<tool_call>{"name": "lookup"'}
    assert broken.finish_reason == "length" and "never closed" in (broken.parse_error or "")
    untouched = reply_for(text, cut_by_length=False, call_number=0, reads_tools=False)  # tool_choice "none"
    assert untouched.message == {"role": "assistant", "content": text} and untouched.parse_error is None


def test_a_qwen_template_renders_the_agents_tools_and_the_episode_stays_one_sample(tiny_model_dir: Path) -> None:
    """tools= through the real client reach the model as the chat template writes them (its
    "# Tools" block and <tool_call> instructions, not rollflow's protocol), and the echoed
    reply re-renders to the sampled tokens. (A random model writes no calls: the parsing of
    replies in the template's format is test_tool_formats' and the scripted test below.)"""
    from rollflow.policy.models import ModelRef, load_causal_lm
    from rollflow.policy.transformers_backend import TransformersPolicy

    model, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    tokenizer.chat_template = (Path(__file__).parent / "templates" / "qwen2.5-instruct.jinja").read_text()
    qwen = TransformersPolicy(model, tokenizer, SamplingSettings(max_completion_tokens=12, max_model_length=1024))
    recording = RecordingPolicy(qwen)
    rollout = play_one(agent_handle("uses_a_tool"), recording)
    assert rollout.error is None and rollout.terminated, rollout.error
    (first, first_action), (second, second_action) = recording.calls
    tools = template_tools([LOOKUP])
    prompt = spelled(qwen, first_action.prompt_delta_ids)
    assert prompt == qwen.codec.render_text(first, tools)
    assert "Answer briefly.\n\n# Tools" in prompt and '<tools>\n{"type": "function", "function": {"name": "lookup"' in prompt
    assert describe_tools([LOOKUP]) not in prompt and "<tool_call>\n{\"name\": <function-name>" in prompt
    assert not second_action.reset and rollout.env_metrics["agent_resets"] == 0
    context = (first_action.prompt_delta_ids, first_action.token_ids, second_action.prompt_delta_ids)
    assert spelled(qwen, *context) == qwen.codec.render_text(second, tools)
    assert [m["tool_format"] for m in rollout.step_metadata[:2]] == ["hermes", "hermes"]


@pytest.mark.parametrize(("tool_format", "written", "call_id"), [
    ("hermes", '<tool_call>\n{"name": "lookup", "arguments": {"key": "crates"}}\n</tool_call>', "call_0_0"),
    ("mistral", '[TOOL_CALLS][{"name": "lookup", "arguments": {"key": "crates"}}]', "call00000"),
])  # fmt: skip
def test_a_call_in_the_models_own_format_comes_back_as_openai_tool_calls(
    tool_format: str, written: str, call_id: str
) -> None:
    seen: list[list[Message]] = []

    def script(messages: Sequence[Message], turn: int) -> str:
        seen.append(list(messages))
        return written if turn == 0 else "17"

    policy = ScriptedPolicy(script)
    rollout = play_one(agent_handle("uses_a_tool", tool_format=tool_format), policy)
    assert rollout.error is None and rollout.terminated and rollout.response_text == "17"
    first, _ = SEEN["train-0"]
    (call,) = first.choices[0].message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (call_id, "lookup", {"key": "crates"})
    assert first.choices[0].finish_reason == "tool_calls"
    assert seen[0][0] == {"role": "system", "content": "Answer briefly."}  # the template describes the tools
    assert policy.opened_tool_specs == [template_tools([LOOKUP])]
    assert all(isinstance(spec, TemplateTool) for spec in policy.opened_tool_specs[0])
    echoed: Message = {"role": "assistant", "content": written}  # hermes: the sampled text, re-rendered as is
    if tool_format == "mistral":  # its template must print the calls itself (and adds their ids)
        echoed["tool_calls"] = [call.model_dump()]
    assert seen[1][2:] == [echoed, {"role": "tool", "content": "17", "tool_call_id": call_id, "name": "lookup"}]
    assert rollout.messages[2] == {"role": "assistant", "content": written, "tool_calls": [call.model_dump()]}


def test_new_tools_mid_episode_open_a_new_session_and_count_a_reset() -> None:
    policy = ScriptedPolicy(lambda messages, turn: "fine")
    rollout = play_one(agent_handle("changes_its_tools", tool_format="hermes"), policy)
    assert rollout.error is None and rollout.terminated
    assert policy.opened_tool_specs == [template_tools([LOOKUP]), template_tools([LOOKUP, GAME_TOOL_SPECS[0]])]
    assert [m["reset"] for m in rollout.step_metadata[:2]] == [False, True]
    assert rollout.env_metrics["agent_resets"] == 1
    with pytest.raises(ValueError, match="tool_format='xml' is not one of auto"):
        agent_handle("changes_its_tools", tool_format="xml")


def test_agent_messages_become_the_native_games_messages() -> None:
    sent = [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "k"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "17"},
    ]  # fmt: skip
    assert list(transcript_messages(sent)) == [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "", "tool_calls": sent[1]["tool_calls"]},
        {"role": "tool", "content": "17", "tool_call_id": "c1", "name": "lookup"},  # as run_tool_calls writes it
    ]
    with pytest.raises(RequestError, match="tool_call_id"):
        transcript_messages([{"role": "tool", "content": "17"}])
    with pytest.raises(RequestError, match="n=2") as refused:
        parse_request({"messages": sent, "n": 2}, None)
    assert refused.value.param == "n"


def test_a_tool_call_round_trip_through_the_real_client() -> None:
    seen: list[list[Message]] = []

    def script(messages: Sequence[Message], turn: int) -> str:
        seen.append(list(messages))
        return '<tool_call>{"name": "lookup", "arguments": {"key": "crates"}}</tool_call>' if turn == 0 else "17"

    rollout = play_one(agent_handle("uses_a_tool"), ScriptedPolicy(script))
    assert rollout.error is None and rollout.terminated and rollout.response_text == "17"
    first, second = SEEN["train-0"]
    (call,) = first.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"key": "crates"})
    assert first.choices[0].finish_reason == "tool_calls" and second.choices[0].finish_reason == "stop"
    assert "lookup: Look up the value of one fact" in seen[0][0]["content"]  # the protocol's tool list
    raw = '<tool_call>{"name": "lookup", "arguments": {"key": "crates"}}</tool_call>'
    assert seen[1][2:] == [  # the raw sampled text back in place, the result named after its call
        {"role": "assistant", "content": raw, "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": "17", "tool_call_id": call.id, "name": "lookup"},
    ]
    assert [m["tools"] for m in rollout.step_metadata[:2]] == [["lookup"], []]


@pytest.mark.parametrize(("agent", "worked_example"), [("run", True), ("run_without_example", False)])
def test_the_example_agent_plays_the_native_games_prompt_and_the_expert_wins(
    tiny_model_dir: Path, agent: str, worked_example: bool
) -> None:
    """Each of the example's agents opens with the very prompt of the native game it mirrors
    (with or without the worked example), so the agent's learning run and the native game's
    are the same task through different doors."""
    from rollflow.policy.codec import ChatCodec
    from rollflow.policy.models import ModelRef, load_tokenizer
    from rollflow.tasks.prompts import opening_prompt

    example = "rollflow.envs.openai_agent_example"
    handle = load_environment_handle(SPEC, {"agent": f"{example}.agent:{agent}", "tasks": f"{example}.game:tasks",
                                            "reward": f"{example}.game:reward"})  # fmt: skip
    native = load_environment_handle("rollflow.envs.tool_use_game:load_environment", {"worked_example": worked_example})
    item, native_item = handle.tasks("train")[0], native.tasks("train")[0]
    assert item.task_id == native_item.task_id
    codec = ChatCodec(load_tokenizer(ModelRef(path=str(tiny_model_dir))))
    assert codec.render_text(*opening_prompt(SPEC, handle, item)) == codec.render_text(*opening_prompt("game", native, native_item))
    train, _ = generate_examples(0, 200, 50)
    items = handle.tasks("train")[:2]
    groups = asyncio.run(play_groups(handle, items, 1, expert_policy(train[:2]), EpisodeLimits(), 2))
    scores = [asyncio.run(handle.score(item, group))[0] for item, group in zip(items, groups, strict=True)]
    assert [(s.reward, s.threshold, s.components["correct"]) for s in scores] == [(1.0, 0.8, 1.0)] * 2



@pytest.mark.parametrize("template", ["qwen2.5-instruct.jinja", "llama-3.1-instruct.jinja"])
def test_preflight_measures_the_prompt_in_the_format_the_models_template_gives_it(
    tiny_model_dir: Path, tmp_path: Path, template: str
) -> None:
    """Preflight's probe had no chat template, so it measured the example agent's prompt in
    rollflow's protocol whatever the model: for a Qwen model the hermes prompt training gives
    (its template's tools block) went unmeasured, and for Llama 3.1, whose template refuses
    the worked example's two calls in one reply, every episode would fail at its first action
    while preflight passed. Now the first is measured as given and the second refused in a line."""
    import shutil

    from transformers import AutoTokenizer

    from rollflow.config.checks import PreflightError
    from rollflow.config.run import EnvConfig, RunConfig
    from rollflow.policy.codec import ChatCodec
    from rollflow.tasks.prompts import prompt_tokens

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = (Path(__file__).parent / "templates" / template).read_text()
    tokenizer.save_pretrained(str(model_dir))
    example = "rollflow.envs.openai_agent_example"
    kwargs = {"agent": f"{example}.agent:run", "tasks": f"{example}.game:tasks", "reward": f"{example}.game:reward"}
    config = RunConfig(env=EnvConfig(SPEC, kwargs))
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(model_dir)))
    handle = load_environment_handle(SPEC, kwargs)
    item = handle.tasks("train")[0]
    if template.startswith("llama"):
        with pytest.raises(PreflightError, match="only supports single tool-calls at once") as refused:
            prompt_tokens(config, handle, item)
        assert f"task {item.task_id!r} cannot start: its opening prompt does not render" in str(refused.value)
        assert "\n" not in str(refused.value)
        return
    codec = ChatCodec(tokenizer)
    seen: list[list[Message]] = []
    policy = ScriptedPolicy(lambda messages, turn: seen.append(list(messages)) or "42")
    policy.codec = codec  # type: ignore[attr-defined]  # a policy rendering with this template, as in training
    asyncio.run(handle.play(item, policy, EpisodeLimits(max_turns=1)))
    assert prompt_tokens(config, handle, item) == len(codec.render_prompt_ids(seen[0], policy.opened_tool_specs[0]))
    assert all(isinstance(spec, TemplateTool) for spec in policy.opened_tool_specs[0])  # hermes: the template's tools


def test_rollflow_export_of_an_agent_run_in_a_familys_format_says_what_its_serving_md_holds(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command said "trained with tools in its system prompt" of every export with a
    SERVING.md; an agent trained in the hermes format had its tools rendered by the chat
    template, never in its system prompt."""
    from test_export import run_with_checkpoints
    from test_serving_md import agent_run, family_model

    from rollflow.flows.cli import main

    source = run_with_checkpoints(tmp_path / "run", tiny_model_dir, use_lora=True, steps=1)
    model = family_model(tiny_model_dir, tmp_path / "model", "qwen2.5-instruct.jinja")
    run = agent_run(source, tmp_path / "agent-run", model_dir=model)
    out = tmp_path / "adapter"
    assert main(["export", str(run.root), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Tool-call format: `hermes`." in (out / "SERVING.md").read_text()
    assert f"  {out / 'SERVING.md'} says how to serve it as it was trained\n" in printed
    assert "system prompt" not in printed


# ---------------------------------------------------------------- (c) failures


def test_an_agent_that_raises_is_its_episodes_error_with_a_traceback() -> None:
    with keeping_tracebacks() as kept:
        rollout = play_one(agent_handle("raises"), ScriptedPolicy(lambda m, t: "hi"))
    assert rollout.error == f"ValueError: the agent broke on purpose (in {HERE}:raises)"
    assert "in raises" in kept[rollout.error] and "the agent broke on purpose" in kept[rollout.error]
    assert rollout.turns == 1  # what it sampled before is still on the record


def test_a_failing_policy_is_the_episodes_error_whatever_the_agent_does() -> None:
    def script(messages: Sequence[Message], turn: int) -> str:
        raise RuntimeError("the generator died")

    rollout = play_one(agent_handle("two_calls"), ScriptedPolicy(script))
    assert rollout.error == "RuntimeError: the generator died (in PolicySession.act)"  # not the agent's 500
    assert rollout.messages == tuple(opening({"question": "How many crates are at depot 0?"}))


def test_a_reward_dict_is_a_total_a_threshold_and_components() -> None:
    score = episode_score({"reward": 0.85, "threshold": 0.8, "correct": 1, "lookups": 0.5}, "r")
    assert (score.reward, score.threshold, dict(score.components)) == (0.85, 0.8, {"correct": 1.0, "lookups": 0.5})
    assert episode_score(0.5, "r").reward == 0.5 and episode_score({"score": 1}, "r").reward == 1.0
    with pytest.raises(ValueError, match="neither"):
        episode_score({"correct": 1.0}, "r")
    with pytest.raises(ValueError, match="finite number"):
        episode_score({"reward": float("nan")}, "r")


def test_refused_requests_are_clear_and_the_episode_goes_on() -> None:
    policy = ScriptedPolicy(lambda messages, turn: "fine")
    policy.settings = SamplingSettings(max_completion_tokens=16)  # what a run's policy carries
    rollout = play_one(agent_handle("asks_what_is_refused"), policy)
    assert rollout.error is None and rollout.terminated and rollout.env_metrics["agent_calls"] == 1
    refused, models, answer, headers = SEEN["train-0"]
    assert [status for status, _ in refused] == [400, 400, 400, 400, 400, 401]
    for (_, message), named in zip(refused, ["stream", "n=2", "tool_choice", "stop", "max_tokens=1"], strict=False):
        assert named in message
    assert "unknown API key" in refused[-1][1] and models == ["rollflow-policy"]
    assert answer.choices[0].message.content == "fine"
    assert headers["x-rollflow-ignored"] == "seed,temperature" and headers["x-rollflow-max-tokens"] == "16"


def test_a_call_past_the_budget_truncates_the_episode() -> None:
    rollout = play_one(agent_handle("loops_forever", max_calls=5), ScriptedPolicy(lambda m, t: "more"), max_turns=3)
    assert rollout.error is None and rollout.truncation_cause == TruncationCause.MAX_TURNS
    assert rollout.turns == 3 and rollout.env_metrics["agent_calls"] == 3
    assert "call budget of 3 calls is spent" in rollout.step_metadata[-1]["agent_after_cut"]


def test_a_spent_context_truncates_the_episode() -> None:
    spent = PolicyAction(text="", finish_reason="context", sampling_attempts=0)
    rollout = play_one(agent_handle("two_calls"), ScriptedPolicy(lambda m, t: spent))
    assert rollout.error is None and rollout.truncation_cause == TruncationCause.CONTEXT_OVERFLOW


@pytest.mark.parametrize("agent", ["hangs", "hangs_sync"])
def test_an_agent_that_hangs_is_an_error_not_a_stuck_step(agent: str) -> None:
    started = time.perf_counter()
    rollout = play_one(agent_handle(agent, agent_timeout_s=0.5), ScriptedPolicy(lambda m, t: "hi"))
    assert rollout.error is not None and rollout.error.startswith("TimeoutError: the agent neither called")
    assert time.perf_counter() - started < 10
    if agent == "hangs":
        assert "it waits in hangs" in rollout.error


def test_a_cancelled_rollout_leaves_no_server_and_no_agent_task() -> None:
    """What Ctrl-C does to a chunk (asyncio.run cancels its episodes): nothing is left."""
    handle = agent_handle("hangs")  # no agent_timeout_s: it would wait for the run's 600 s

    async def scenario() -> list[asyncio.Task[Any]]:
        SEEN.pop("train-0", None)
        with pytest.raises(TimeoutError):
            limits = EpisodeLimits()
            await asyncio.wait_for(play_groups(handle, handle.tasks("train")[:1], 2, ScriptedPolicy(lambda m, t: "hi"), limits, 2), 1.0)
        await asyncio.sleep(0.5)  # the server's shutdown, by itself (asyncio.run would sweep up the rest)
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run(scenario()) == []
    base_url = SEEN["train-0"][0]
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_a_call_still_running_when_the_agent_returns_is_an_error() -> None:
    rollout = play_one(agent_handle("leaves_a_call_running"), ScriptedPolicy(lambda m, t: "slow", delay_s=1.0))
    assert rollout.error == (f"RuntimeError: the agent returned while 1 of its calls were still running "
                             f"(in {HERE}:leaves_a_call_running)")  # fmt: skip
    (left,) = SEEN["train-0"]
    assert isinstance(left.exception(), openai.APIConnectionError)  # its client was closed under it


def test_calls_after_the_agent_returned_are_refused_and_no_server_is_left() -> None:
    async def scenario() -> tuple[int, str, bool]:
        policy = ScriptedPolicy(lambda m, t: "hi")
        async with SharedEndpoint().lease() as endpoint:
            episode = AgentEpisode(policy.open_session, EpisodeTrace(policy), budget=4,
                                   run_max_tokens=None, system_prompt=None)  # fmt: skip
            endpoint.register(episode)
            episode.closed = True  # its agent returned
            client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=episode.key, max_retries=0)
            try:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            except openai.APIStatusError as exc:
                status, message = exc.status_code, exc.message
            finally:
                await client.close()
        port = int(endpoint.base_url.rsplit(":", 1)[1].split("/")[0])
        try:  # the last lease released: nothing listens there any more
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return status, message, False
        except ConnectionRefusedError:
            return status, message, True

    status, message, closed = asyncio.run(scenario())
    assert status == 410 and "its agent returned" in message and closed


# ---------------------------------------------------------------- (d) a real run


@pytest.mark.slow
def test_two_steps_of_rollflow_train_on_the_example_agent(
    tiny_model_dir: Path, tmp_path: Path, prefect_harness: object
) -> None:
    example = "rollflow.envs.openai_agent_example"
    kwargs = {"agent": f"{example}.agent:run", "tasks": f"{example}.game:tasks", "reward": f"{example}.game:reward"}
    run_dir = train_tiny_on(tiny_model_dir, tmp_path, SPEC, kwargs, max_turns=2)
    con = open_run_sql(run_dir)
    _, rows = run_query(
        con,
        "SELECT e.step, count(*), count_if(e.error IS NULL), count_if(e.num_actions BETWEEN 1 AND 2), "
        "count_if(e.task_id LIKE 'tool_use_game/seed=0/%') "
        "FROM episodes e JOIN scores s USING (run_id, split, step, episode_id) WHERE e.split = 'train' "
        "GROUP BY ALL ORDER BY ALL",
    )
    assert rows == [(0, 4, 4, 4, 4), (1, 4, 4, 4, 4)]
    _, samples = run_query(con, "SELECT count(*) > 0 FROM samples")
    _, steps = run_query(con, "SELECT count(*) FROM steps")
    assert samples == [(True,)] and steps == [(2,)]
