"""``rollflow chat``: the loop runs the environment's tools and shows them, /reset and /exit
and end of input behave, and the real command works in a pseudo-terminal on a tiny model."""

from __future__ import annotations

import asyncio
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from rollflow.envs.agent import PolicyAction
from rollflow.envs.arithmetic import CalculatorTool
from rollflow.envs.arithmetic_answer import SYSTEM_PROMPT as ARITHMETIC_PROMPT
from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.protocol import make_tool_call, render_tool_calls
from rollflow.envs.registry import register_environment
from rollflow.envs.scripted import ScriptedPolicy, constant_policy
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    Message,
    RewardResult,
    TaskExample,
    ToolSpec,
    tool_to_spec,
)
from rollflow.flows.chat import MAX_TOOL_ROUNDS, PROMPT, ChatEnvironment, chat_environment, chat_loop, chat_policy
from rollflow.flows.cli import main
from rollflow.flows.export import ExportError

ARITHMETIC = "rollflow.envs.arithmetic_answer:load_environment"
SYSTEM = "You may use the calculator."


class CalculatorChat(EnvironmentMultiTurn):
    """A hook environment with a ``tools`` mapping: the chat can run its calculator."""

    tools = {"calculator": CalculatorTool()}

    def __init__(self) -> None:
        self.dataset = [{"input": "What is 6 * 7?", "id": "q"}]

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt_text}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return 4

    def tool_specs(self, example: TaskExample) -> Sequence[ToolSpec]:
        return [tool_to_spec(CalculatorTool())]

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        raise AssertionError("a chat never steps the environment")

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        raise AssertionError("a chat never scores")


def calculator_environment() -> ChatEnvironment:
    spec = register_environment("chat-calculator", CalculatorChat())
    return chat_environment(spec, {"key": "chat-calculator"})


def play(policy: ScriptedPolicy, environment: ChatEnvironment, lines: Sequence[str]) -> list[str]:
    """Run the loop on ``lines`` (then end of input); what it wrote, one entry per write."""
    feed: Iterator[str] = iter(lines)
    written: list[str] = []

    def read_line(prompt: str) -> str:
        assert prompt == PROMPT
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    asyncio.run(chat_loop(policy, environment, read_line, written.append))
    return written


def calculate_then_answer() -> tuple[ScriptedPolicy, list[list[Message]]]:
    seen: list[list[Message]] = []

    def script(messages: Sequence[Message], turn: int) -> str:
        seen.append(list(messages))
        if messages[-1]["role"] == "user":
            return "Let me compute.\n" + render_tool_calls([make_tool_call("calculator", {"expression": "6 * 7"})])
        return f"It is {messages[-1]['content']}."

    return ScriptedPolicy(script), seen


def test_a_tool_call_is_run_shown_and_its_result_answered() -> None:
    environment = calculator_environment()
    assert environment.system_messages == ({"role": "system", "content": SYSTEM},)
    assert environment.tools is not None
    policy, seen = calculate_then_answer()
    written = play(policy, environment, ["What is 6 * 7?", "/exit", "never read"])
    assert written == [
        "assistant> Let me compute.",
        '  tool call calculator({"expression": "6 * 7"})',
        "  tool result [calculator]: 42",
        "assistant> It is 42.",
    ]
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "tool"]
    assert seen[1][2]["tool_calls"][0]["function"]["name"] == "calculator"  # parsed as in rollouts
    assert policy.opened_tool_specs == [tuple(environment.tool_specs)]


class _DictCalculator(CalculatorTool):
    """A tool with the bug the newcomer met: it returns a dict, not a ToolResult."""

    async def execute(self, arguments: str) -> object:  # type: ignore[override]
        return {"value": 42}


