"""``rollflow chat``: talk to a trained policy in the terminal, with its environment's tools.

``rollflow chat RUN_DIR`` loads the run's newest checkpoint (``--step N`` for another; the
base model while the run has none) with the transformers backend, or talks to an
OpenAI-compatible server with ``--base-url URL --api-model NAME`` (e.g. vLLM serving a
``rollflow export``, whose ``SERVING.md`` prints the line). A server needs no run folder:
``--env`` names the environment and the sampling settings are the defaults of
``[rollout]``; a RUN_DIR given beside it supplies both. The person types user turns; the
policy answers. Commands: ``/reset`` starts the conversation over, ``/exit`` (or end of
input, Ctrl-D) ends it.

The environment (the run's ``[env]``, or ``--env module:function``; ``--env none`` for a
bare chat) is made with ``--kwargs`` (a JSON object, as ``rollflow rescore`` takes it), else the run's ``[env].kwargs``
when it is the run's environment, else none (``chat_env_config``), and gives the chat two
things:

- its **system messages**: those of its opening messages for the first validation task
  (``start_episode`` / ``reset``), so the policy sees the instructions it was trained on;
- its **tools**: the tool specs are shown to the policy (rendered by the chat codec exactly
  as in rollouts), and when a reply calls tools (the ``<tool_call>`` text protocol) they
  run through ``rollflow.envs.tools.execute_tool_calls`` and the results go back to the
  policy, which answers again. Each call and result is printed.

What it simplifies, and why:
- Tools come from a ``tools`` mapping (name -> ``Tool``) on the environment (a hook-style
  environment) or on the ``Env`` its factory makes for the first task (async style). Many
  environments build their tools per task from hidden task data (the bundled tool-use
  game does), so there is no task-free set to run: the specs are still shown, and a call
  is answered ``tool_error: ...`` saying the chat cannot run it.
- The environment's own ``step_episode`` / ``step`` is never called and nothing is scored:
  a person's chat is not an episode of the task.
- An agent environment (``rollflow.envs.openai_agent``) is refused, in one line that says
  what to use instead: its system prompt and tools are the agent's own, sent with each of
  the agent's calls, and in a chat a person takes the agent's place, so there are none to
  show. ``rollflow eval`` plays the agent against the policy; ``--env none`` chats bare.
- At most ``MAX_TOOL_ROUNDS`` replies (so tool rounds) follow one user turn, so a policy
  that calls tools forever still hands the turn back.
- Sampling follows the run's ``[rollout]`` settings (temperature, top_p, per-reply and
  context token budgets); ``--temperature 0`` gives greedy replies.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rollflow.envs.agent import Policy, PolicySession
from rollflow.envs.hooks import example_prompt_text
from rollflow.envs.protocol import parse_action
from rollflow.envs.tools import TOOL_ERROR_PREFIX, BrokenToolError, execute_tool_calls
from rollflow.envs.types import Message, Tool, ToolCall, ToolSpec

if TYPE_CHECKING:  # loaded on use: torch and transformers cost seconds to import
    from rollflow.envs.env import AsyncEnvSuite
    from rollflow.envs.hooks import EnvironmentMultiTurn
    from rollflow.generators.checkpoints import Checkpoint
    from rollflow.policy.sampling import SamplingSettings
    from rollflow.config.run import RunConfig

MAX_TOOL_ROUNDS = 8
PROMPT = "you> "
NO_ENV = "none"

ReadLine = Callable[[str], str]
Write = Callable[[str], None]


@dataclass(frozen=True)
class ChatEnvironment:
    """What a chat takes from an environment: instructions and tools."""

    name: str
    system_messages: tuple[Message, ...] = ()
    tool_specs: tuple[ToolSpec, ...] = ()
    tools: Mapping[str, Tool] | None = None  # None: the specs are shown but cannot run
    note: str = ""  # why the tools cannot run, when they cannot

    def describe(self) -> list[str]:
        lines = [f"environment: {self.name}"]
        if self.system_messages:
            first = self.system_messages[0]["content"].strip().splitlines() or [""]
            lines.append(f"system prompt: {first[0][:100]}{' ...' if len(first) > 1 or len(first[0]) > 100 else ''}")
        if self.tool_specs:
            names = ", ".join(spec["function"]["name"] for spec in self.tool_specs)
            runnable = "run here" if self.tools is not None else f"not runnable here: {self.note}"
            lines.append(f"tools: {names} ({runnable})")
        return lines


@dataclass
class Conversation:
    """One chat: the transcript and the policy session that has rendered it so far."""

    policy: Policy
    environment: ChatEnvironment
    messages: list[Message] = field(default_factory=list)
    session: PolicySession | None = None
    full: bool = False  # the context budget is spent: only /reset helps

    def __post_init__(self) -> None:
        self._start()

    def _start(self) -> None:
        self.messages = list(self.environment.system_messages)
        self.session = self.policy.open_session(list(self.environment.tool_specs))
        self.full = False

    async def reset(self) -> None:
        await self.close()
        self._start()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def say(self, text: str, write: Write) -> None:
        """The user's turn, then the policy's replies (and tool rounds) until it answers."""
        if self.full:
            write("(the conversation fills the model's context; /reset to start over)")
            return
        assert self.session is not None, "say() after close()"
        self.messages.append({"role": "user", "content": text})
        for _ in range(MAX_TOOL_ROUNDS):
            action = await self.session.act(list(self.messages))
            if action.finish_reason == "context":
                self.full = True
                if action.text:
                    write(f"assistant> {action.text}")
                write("(the conversation fills the model's context; /reset to start over)")
                return
            calls = self._reply(action.text, write)
            if not calls:
                return
            try:
                results = await self._run_tools(calls)
            except BrokenToolError as error:  # the environment's bug: said to the user, not fed to the model
                self.messages.pop()  # the reply whose calls could not run
                write(f"(a tool is broken, a bug in the environment, not the model: {error}; /reset or fix it)")
                return
            for result in results:
                write(f"  tool result [{result.get('name', '?')}]: {result['content']}")
            self.messages.extend(results)
        write(f"(stopped after {MAX_TOOL_ROUNDS} tool rounds; your turn)")

    def _reply(self, text: str, write: Write) -> tuple[ToolCall, ...]:
        """Record and show one reply; the tool calls it makes (none for a final answer)."""
        if not self.environment.tool_specs:  # no tools offered: every reply is plain text
            self.messages.append({"role": "assistant", "content": text})
            write(f"assistant> {text}")
            return ()
        parsed = parse_action(text)
        self.messages.append(parsed.to_message(text))
        if parsed.kind == "final" or parsed.content:
            write(f"assistant> {parsed.content}")
        if parsed.kind == "parse_failure":
            write(f"assistant> {text}")
            write(f"  (malformed tool call, not run: {parsed.error})")
            return ()
        for call in parsed.tool_calls:
            write(f"  tool call {call['function']['name']}({call['function']['arguments']})")
        return parsed.tool_calls

    async def _run_tools(self, calls: Sequence[ToolCall]) -> list[Message]:
        if self.environment.tools is not None:
            return await execute_tool_calls(self.environment.tools, calls)
        reason = f"{TOOL_ERROR_PREFIX}this chat cannot run tools: {self.environment.note}"
        return [{"role": "tool", "content": reason, "tool_call_id": call["id"], "name": call["function"]["name"]}
                for call in calls]


async def chat_loop(policy: Policy, environment: ChatEnvironment, read_line: ReadLine, write: Write) -> None:
    """Read user turns until ``/exit`` or end of input; ``/reset`` starts over."""
    conversation = Conversation(policy, environment)
    try:
        while True:
            try:
                line = read_line(PROMPT)
            except EOFError:
                write("")
                return
            command = line.strip()
            if command in ("/exit", "/quit"):
                return
            if command == "/reset":
                await conversation.reset()
                write("(started over)")
            elif command.startswith("/"):
                write(f"(unknown command {command}; the commands are /reset and /exit)")
            elif command:
                await conversation.say(line, write)
    finally:
        await conversation.close()


# ---------------------------------------------------------------- the environment


def chat_env_config(
    run_dir: str | Path | None, env: str | None, kwargs: Mapping[str, object] | None
) -> tuple[str, dict[str, object]]:
    """(spec, kwargs) of the environment a chat runs: ``env``, else the run's ``[env].name``;
    ``kwargs``, else the run's ``[env].kwargs`` when the spec is the run's own (as
    ``rollflow eval --env`` does), else none."""
    from rollflow.config.parsing import ConfigError

    run_env = _run_config(run_dir).env if run_dir is not None else None
    spec = env if env is not None else (run_env.name if run_env is not None else None)
    if spec is None:
        raise ConfigError("without RUN_DIR, --env names the environment (module:function, or 'none' for a bare chat)")
    if kwargs is not None:
        return spec, dict(kwargs)
    return spec, dict(run_env.kwargs) if run_env is not None and run_env.name == spec else {}


def chat_environment(spec: str | None, kwargs: Mapping[str, object] | None = None) -> ChatEnvironment:
    """Instructions and tools of environment ``spec`` (``None`` or ``"none"``: a bare chat)."""
    if spec is None or spec == NO_ENV:
        return ChatEnvironment(name="none")
    from rollflow.config.parsing import ConfigError
    from rollflow.envs.async_handle import AsyncEnvironmentHandle
    from rollflow.envs.hook_handle import HookEnvironmentHandle
    from rollflow.envs.mixture_handle import MixtureHandle
    from rollflow.envs.openai_agent import AgentEnvironmentHandle
    from rollflow.envs.runner import load_environment_handle

    handle = load_environment_handle(spec, kwargs)
    if isinstance(handle, HookEnvironmentHandle):
        return asyncio.run(_hook_environment(spec, handle.env))
    if isinstance(handle, AgentEnvironmentHandle):
        raise ConfigError(
            f"{spec} is an agent environment: its system prompt and tools are those its agent "
            f"{handle.env.names['agent']} sends with each call, and a chat has no agent; "
            "`rollflow eval` plays the agent against this policy, `--env none` chats with it bare"
        )
    if isinstance(handle, MixtureHandle):
        members = " or ".join(f"--env {m.name} --kwargs '{json.dumps(m.kwargs)}'" for m, _ in handle.members)
        raise ConfigError(f"{spec} is a mixture: a chat holds one environment's instructions and tools; {members}")
    assert isinstance(handle, AsyncEnvironmentHandle), f"unknown handle {type(handle).__name__}"
    return asyncio.run(_async_environment(spec, handle.suite))


async def _hook_environment(spec: str, env: EnvironmentMultiTurn) -> ChatEnvironment:
    from rollflow.envs.hooks import call_setup_hook

    examples = list(env.examples("validation")) or list(env.examples("train"))
    if not examples:
        return ChatEnvironment(name=spec)
    example = examples[0]
    opening = await call_setup_hook(env.start_episode, example, example_prompt_text(example))
    return _environment(spec, env, opening, tuple(env.tool_specs(example)))


async def _async_environment(spec: str, suite: AsyncEnvSuite) -> ChatEnvironment:
    task = (list(suite.val_tasks) or list(suite.tasks))[0]
    env = suite.env_factory(task)
    opening = await env.reset(task)
    return _environment(spec, env, opening, tuple(env.tool_specs))


def _environment(spec: str, env: object, opening: Sequence[Message], specs: tuple[ToolSpec, ...]) -> ChatEnvironment:
    system = tuple(m for m in opening if m.get("role") == "system")
    tools = getattr(env, "tools", None)
    if tools is not None and not isinstance(tools, Mapping):
        tools = None
    note = "" if tools is not None else f"{type(env).__name__} has no `tools` mapping"
    return ChatEnvironment(name=spec, system_messages=system, tool_specs=specs, tools=tools, note=note)


# ---------------------------------------------------------------- the policy


@dataclass(frozen=True)
class ChatPolicy:
    policy: Policy
    description: str  # which model, for the banner


def chat_policy(
    run_dir: str | Path | None,
    step: int | None = None,
    *,
    base_url: str | None = None,
    api_model: str | None = None,
    temperature: float | None = None,
    tools_in_system_prompt: bool = False,
) -> ChatPolicy:
    """The run's policy (a checkpoint, or the base model before the first one), or a server
    (sampled with the run's ``[rollout]`` settings, or the defaults without ``run_dir``)."""
    import dataclasses

    from rollflow.config.parsing import ConfigError
    from rollflow.config.run import RunConfig
    from rollflow.flows.export import find_checkpoint
    from rollflow.policy.sampling import SamplingSettings
    from rollflow.storage.runfolder import RunFolder

    served = base_url is not None or api_model is not None
    if run_dir is None and not served:
        raise ConfigError("give RUN_DIR (a run's policy), or --base-url and --api-model (a server)")
    config = _run_config(run_dir) if run_dir is not None else RunConfig()
    rollout = config.rollout
    settings = SamplingSettings(
        temperature=rollout.temperature, top_p=rollout.top_p, max_completion_tokens=rollout.max_completion_tokens,
        max_model_length=rollout.max_model_length, seed=config.train.seed,
    )
    if temperature is not None:
        settings = dataclasses.replace(settings, temperature=temperature)
    if served:
        return _server_policy(base_url, api_model, settings, tools_in_system_prompt)
    assert run_dir is not None
    folder = RunFolder(run_dir)
    checkpoint = find_checkpoint(folder, step) if step is not None or folder.checkpoints() else None
    return _local_policy(config, checkpoint, settings)


def _run_config(run_dir: str | Path) -> RunConfig:
    from rollflow.config.run import load_config
    from rollflow.flows.export import ExportError
    from rollflow.storage.runfolder import RunFolder

    folder = RunFolder(run_dir)
    if not folder.config_path.is_file():
        raise ExportError(f"{folder.root} is not a run folder (no config.toml)")
    return load_config(folder.config_path, frozen=True)


def _server_policy(
    base_url: str | None, api_model: str | None, settings: SamplingSettings, tools_in_system_prompt: bool
) -> ChatPolicy:
    from rollflow.flows.export import ExportError
    from rollflow.policy.openai_backend import OpenAIChatPolicy

    if not base_url or not api_model:
        raise ExportError("a served policy needs both --base-url and --api-model")
    policy = OpenAIChatPolicy(base_url=base_url, model=api_model, settings=settings,
                              tools_in_system_prompt=tools_in_system_prompt)
    return ChatPolicy(policy, f"{api_model} at {base_url}")


def _local_policy(config: RunConfig, checkpoint: Checkpoint | None, settings: SamplingSettings) -> ChatPolicy:
    from rollflow.generators.models import policy_model_ref, torch_device, torch_dtype
    from rollflow.policy.models import load_causal_lm
    from rollflow.policy.transformers_backend import TransformersPolicy

    model, tokenizer = load_causal_lm(
        policy_model_ref(config, checkpoint), torch_dtype(config), device=torch_device(config)
    )
    version = 0 if checkpoint is None else checkpoint.policy_version
    policy = TransformersPolicy(model, tokenizer, settings, version=version, batch_window_s=0.0)
    if checkpoint is None:
        return ChatPolicy(policy, "the base model (the run has no checkpoint yet)")
    return ChatPolicy(policy, f"step {checkpoint.step} (policy version {version}) of {checkpoint.path.parent.parent}")
