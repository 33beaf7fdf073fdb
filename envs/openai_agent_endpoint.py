"""The capture endpoint: an OpenAI-compatible server in front of the run's policy.

``SharedEndpoint.lease()`` gives the episodes of one event loop one HTTP server on
127.0.0.1 (an ephemeral port): the first episode of a chunk starts it, the last one to
finish stops it, so a chunk's ``asyncio.run`` leaves no server, thread or socket behind.
It runs in that loop (uvicorn over starlette, without its signal handlers: Ctrl-C stays
the run's), next to the episodes and their agents.

Each episode registers an ``AgentEpisode`` under a random API key; the key attributes a
call to its episode and an unknown key is refused (401). An episode owns a
``PolicySession``: every call is ``session.act(messages)``, which renders only what is new
since the last call, so a call whose history extends the previous call's prompt and reply
continues one training sample, and one that rewrote history comes back with ``reset`` (a
new sample of the same episode, counted in ``agent_resets``). For that the reply's raw
sampled text is put back in place of the reply the agent echoes (``reply_key``). Calls of
one episode are served one at a time (a session is sequential).

Tools, by the episode's ``ToolFormat`` (``rollflow.envs.tool_formats``). rollflow's
protocol: one session with no tool specs, each call's tools described in its system
prompt. A native format: the session is opened with the call's tools for the chat template
to render (``template_tools``), and echoed replies reach it as the format's ``echo`` says
(``for_template``). A call whose tools differ from the session's gets a new session, and
its action counts as a reset: the template put the tools at the top of the prompt.

A policy that answers from the agent's own request rather than from the rendered prompt
(the SFT expert, ``rollflow.envs.openai_agent_expert``) reads ``serving_call()`` while it
acts: the request, the episode's tool format and the call's number. A model never does.

An episode's calls end it early in two ways, both truncations like the native loop's, not
errors: a call past the call budget (``max_turns``) and a spent context budget
(``context_overflow``); the call is refused (400) and every later one too. A policy that
fails is the episode's error (500 to the agent). Calls after the agent returned get 410.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollflow.envs.agent import PolicyAction, PolicySession
from rollflow.envs.handle import describe_error
from rollflow.envs.loop import EpisodeTrace
from rollflow.envs.openai_agent_messages import (
    ChatRequest,
    RequestError,
    for_template,
    parse_request,
    reply_for,
    reply_key,
    with_system_text,
)
from rollflow.envs.tool_formats import ROLLFLOW, ToolFormat, template_tools
from rollflow.envs.types import Message, ToolSpec, TruncationCause

MODEL_NAME = "rollflow-policy"
ENDED = "this episode has ended"


@dataclass(frozen=True)
class ServedCall:
    """The call whose reply the policy is acting on (``serving_call``)."""

    request: ChatRequest  # the agent's messages and tools, as it sent them
    tool_format: ToolFormat  # the episode's: how the reply is read
    number: int  # the call's number in the episode, from 0 (its reply's call ids use it)


_SERVING: contextvars.ContextVar[ServedCall | None] = contextvars.ContextVar("rollflow_served_call", default=None)


def serving_call() -> ServedCall | None:
    """The call being served, inside a policy's ``act`` run by the endpoint; else None."""
    return _SERVING.get()


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status, JSON body, extra headers."""

    status: int
    body: dict[str, Any]
    headers: Mapping[str, str] | None = None


def error_answer(status: int, message: str, param: str | None = None) -> Answer:
    kind = {401: "authentication_error", 500: "server_error"}.get(status, "invalid_request_error")
    return Answer(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})


class AgentEpisode:
    """One episode's calls: its session, its record (``trace``) and its endings.

    ``open_session`` is the policy's: the episode opens its session at its first call and
    again when a native format's tools change; ``close_session`` closes the last one.
    """

    def __init__(
        self, open_session: Callable[[Sequence[ToolSpec]], PolicySession], trace: EpisodeTrace, *,
        budget: int, run_max_tokens: int | None, system_prompt: str | None, tool_format: ToolFormat = ROLLFLOW,
    ) -> None:  # fmt: skip
        self.key = "rf-" + secrets.token_hex(16)
        self.trace, self.budget, self.tool_format = trace, budget, tool_format
        self.run_max_tokens, self.system_prompt = run_max_tokens, system_prompt
        self._open_session = open_session
        self._session: PolicySession | None = None
        self._session_tools: tuple[ToolSpec, ...] = ()
        self.calls = self.resets = self.parse_failures = self.in_flight = 0
        self.last_activity = time.monotonic()
        self.cut: TruncationCause | None = None  # rollflow ended it early (budget, context)
        self.error: str | None = None  # the policy failed
        self.closed = False  # the agent returned or was given up on
        self._lock = asyncio.Lock()
        self._raw_replies: dict[tuple[Any, ...], Message] = {}
        self._context_tokens = 0

    def idle_s(self) -> float:
        """Seconds the agent has spent outside the endpoint (0 while a call runs)."""
        return 0.0 if self.in_flight else time.monotonic() - self.last_activity

    async def close_session(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def metrics(self) -> dict[str, float]:
        return {"agent_calls": float(self.calls), "agent_resets": float(self.resets),
                "agent_parse_failures": float(self.parse_failures)}  # fmt: skip

    async def complete(self, body: object) -> Answer:
        """Serve one ``/v1/chat/completions`` request of this episode."""
        if self.closed:
            return error_answer(410, f"{ENDED}: its agent returned; calls after that are not recorded")
        self.in_flight += 1
        try:
            async with self._lock:
                return await self._complete(body)
        except RequestError as exc:
            return error_answer(exc.status, str(exc), exc.param)
        finally:
            self.in_flight -= 1
            self.last_activity = time.monotonic()

    async def _complete(self, body: object) -> Answer:
        if self.closed:  # it ended while this call waited for the one before it
            raise RequestError(f"{ENDED}: its agent returned; calls after that are not recorded", status=410)
        request = parse_request(body, self.run_max_tokens, self.tool_format)
        if self.error is not None or self.cut is not None:
            raise RequestError(f"{ENDED} ({self.error or self.cut}); no further calls are served")
        if self.calls >= self.budget:
            self.cut = TruncationCause.MAX_TURNS
            raise RequestError(f"{ENDED}: its call budget of {self.budget} calls is spent (max_calls / max_turns)")
        sent = with_system_text(request.messages, self.system_prompt or "")
        transcript = [self._raw_reply(m) for m in sent]
        self.calls += 1
        self.trace.messages = transcript  # what an error record shows if the policy fails
        self.trace.stage = "PolicySession.act"
        try:
            action = await self._act(sent, transcript, request)
            self.trace.record_action(action)
        except Exception as exc:  # the policy failed: the episode's error, the agent is told
            self.error = describe_error(exc, "PolicySession.act")
            return error_answer(500, f"the policy failed: {self.error}")
        return self._answer(action, transcript, request)

    async def _act(self, sent: list[Message], transcript: list[Message], request: ChatRequest) -> PolicyAction:
        """Sample this call's action with the episode's tool format (the module note)."""
        serving = _SERVING.set(ServedCall(request, self.tool_format, self.calls - 1))
        try:
            return await self._sample(sent, transcript, request)
        finally:
            _SERVING.reset(serving)

    async def _sample(self, sent: list[Message], transcript: list[Message], request: ChatRequest) -> PolicyAction:
        if not self.tool_format.in_template:
            session, replaced = await self._session_for(())
            return await session.act(with_system_text(transcript, request.tools_text))
        messages = [for_template(raw, self.tool_format) if raw is not m else m
                    for m, raw in zip(sent, transcript, strict=True)]  # fmt: skip
        session, replaced = await self._session_for(template_tools(request.tools))
        action = await session.act(messages)
        return dataclasses.replace(action, reset=True) if replaced else action

    async def _session_for(self, tools: tuple[ToolSpec, ...]) -> tuple[PolicySession, bool]:
        """The session for ``tools``, and whether it replaced one opened for other tools."""
        if self._session is not None and self._session_tools == tools:
            return self._session, False
        replaced = self._session is not None
        await self.close_session()
        self._session, self._session_tools = self._open_session(tools), tools
        return self._session, replaced

    def _answer(self, action: PolicyAction, transcript: list[Message], request: ChatRequest) -> Answer:
        """Record a sampled action on the episode and turn it into the agent's reply."""
        self.resets += action.reset
        prompt_tokens = (0 if action.reset else self._context_tokens) + len(action.prompt_delta_ids)
        self._context_tokens = prompt_tokens + len(action.token_ids)
        if action.finish_reason == "context":
            self.cut = TruncationCause.CONTEXT_OVERFLOW
            partial: list[Message] = [{"role": "assistant", "content": action.text}] if action.text else []
            self.trace.messages = [*transcript, *partial]
            raise RequestError(f"{ENDED}: the context budget is spent (max_model_length)", param="messages")
        reply = reply_for(action.text, cut_by_length=action.finish_reason == "length", call_number=self.calls - 1,
                          reads_tools=request.reads_calls, tool_format=self.tool_format)  # fmt: skip
        self._raw_replies[reply_key(reply.message)] = reply.transcript_message
        self.trace.messages = [*transcript, reply.transcript_message]
        self.parse_failures += reply.parse_error is not None
        self.trace.step_metadata.append({
            "call": self.calls - 1, "reset": action.reset, "finish_reason": reply.finish_reason,
            "tools": [c["function"]["name"] for c in reply.message.get("tool_calls") or []],
            "parse_error": reply.parse_error, "tool_format": self.tool_format.name,
        })  # fmt: skip
        return Answer(200, _completion(reply.message, reply.finish_reason, prompt_tokens, len(action.token_ids)),
                      _headers(request.ignored, self.run_max_tokens))  # fmt: skip

    def _raw_reply(self, message: Message) -> Message:
        """An assistant message this episode's endpoint wrote, with its raw sampled text."""
        if message.get("role") != "assistant":
            return message
        return self._raw_replies.get(reply_key(message), message)


