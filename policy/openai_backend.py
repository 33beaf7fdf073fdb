"""A policy behind an OpenAI-compatible chat-completions server (vLLM, or a hosted model).

For scoring a served model without training: each ``act`` posts the transcript and the
tool specs to ``{base_url}/chat/completions`` and turns the answer into a
``PolicyAction``. Tokens come back only when the server gives them; vLLM does when asked
(``vllm_extensions=True``, the default):

- ``return_token_ids``: the choice carries ``token_ids`` and the response
  ``prompt_token_ids``; with the previous turn's prompt and action the session computes
  ``prompt_delta_ids`` (a new prompt that does not extend them gives ``reset=True``);
- ``logprobs`` + ``return_tokens_as_token_ids``: per-token logprobs whose tokens read
  ``token_id:123``, so ids are known even without ``token_ids``.

A hosted OpenAI model returns text and logprobs over token strings; the action then
carries text only (``token_ids`` and ``logprobs`` must pair up one to one).

Structured ``tool_calls`` parsed by the server are written back into the action text with
``rollflow.envs.protocol.render_tool_calls``, so the runner reads every model the same way.

Endings follow ``rollflow.policy.session.finish_reason``: ``stop`` / ``tool_calls`` ->
``"stop"``; ``length`` -> ``"length"``, or ``"context"`` when the usage shows the episode
reached ``max_model_length``; a request the server refuses because the conversation no
longer fits its context -> ``"context"`` with no tokens. Seeds are the other backends'
(``SeededPolicy``), 31-bit; a server may ignore them. Timeouts (``generation_timeout_s``),
connection errors, 408, 429 and 5xx are retried (``rollflow.policy.retries``) up to
``max_sampling_attempts``; other errors raise ``OpenAIPolicyError`` at once with the
server's message.

Simplifications, and why:
- The server's chat template renders the conversation, so token exactness is only as
  good as the server's re-rendering; that is why this backend is for evaluation.
- ``tools_in_system_prompt=True`` puts ``describe_tools`` into the system prompt for a
  served model whose template ignores ``tools`` (SmolLM2 on vLLM); the server cannot be
  asked whether it does, so the caller says.
- No streaming: one response per action is all an episode needs.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rollflow.envs.agent import FinishReason, PolicyAction, capped_completion
from rollflow.envs.protocol import describe_tools, render_tool_calls
from rollflow.envs.types import Message, ToolCall, ToolSpec
from rollflow.policy.codec import with_tools_in_system_prompt
from rollflow.policy.retries import RetriesExhausted, post_with_retries, server_error_message
from rollflow.policy.sampling import SamplingSettings
from rollflow.policy.session import GenerationError, SeededPolicy, finish_reason

_CONTEXT_ERROR = re.compile(r"context length|context window|maximum context|too long", re.I)
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


class OpenAIPolicyError(GenerationError):
    """The server refused or failed a request; the message names the URL and the reason."""


class _ContextExceeded(Exception):
    """The server said the conversation does not fit its context (internal)."""


@dataclass(frozen=True)
class _Completion:
    """One parsed chat-completion choice."""

    text: str
    finish_reason: FinishReason
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_ids: tuple[int, ...] | None


class OpenAIChatPolicy(SeededPolicy):
    """A ``Policy`` (envs/agent.py) served by an OpenAI-compatible chat-completions API."""

    seed_bits = 31

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        settings: SamplingSettings | None = None,
        *,
        version: int = 0,
        vllm_extensions: bool = True,
        tools_in_system_prompt: bool = False,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if not model:
            raise ValueError("model must name the served model")
        super().__init__(settings, version)
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self.vllm_extensions = vllm_extensions
        self.tools_in_system_prompt = tools_in_system_prompt

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> OpenAIChatSession:
        return OpenAIChatSession(self, tuple(tool_specs))

    def headers(self) -> dict[str, str]:
        """The API key is read from the environment per request; none is sent if unset."""
        key = os.environ.get(self.api_key_env)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def request_body(
        self, messages: Sequence[Message], tool_specs: Sequence[ToolSpec], seed: int
    ) -> dict[str, Any]:
        settings = self.settings
        sent = list(messages)
        if tool_specs and self.tools_in_system_prompt:
            sent = with_tools_in_system_prompt(sent, describe_tools(tool_specs))
        body: dict[str, Any] = {
            "model": self.model,
            "messages": sent,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "max_completion_tokens": capped_completion(settings.max_completion_tokens),
            "seed": seed,
            "logprobs": True,
        }
        if tool_specs and not self.tools_in_system_prompt:
            body["tools"] = list(tool_specs)
        if self.vllm_extensions:
            body["return_token_ids"] = True
            body["return_tokens_as_token_ids"] = True
        return body


class OpenAIChatSession:
    """One episode against the server (a ``PolicySession``); owns one HTTP client."""

    def __init__(self, policy: OpenAIChatPolicy, tool_specs: tuple[ToolSpec, ...]):
        self._policy = policy
        self._episode: tuple[int, int] | None = None  # seed identity, from the first request
        self._tool_specs = tool_specs
        self._client: httpx.AsyncClient | None = None
        self._context: tuple[int, ...] | None = None  # last prompt + action, when known
        self._turn = 0

    async def act(self, messages: Sequence[Message]) -> PolicyAction:
        started = time.perf_counter()
        turn, self._turn = self._turn, self._turn + 1
        try:
            completion, attempts = await self._complete(messages, turn)
        except _ContextExceeded:  # the server refused: the conversation no longer fits
            latency_s = time.perf_counter() - started
            return PolicyAction(text="", finish_reason="context", latency_s=latency_s)
        delta, reset = self._prompt_delta(completion.prompt_ids)
        if completion.prompt_ids is not None:
            self._context = completion.prompt_ids + completion.token_ids
        return PolicyAction(
            text=completion.text,
            token_ids=completion.token_ids,
            logprobs=completion.logprobs,
            prompt_delta_ids=delta,
            reset=reset,
            finish_reason=completion.finish_reason,
            latency_s=time.perf_counter() - started,
            sampling_attempts=attempts,
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _prompt_delta(self, prompt_ids: tuple[int, ...] | None) -> tuple[tuple[int, ...], bool]:
        if prompt_ids is None:
            return (), False
        previous = self._context
        if previous is not None and prompt_ids[: len(previous)] == previous:
            return prompt_ids[len(previous) :], False
        return prompt_ids, previous is not None

    async def _complete(self, messages: Sequence[Message], turn: int) -> tuple[_Completion, int]:
        policy = self._policy
        if self._episode is None:
            opening = json.dumps([list(messages), list(self._tool_specs)], sort_keys=True)
            self._episode = policy.episode_seeds.identity(opening)
        episode = self._episode

        def body(attempt: int) -> dict[str, Any]:
            return policy.request_body(messages, self._tool_specs, policy.request_seed(episode, turn, attempt))

        settings = policy.settings
        try:
            posted = await post_with_retries(
                self._http(), (policy.url,), body, attempts=settings.max_sampling_attempts,
                headers=policy.headers(),
                timeout_reason=f"no answer within generation_timeout_s={settings.generation_timeout_s}",
            )  # fmt: skip
        except RetriesExhausted as failed:
            raise OpenAIPolicyError(
                f"{policy.url}: all {failed.attempts} attempts failed; last: {failed.reason}"
            ) from None
        return _parse_response(policy.url, posted.response, policy.settings), posted.attempt

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._policy.settings.generation_timeout_s)
        return self._client


def _parse_response(url: str, response: httpx.Response, settings: SamplingSettings) -> _Completion:
    if response.status_code != 200:
        message = server_error_message(response)
        if response.status_code == 400 and _CONTEXT_ERROR.search(message):
            raise _ContextExceeded(message)
        raise OpenAIPolicyError(f"{url} answered HTTP {response.status_code}: {message}")
    try:
        payload = response.json()
        choice = payload["choices"][0]
        message = choice["message"]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        sent = response.text[:300]
        raise OpenAIPolicyError(f"{url} sent no chat completion choice: {sent!r}") from error
    token_ids, logprobs = _sampled_tokens(choice)
    prompt_ids = payload.get("prompt_token_ids")
    return _Completion(
        text=_action_text(message),
        finish_reason=_finish_reason(choice.get("finish_reason"), payload.get("usage"), settings),
        token_ids=token_ids,
        logprobs=logprobs,
        prompt_ids=tuple(int(t) for t in prompt_ids) if isinstance(prompt_ids, list) else None,
    )


def _action_text(message: Mapping[str, Any]) -> str:
    """The content, with server-parsed tool calls written back in the protocol's blocks."""
    content = message.get("content") or ""
    calls: list[ToolCall] = message.get("tool_calls") or []
    if not calls:
        return content
    rendered = render_tool_calls(calls)
    return f"{content}\n{rendered}" if content else rendered


def _sampled_tokens(choice: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Ids and logprobs of the action, paired one to one, or nothing when they cannot be."""
    entries = (choice.get("logprobs") or {}).get("content") or []
    logprobs = tuple(float(entry["logprob"]) for entry in entries)
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        parsed = [_TOKEN_ID.match(str(entry.get("token", ""))) for entry in entries]
        ids = [int(match.group(1)) for match in parsed if match] if all(parsed) else None
    if not ids or len(ids) != len(logprobs):
        return (), ()
    return tuple(int(token) for token in ids), logprobs


def _finish_reason(
    reason: object, usage: Mapping[str, Any] | None, settings: SamplingSettings
) -> FinishReason:
    """The server's reason read by the one rule: anything but "length" ("stop", "tool_calls",
    a server's own name for an end of turn) is a stop; the usage tells whether the context is full."""
    total = (usage or {}).get("total_tokens")
    return finish_reason(
        stopped=reason != "length", cut_by_server=False,
        episode_tokens=total if isinstance(total, int) else None, max_model_length=settings.max_model_length,
    )  # fmt: skip
