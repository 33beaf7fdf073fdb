"""The expert for ``rollflow sft``: the tool-use game's own solution, one chat call at a time.

``expert(task, messages, tools)`` answers each call of the agent (``agent.run``) as the
native game's expert (``rollflow.envs.tool_use_game.expert_transcript``) plays: list the fact
keys, look up every needed fact in one action, compute with the calculator, then answer with
the number. Which of the four a call gets is read from the agent's messages: the assistant
turns after the task's question (the worked example before it has its own). The agent runs
the tools itself, as it does for the model. ``configs/openai_agent.toml`` names it as
``expert`` in ``[env].kwargs``; only ``rollflow sft`` calls it.
"""

from __future__ import annotations

from typing import Any

from rollflow.envs.tool_use_game import expert_transcript
from rollflow.envs.tool_use_game.tasks import GameTask


def expert(task: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message for the agent's call: the next of the expert's four actions."""
    asked = [i for i, m in enumerate(messages) if m["role"] == "user" and m["content"] == task["question"]]
    if not asked:
        raise ValueError(f"the task's question is not in the agent's messages: {task['question']!r:.80}")
    done = sum(1 for m in messages[asked[-1] + 1 :] if m["role"] == "assistant")
    plan = [m for m in expert_transcript(_game_task(task)) if m["role"] == "assistant"]
    action = plan[min(done, len(plan) - 1)]
    if not action.get("tool_calls"):
        return {"role": "assistant", "content": action["content"]}
    offered = {tool["function"]["name"] for tool in tools}
    calls = [{"type": "function", "function": dict(call["function"])} for call in action["tool_calls"]]
    missing = {call["function"]["name"] for call in calls} - offered
    if missing:
        raise ValueError(f"the agent offers no {', '.join(sorted(missing))} tool (it offers {sorted(offered)})")
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _game_task(task: dict[str, Any]) -> GameTask:
    return GameTask(question=task["question"], facts=dict(task["facts"]), needed_keys=tuple(task["needed_keys"]),
                    formula=task["formula"], answer=int(task["answer"]))  # fmt: skip