def test_a_broken_tool_is_said_to_the_user_and_the_chat_goes_on() -> None:
    """Before: the tool's bug (now a BrokenToolError, as in a rollout) ended the chat with a traceback."""
    from dataclasses import replace

    environment = replace(calculator_environment(), tools={"calculator": _DictCalculator()})
    policy, seen = calculate_then_answer()
    written = play(policy, environment, ["What is 6 * 7?", "again?"])
    broken = [line for line in written if line.startswith("(a tool is broken")]
    assert len(broken) == 2 and "returned dict" in broken[0] and "a bug in the environment, not the model" in broken[0]
    assert [m["role"] for m in seen[-1]] == ["system", "user", "user"], "the unanswered call was kept"


def test_reset_starts_over_from_the_system_prompt_and_end_of_input_ends() -> None:
    policy, seen = calculate_then_answer()
    written = play(policy, calculator_environment(), ["first", "/reset", "second", "/bogus", "   "])
    assert "(started over)" in written
    assert written[-2] == "(unknown command /bogus; the commands are /reset and /exit)"
    assert written[-1] == ""  # a newline after Ctrl-D, so the shell prompt starts on its own line
    second_turn = next(m for m in seen if m[-1]["content"] == "second")
    assert second_turn == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "second"}]
    assert len(policy.opened_tool_specs) == 2  # a fresh session after /reset


def test_tools_without_a_mapping_are_shown_and_answered_with_an_error() -> None:
    environment = chat_environment("rollflow.envs.tool_use_game:load_environment",
                                   {"num_train": 1, "num_validation": 1})
    assert environment.tools is None and environment.note == "ToolUseGame has no `tools` mapping"
    assert [s["function"]["name"] for s in environment.tool_specs] == ["list_fact_keys", "lookup", "calculator"]
    assert "not runnable here: ToolUseGame has no `tools` mapping" in environment.describe()[-1]
    policy, seen = calculate_then_answer()
    written = play(policy, environment, ["hi"])
    assert written[2] == (
        "  tool result [calculator]: tool_error: this chat cannot run tools: ToolUseGame has no `tools` mapping"
    )


def test_an_async_environment_gives_its_system_prompt_and_tool_specs() -> None:
    environment = chat_environment("rollflow.envs.calculator_math:load_environment")
    assert environment.system_messages[0]["content"].startswith("Use the calculator tool")
    assert [s["function"]["name"] for s in environment.tool_specs] == ["calculator"]
    assert environment.note == "CalculatorMathEnv has no `tools` mapping"


def test_without_tools_a_tool_call_is_just_text() -> None:
    reply = '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
    written = play(constant_policy(reply), chat_environment(ARITHMETIC), ["What is 2 + 2?"])
    assert written == [f"assistant> {reply}", ""]


def test_a_policy_calling_tools_forever_hands_the_turn_back() -> None:
    call = render_tool_calls([make_tool_call("calculator", {"expression": "1 + 1"})])
    written = play(constant_policy(call), calculator_environment(), ["loop"])
    assert written.count("  tool result [calculator]: 2") == MAX_TOOL_ROUNDS
    assert written[-2] == f"(stopped after {MAX_TOOL_ROUNDS} tool rounds; your turn)"


def test_a_full_context_asks_for_a_reset_until_one_comes() -> None:
    calls: list[int] = []

    def script(messages: Sequence[Message], turn: int) -> PolicyAction:
        calls.append(len(messages))
        return PolicyAction(text="cut", finish_reason="context")

    written = play(ScriptedPolicy(script), chat_environment(ARITHMETIC), ["long", "more", "/reset", "x"])
    full = "(the conversation fills the model's context; /reset to start over)"
    assert written == ["assistant> cut", full, full, "(started over)", "assistant> cut", full, ""]
    assert calls == [2, 2]  # "more" never reached the policy; after /reset: system + "x"


def test_bad_arguments_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ExportError, match="is not a run folder"):
        chat_policy(tmp_path)
    assert main(["chat", str(tmp_path)]) == 1
    assert "is not a run folder (no config.toml)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["chat", str(tmp_path), "--temperature", "-1"])
    assert "--temperature must be >= 0" in capsys.readouterr().err