def _completion(message: dict[str, Any], finish: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }  # fmt: skip


def _headers(ignored: tuple[str, ...], run_max_tokens: int | None) -> dict[str, str]:
    """What the reply did not take from the request: the run decides sampling."""
    headers = {"x-rollflow-sampling": "the run's settings; request sampling parameters are ignored"}
    if ignored:
        headers["x-rollflow-ignored"] = ",".join(ignored)
    if run_max_tokens is not None:
        headers["x-rollflow-max-tokens"] = str(run_max_tokens)
    return headers


# ---------------------------------------------------------------- the server


class CaptureEndpoint:
    """One running server and the episodes registered on it, by key."""

    def __init__(self) -> None:
        self._episodes: dict[str, AgentEpisode] = {}
        self._server: Any = None
        self._socket: socket.socket | None = None
        self._serving: asyncio.Task[None] | None = None
        self.base_url = ""

    def register(self, episode: AgentEpisode) -> None:
        self._episodes[episode.key] = episode

    async def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        config = uvicorn.Config(self._app(), log_config=None, log_level="warning", access_log=False,
                                lifespan="off", ws="none", http="h11", timeout_graceful_shutdown=1)  # fmt: skip
        self._server, self._socket = _quiet_server(config), sock
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():  # it failed to start: its exception names why
                sock.close()
                await self._serving
                raise RuntimeError("the capture endpoint stopped before it started")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._serving is None:
            return
        self._server.should_exit = True
        for episode in self._episodes.values():
            episode.closed = True
        try:
            await self._serving
        except asyncio.CancelledError:  # a cancelled run (Ctrl-C): close the sockets at once
            self._server.force_exit = True
            for server in getattr(self._server, "servers", []):
                server.close()
            raise
        finally:
            self._serving = None
            if self._socket is not None:
                self._socket.close()

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def respond(answer: Answer) -> JSONResponse:
            return JSONResponse(answer.body, status_code=answer.status, headers=dict(answer.headers or {}))

        async def completions(request: Request) -> JSONResponse:
            episode = self._episodes.get(_bearer(request.headers.get("authorization")))
            if episode is None:
                return respond(error_answer(401, "unknown API key: each episode's client carries its own"))
            try:
                body = await request.json()
            except ValueError:
                return respond(error_answer(400, "the request body is not JSON"))
            return respond(await episode.complete(body))

        async def models(request: Request) -> JSONResponse:
            if _bearer(request.headers.get("authorization")) not in self._episodes:
                return respond(error_answer(401, "unknown API key: each episode's client carries its own"))
            return JSONResponse({"object": "list", "data": [
                {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "rollflow"}]})  # fmt: skip

        return Starlette(routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ])  # fmt: skip


