"""The OpenAI-compatible backend against a canned local server (127.0.0.1 only).

The server answers from a queue of (status, JSON body, delay) and records each request, so
the tests check what we send and how we read every shape of answer, not a model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from json_server import json_server

from rollflow.envs.agent import PolicyAction
from rollflow.envs.protocol import describe_tools, parse_action
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.openai_backend import OpenAIChatPolicy, OpenAIPolicyError
from rollflow.policy.sampling import SamplingSettings

LOOKUP: ToolSpec = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a fact by key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}
QUESTION: list[Message] = [{"role": "user", "content": "How many crates?"}]


@dataclass
class CannedServer:
    answers: list[tuple[int, dict[str, Any], float]] = field(default_factory=list)
    requests: list[tuple[str, dict[str, str], dict[str, Any]]] = field(default_factory=list)
    base_url: str = ""

    def answer(self, body: dict[str, Any], status: int = 200, delay_s: float = 0.0) -> None:
        self.answers.append((status, body, delay_s))


@pytest.fixture
def server() -> Iterator[CannedServer]:
    canned = CannedServer()

    def answer(path: str, headers: Mapping[str, str], body: dict[str, Any]) -> tuple[int, Any, float]:
        canned.requests.append((path, dict(headers), body))
        return canned.answers.pop(0)

    with json_server(answer) as url:
        canned.base_url = f"{url}/v1"
        yield canned


def completion(
    content: str | None,
    *,
    finish: str = "stop",
    token_ids: list[int] | None = None,
    logprob_tokens: list[str] | None = None,
    prompt_ids: list[int] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    total_tokens: int = 50,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if logprob_tokens is not None:
        entries = [{"token": t, "logprob": -0.5 * (i + 1)} for i, t in enumerate(logprob_tokens)]
        choice["logprobs"] = {"content": entries}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body: dict[str, Any] = {"id": "c1", "object": "chat.completion", "choices": [choice]}
    body["usage"] = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": total_tokens}
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    return body


async def act_all(
    policy: OpenAIChatPolicy, turns: Sequence[list[Message]], tools: list[ToolSpec]
) -> list[PolicyAction]:
    session = policy.open_session(tools)
    try:
        return [await session.act(messages) for messages in turns]
    finally:
        await session.close()


def test_request_carries_messages_tools_sampling_and_the_api_key(
    server: CannedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_KEY", "sk-test")
    server.answer(completion("Twelve."))
    settings = SamplingSettings(temperature=0.7, top_p=0.9, max_completion_tokens=33, seed=4)
    policy = OpenAIChatPolicy(server.base_url + "/", "smol", api_key_env="MY_KEY", settings=settings)
    [action] = asyncio.run(act_all(policy, [QUESTION], [LOOKUP]))
    path, headers, body = server.requests[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer sk-test"
    assert body["model"] == "smol" and body["messages"] == QUESTION and body["tools"] == [LOOKUP]
    assert (body["temperature"], body["top_p"], body["max_completion_tokens"]) == (0.7, 0.9, 33)
    assert body["logprobs"] is True and body["return_token_ids"] is True
    assert body["return_tokens_as_token_ids"] is True and isinstance(body["seed"], int)
    assert action.text == "Twelve." and action.finish_reason == "stop" and action.token_ids == ()


def test_plain_openai_request_and_tools_in_the_system_prompt(
    server: CannedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server.answer(completion("Twelve."))
    policy = OpenAIChatPolicy(
        server.base_url, "smol", vllm_extensions=False, tools_in_system_prompt=True
    )
    asyncio.run(act_all(policy, [QUESTION], [LOOKUP]))
    _, headers, body = server.requests[0]
    assert "Authorization" not in headers and "tools" not in body
    assert "return_token_ids" not in body and "return_tokens_as_token_ids" not in body
    assert body["messages"] == [{"role": "system", "content": describe_tools([LOOKUP])}, *QUESTION]


def test_vllm_token_ids_give_exact_tokens_and_prompt_deltas(server: CannedServer) -> None:
    first_prompt, second_prompt = [1, 2, 3], [1, 2, 3, 7, 8, 2, 5, 6]
    server.answer(
        completion("Hi", token_ids=[7, 8, 2], logprob_tokens=["a", "b", "c"], prompt_ids=first_prompt)
    )
    server.answer(completion("Yes", token_ids=[9, 2], logprob_tokens=["d", "e"], prompt_ids=second_prompt))
    server.answer(completion("Ok", token_ids=[4], logprob_tokens=["f"], prompt_ids=[1, 2, 99]))
    second = [*QUESTION, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Sure?"}]
    third = [*second, {"role": "assistant", "content": "Yes"}, {"role": "user", "content": "Go"}]
    policy = OpenAIChatPolicy(server.base_url, "m")
    actions = asyncio.run(act_all(policy, [QUESTION, second, third], []))
    assert [a.token_ids for a in actions] == [(7, 8, 2), (9, 2), (4,)]
    assert actions[0].logprobs == (-0.5, -1.0, -1.5)
    assert [a.prompt_delta_ids for a in actions] == [(1, 2, 3), (5, 6), (1, 2, 99)]
    assert [a.reset for a in actions] == [False, False, True]  # turn 3 rewrote history
    assert server.requests[1][2]["messages"] == second


def test_token_ids_are_read_from_logprob_tokens_and_dropped_when_unknown(server: CannedServer) -> None:
    server.answer(completion("Hi", logprob_tokens=["token_id:11", "token_id:2"]))
    server.answer(completion("Hi", logprob_tokens=["Hi", "<|im_end|>"]))  # a hosted model
    actions = asyncio.run(act_all(OpenAIChatPolicy(server.base_url, "m"), [QUESTION, QUESTION], []))
    assert actions[0].token_ids == (11, 2) and actions[0].logprobs == (-0.5, -1.0)
    assert actions[1].token_ids == () and actions[1].logprobs == () and actions[1].text == "Hi"


def test_server_parsed_tool_calls_come_back_as_protocol_text(server: CannedServer) -> None:
    function = {"name": "lookup", "arguments": '{"key": "depot"}'}
    call = {"id": "call_x", "type": "function", "function": function}
    server.answer(completion(None, finish="tool_calls", tool_calls=[call]))
    [action] = asyncio.run(act_all(OpenAIChatPolicy(server.base_url, "m"), [QUESTION], [LOOKUP]))
    parsed = parse_action(action.text)
    assert action.finish_reason == "stop" and parsed.kind == "tool_calls"
    assert parsed.tool_calls[0]["function"]["name"] == "lookup"
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"key": "depot"}


def test_length_endings_and_a_refused_long_conversation(server: CannedServer) -> None:
    settings = SamplingSettings(max_model_length=100)
    server.answer(completion("partial", finish="length", total_tokens=60))
    server.answer(completion("partial", finish="length", total_tokens=100))
    context_error = {"error": {"message": "This model's maximum context length is 100 tokens."}}
    server.answer(context_error, status=400)
    policy = OpenAIChatPolicy(server.base_url, "m", settings=settings)
    actions = asyncio.run(act_all(policy, [QUESTION] * 3, []))
    assert [a.finish_reason for a in actions] == ["length", "context", "context"]
    assert actions[2].text == "" and actions[2].token_ids == ()
    assert len(server.requests) == 3  # a refused context is not retried


def test_transient_failures_are_retried_then_reported(server: CannedServer) -> None:
    # a timeout a busy machine's local round trip stays well inside, and answers slower than it
    settings = SamplingSettings(max_sampling_attempts=2, generation_timeout_s=1.0)
    server.answer({"error": {"message": "overloaded"}}, status=503)
    server.answer(completion("Done."))
    policy = OpenAIChatPolicy(server.base_url, "m", settings=settings)
    [action] = asyncio.run(act_all(policy, [QUESTION], []))
    assert action.text == "Done." and action.sampling_attempts == 2
    seeds = [body["seed"] for _, _, body in server.requests]
    assert seeds[0] != seeds[1]  # a retry is a fresh draw

    server.answer(completion("late"), delay_s=3.0)
    server.answer(completion("late"), delay_s=3.0)
    with pytest.raises(OpenAIPolicyError, match="all 2 attempts failed.*generation_timeout_s=1"):
        asyncio.run(act_all(policy, [QUESTION], []))
    assert server.requests[2][2]["seed"] not in seeds  # the same question again: a new episode
    policy.reseed(0)
    server.answer(completion("Again."))
    asyncio.run(act_all(policy, [QUESTION], []))
    assert server.requests[-1][2]["seed"] == seeds[0]  # reseeded: it starts over


def test_client_errors_are_not_retried_and_name_the_reason(server: CannedServer) -> None:
    server.answer({"error": {"message": "invalid api key"}}, status=401)
    server.answer({"choices": []})
    policy = OpenAIChatPolicy(server.base_url, "m")
    with pytest.raises(OpenAIPolicyError, match="HTTP 401: invalid api key"):
        asyncio.run(act_all(policy, [QUESTION], []))
    with pytest.raises(OpenAIPolicyError, match="no chat completion choice"):
        asyncio.run(act_all(policy, [QUESTION], []))
    assert len(server.requests) == 2


def test_bad_construction_is_refused() -> None:
    with pytest.raises(ValueError, match="base_url"):
        OpenAIChatPolicy("localhost:8000", "m")
    with pytest.raises(ValueError, match="model"):
        OpenAIChatPolicy("http://127.0.0.1:1/v1", "")
