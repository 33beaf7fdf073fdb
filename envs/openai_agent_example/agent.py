"""A plain tool-calling agent, written against the ``openai`` SDK and nothing of rollflow's.

It asks the model, runs the tool calls it gets back, sends their results, and stops at the
first reply without a call (its answer) or after ``MAX_STEPS`` calls. ``rollflow``
trains it as it is: ``configs/openai_agent.toml`` points ``rollflow.envs.openai_agent``
at ``run``, and the client it is handed talks to rollflow's capture endpoint.

``run`` shows the model one solved example before the question: the untouched bundled
model makes almost no tool call without it. ``run_without_example`` is the same agent
without it, for a model that SFT has taught the tools (``configs/learn_openai_agent.toml``):
with the example kept, SFT alone took the agent to 0.95 and left GRPO nothing to learn.
"""

from __future__ import annotations

from typing import Any

import openai

from .game import SYSTEM_PROMPT, TOOLS, WORKED_EXAMPLE_MESSAGES, call_tool

MAX_STEPS = 6


async def run(task: dict, client: openai.AsyncOpenAI, model: str) -> str:
    """Answer ``task["question"]`` with the game's tools; the final reply's text."""
    return await _solve(task, client, model, WORKED_EXAMPLE_MESSAGES)


async def run_without_example(task: dict, client: openai.AsyncOpenAI, model: str) -> str:
    """``run`` without the worked example: every call ~220 tokens shorter."""
    return await _solve(task, client, model, [])


async def _solve(task: dict, client: openai.AsyncOpenAI, model: str, example: list[dict[str, Any]]) -> str:
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        *example,
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(MAX_STEPS):
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            result = call_tool(task, call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""