def _bearer(header: str | None) -> str:
    return header[len("Bearer "):].strip() if header and header.startswith("Bearer ") else ""


def _quiet_server(config: Any) -> Any:
    """A uvicorn server without its SIGINT/SIGTERM handlers: the run keeps its own.
    (The class is made here so that uvicorn is imported only when an endpoint starts.)"""
    import uvicorn

    class QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]
            yield

    return QuietServer(config)


class SharedEndpoint:
    """One ``CaptureEndpoint`` per event loop, started by its first lease and stopped by
    the release of its last (the episodes of one chunk overlap, so one server serves them)."""

    def __init__(self) -> None:
        self._running: dict[int, tuple[asyncio.Task[CaptureEndpoint], list[int]]] = {}

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[CaptureEndpoint]:
        loop = id(asyncio.get_running_loop())
        if loop not in self._running:
            self._running[loop] = (asyncio.ensure_future(_started()), [0])
        starting, users = self._running[loop]
        users[0] += 1
        try:
            yield await asyncio.shield(starting)
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._running[loop]
                if not starting.done():
                    starting.cancel()
                elif not starting.cancelled() and starting.exception() is None:
                    await starting.result().stop()


async def _started() -> CaptureEndpoint:
    endpoint = CaptureEndpoint()
    try:
        await endpoint.start()
    except BaseException:
        await endpoint.stop()
        raise
    return endpoint
