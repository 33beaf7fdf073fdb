"""A plain tool-calling agent, written against the ``openai`` SDK and nothing of rollflow's.

It asks the model, runs the tool calls it gets back, sends their results, and stops at the
first reply without a call (its answer) or after ``MAX_STEPS`` calls. ``rollflow``
trains it as it is: ``configs/openai_agent.toml`` points ``rollflow.envs.openai_agent``
at ``run``, and the client it is handed talks to rollflow's capture endpoint.
"""

from __future__ import annotations

import openai

from .game import SYSTEM_PROMPT, TOOLS, WORKED_EXAMPLE_MESSAGES, call_tool

MAX_STEPS = 6


async def run(task: dict, client: openai.AsyncOpenAI, model: str) -> str:
    """Answer ``task["question"]`` with the game's tools; the final reply's text."""
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        *WORKED_EXAMPLE_MESSAGES,
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