def test_a_server_policy_needs_both_its_url_and_model_name(tmp_path: Path, tiny_model_dir: Path) -> None:
    from rollflow.policy.openai_backend import OpenAIChatPolicy
    from test_export import run_with_checkpoints

    folder = run_with_checkpoints(tmp_path / "run", tiny_model_dir, use_lora=True, steps=0)
    with pytest.raises(ExportError, match="needs both --base-url and --api-model"):
        chat_policy(folder.root, base_url="http://127.0.0.1:8000/v1")
    served = chat_policy(folder.root, base_url="http://127.0.0.1:8000/v1", api_model="trained", temperature=0.0)
    assert isinstance(served.policy, OpenAIChatPolicy) and served.description == "trained at http://127.0.0.1:8000/v1"
    assert served.policy.url == "http://127.0.0.1:8000/v1/chat/completions"
    assert served.policy.settings.temperature == 0.0
    with pytest.raises(ExportError, match="has no checkpoint"):
        chat_policy(folder.root, step=0)


GAME = "rollflow.envs.tool_use_game:load_environment"


def _end_of_input(prompt: str) -> str:
    raise EOFError


def test_a_server_chat_needs_no_run_folder(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The line SERVING.md and the README printed had no RUN_DIR, which argparse required
    (exit 2). Against a server the environment comes from --env, its kwargs from --kwargs."""
    monkeypatch.setattr("builtins.input", _end_of_input)  # the chat opens, then the input ends
    served = ["chat", "--base-url", "http://127.0.0.1:9/v1", "--api-model", "policy"]
    assert main([*served, "--env", GAME, "--kwargs", '{"worked_example": false}', "--tools-in-system-prompt"]) == 0
    printed = capsys.readouterr().out
    assert "chatting with policy at http://127.0.0.1:9/v1" in printed
    assert f"environment: {GAME}" in printed and "tools: list_fact_keys, lookup, calculator" in printed
    assert main(served) == 1
    assert "without RUN_DIR, --env names the environment" in capsys.readouterr().err
    assert main(["chat"]) == 1
    assert "give RUN_DIR (a run's policy), or --base-url and --api-model" in capsys.readouterr().err
    assert main([*served, "--env", GAME, "--kwargs", "[1]"]) == 1
    assert "--kwargs must be a JSON object" in capsys.readouterr().err


def _run_with_env_kwargs(root: Path, kwargs: dict[str, object], spec: str = GAME) -> Path:
    from rollflow.config.run import EnvConfig, RunConfig, config_to_toml
    from rollflow.storage.runfolder import RunFolder

    RunFolder(root).write_config(config_to_toml(RunConfig(env=EnvConfig(spec, kwargs))))
    return root


def test_the_runs_env_kwargs_go_with_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--env SPEC` made SPEC without kwargs, dropping the run's [env].kwargs even when SPEC
    was the run's own environment; now they go with it, as `rollflow eval --env` keeps them."""
    from rollflow.flows.chat import chat_env_config

    run = _run_with_env_kwargs(tmp_path / "run", {"worked_example": False})
    assert chat_env_config(run, None, None) == (GAME, {"worked_example": False})
    assert chat_env_config(run, GAME, None) == (GAME, {"worked_example": False})
    assert chat_env_config(run, ARITHMETIC, None) == (ARITHMETIC, {})  # another env: not the run's kwargs
    assert chat_env_config(run, GAME, {"seed": 1}) == (GAME, {"seed": 1})
    assert chat_env_config(None, GAME, None) == (GAME, {})
    # through the command: a kwarg the game does not take reaches it, and it says so
    monkeypatch.setattr("builtins.input", _end_of_input)
    wrong = _run_with_env_kwargs(tmp_path / "wrong", {"no_such_setting": 1})
    served = ["--base-url", "http://127.0.0.1:9/v1", "--api-model", "policy"]
    assert main(["chat", str(wrong), *served, "--env", GAME]) == 1
    assert "no_such_setting" in capsys.readouterr().err


AGENT = "rollflow.envs.openai_agent:load_environment"
AGENT_KWARGS: dict[str, object] = {
    "agent": "rollflow.envs.openai_agent_example.agent:run",
    "tasks": "rollflow.envs.openai_agent_example.game:tasks",
    "reward": "rollflow.envs.openai_agent_example.game:reward",
}


def test_an_agent_environment_is_refused_in_one_line_that_names_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rollflow chat` on a run of configs/openai_agent.toml died on an assert (a traceback):
    an agent environment's system prompt and tools are the agent's own, sent with its calls,
    and a person typing turns is no agent. It says so, and what to use instead."""
    from rollflow.config.parsing import ConfigError

    with pytest.raises(ConfigError, match=r"is an agent environment.*rollflow eval.*--env none"):
        chat_environment(AGENT, AGENT_KWARGS)
    monkeypatch.setattr("builtins.input", _end_of_input)
    run = _run_with_env_kwargs(tmp_path / "run", AGENT_KWARGS, spec=AGENT)
    served = ["--base-url", "http://127.0.0.1:9/v1", "--api-model", "policy"]
    assert main(["chat", str(run), *served]) == 1
    said = capsys.readouterr().err
    assert len(said.strip().splitlines()) == 1 and "Traceback" not in said, said
    assert "rollflow.envs.openai_agent_example.agent:run" in said and "rollflow eval" in said
    assert main(["chat", str(run), *served, "--env", "none"]) == 0  # the way out it names works
    assert "environment: none" in capsys.readouterr().out


# ---------------------------------------------------------------- a real terminal


def read_until(fd: int, marker: str, text: str = "", limit_s: float = 180.0) -> str:
    """Everything the terminal shows until ``marker`` (a guard against a hang, not a timing test)."""
    deadline = time.monotonic() + limit_s
    while marker not in text:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"the chat never showed {marker!r}; it showed:\n{text}")
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            raise AssertionError(f"the chat ended before {marker!r}; it showed:\n{text}")
        text += chunk.decode(errors="replace").replace("\r\n", "\n")
    return text


def greedy_reply(run_dir: Path, user: str) -> str:
    """What the run's newest policy says greedily to ``user`` under the arithmetic prompt."""
    policy = chat_policy(run_dir, temperature=0.0).policy

    async def act() -> str:
        session = policy.open_session([])
        messages: list[Message] = [{"role": "system", "content": ARITHMETIC_PROMPT}, {"role": "user", "content": user}]
        action = await session.act(messages)
        await session.close()
        return action.text

    return asyncio.run(act())


@pytest.mark.slow  # a real process importing torch and loading a model: ~20 s on 2 busy cores
def test_the_chat_command_in_a_pseudo_terminal(tmp_path: Path, tiny_model_dir: Path) -> None:
    from test_export import run_with_checkpoints

    folder = run_with_checkpoints(tmp_path / "run", tiny_model_dir, use_lora=True, steps=1)
    expected = greedy_reply(folder.root, "Hello there")
    assert expected.strip()
    controller, terminal = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-m", "rollflow.flows.cli", "chat", str(folder.root), "--env", ARITHMETIC,
         "--temperature", "0"],
        stdin=terminal, stdout=terminal, stderr=terminal, close_fds=True,
        env={**os.environ, "TERM": "dumb"},
    )
    os.close(terminal)
    try:
        shown = read_until(controller, PROMPT)
        assert "chatting with step 0 (policy version 1)" in shown
        assert f"system prompt: {ARITHMETIC_PROMPT}" in shown
        os.write(controller, b"Hello there\n")
        shown = read_until(controller, PROMPT, shown.rsplit(PROMPT, 1)[0])  # past the first prompt
        assert f"Hello there\nassistant> {expected}\n" in shown
        os.write(controller, b"/exit\n")
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(controller)
