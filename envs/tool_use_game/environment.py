"""``ToolUseGame``: the hook-style tool-use environment, and its expert.

An episode: the system prompt, optionally one worked example (a whole solved episode
in the history), then the task's question. Each action either calls tools (their results
come back as ``tool`` messages and the episode goes on) or answers (the episode ends; the
reply is the scored text). The tools read the example's own facts, so the environment
holds no episode state and any number of episodes of one example can run at once.

The worked example is on by default: without it the bundled SmolLM2-135M makes no tool
call at all, and the few it makes with it are the only tool-call variance GRPO gets
before training (figures in docs/results.md); the reward's small ``tool_call_ok`` credit
is sized for it. The tool descriptions are not in the system prompt: ``tool_specs``
returns them and the policy's chat codec renders them (``rollflow.envs.protocol.describe_tools``).

The expert (``expert_transcript``) lists the keys, looks up every needed fact in one
action, computes with the calculator, then answers: four actions. It is what
``sft_completion`` returns and what ``expert_policy`` replays.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rollflow.envs.checks import require_int
from rollflow.envs.hooks import EnvironmentMultiTurn, check_split
from rollflow.envs.protocol import make_tool_call, parse_action, render_tool_calls
from rollflow.envs.scripted import ScriptedPolicy, replay_policy
from rollflow.envs.tool_use_game.reward import score_game
from rollflow.envs.tool_use_game.tasks import WORKED_EXAMPLE, GameTask, generate_examples
from rollflow.envs.tool_use_game.tools import GAME_TOOL_SPECS, game_tools
from rollflow.envs.tools import run_tool_calls
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    Message,
    RewardResult,
    Split,
    TaskExample,
    ToolSpec,
)

SYSTEM_PROMPT = (
    "You answer questions about facts that are hidden behind tools. First list the fact "
    "keys, then look up the facts you need, then use the calculator for the arithmetic. "
    "When you know the answer, reply with only the final number."
)


class ToolUseGame(EnvironmentMultiTurn):
    def __init__(
        self,
        train: Sequence[TaskExample],
        validation: Sequence[TaskExample],
        *,
        worked_example: bool = True,
        max_turns: int = 6,
    ) -> None:
        require_int("max_turns", max_turns, minimum=1)
        self._splits: dict[str, tuple[TaskExample, ...]] = {
            "train": tuple(train),
            "validation": tuple(validation),
        }
        self.worked_example = worked_example
        self.max_turns = max_turns

    def examples(self, split: Split) -> Sequence[TaskExample]:
        check_split(split)
        return self._splits[split]

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        messages: list[Message] = [{"role": "system", "content": SYSTEM_PROMPT}]
        if self.worked_example:
            messages.append({"role": "user", "content": WORKED_EXAMPLE.question})
            messages += expert_transcript(WORKED_EXAMPLE)
        messages.append({"role": "user", "content": str(example.input)})
        return messages

    def max_episode_turns(self, example: TaskExample) -> int:
        return self.max_turns

    def tool_specs(self, example: TaskExample) -> Sequence[ToolSpec]:
        return GAME_TOOL_SPECS

    async def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        parsed = parse_action(assistant_response)
        if parsed.kind == "final":
            return EnvironmentStepResult(
                done=True, final_response_text=parsed.content, metadata={"action": "answer"}
            )
        if parsed.kind == "parse_failure":  # only reachable when protocol checks are off
            reply: Message = {"role": "user", "content": f"Your tool call could not be read: {parsed.error}"}
            return EnvironmentStepResult(done=False, messages=(reply,), metadata={"action": "parse_failure"})
        outcome = await run_tool_calls(game_tools(_facts(example)), parsed.tool_calls)
        return EnvironmentStepResult(
            done=False,
            messages=outcome.messages,
            metadata={
                "action": "tool_calls",
                "tools": [call["function"]["name"] for call in parsed.tool_calls],
                "tool_errors": outcome.errors,
            },
        )

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        opening = len(self.start_episode(example, ""))
        return score_game(
            needed_keys=list(example.metadata["needed_keys"]),
            answer=float(example.output),
            messages=episode.messages[opening:],
            response_text=episode.response_text,
        )

    def sft_completion(self, example: TaskExample) -> list[Message]:
        return expert_transcript(game_task(example))


def load_environment(
    seed: int = 0,
    num_train: int = 200,
    num_validation: int = 50,
    worked_example: bool = True,
    max_turns: int = 6,
) -> ToolUseGame:
    """The game with ``num_train`` + ``num_validation`` tasks generated from ``seed``."""
    train, validation = generate_examples(seed, num_train, num_validation)
    return ToolUseGame(train, validation, worked_example=worked_example, max_turns=max_turns)


def game_task(example: TaskExample) -> GameTask:
    """The generated task behind an example (what its metadata records)."""
    metadata: Mapping[str, Any] = example.metadata
    return GameTask(
        question=str(example.input),
        facts=dict(metadata["facts"]),
        needed_keys=tuple(metadata["needed_keys"]),
        formula=str(metadata["formula"]),
        answer=int(example.output),
    )


def expert_transcript(task: GameTask) -> list[Message]:
    """The expert's messages after the question: four actions and the tool results."""
    tools = game_tools(task.facts)
    values = [task.facts[key] for key in task.needed_keys]
    plan: list[list[tuple[str, dict[str, Any]]]] = [
        [("list_fact_keys", {})],
        [("lookup", {"key": key}) for key in task.needed_keys],
        [("calculator", {"expression": task.formula.format(*values)})],
    ]
    messages: list[Message] = []
    for step in plan:
        calls = [make_tool_call(name, arguments, index) for index, (name, arguments) in enumerate(step)]
        text = render_tool_calls(calls)
        messages.append(parse_action(text).to_message(text))
        for call, (name, arguments) in zip(calls, step, strict=True):
            content = tools[name].run(arguments)  # raises if the expert were wrong
            messages.append({"role": "tool", "content": content, "tool_call_id": call["id"], "name": name})
    messages.append({"role": "assistant", "content": str(task.answer)})
    return messages


def expert_policy(examples: Iterable[TaskExample]) -> ScriptedPolicy:
    """A scripted policy that plays the expert transcript of each of ``examples``."""
    return replay_policy(
        {
            str(example.input): [
                m["content"] for m in expert_transcript(game_task(example)) if m["role"] == "assistant"
            ]
            for example in examples
        }
    )


def _facts(example: TaskExample) -> dict[str, int]:
    return dict(example.metadata["facts"])
