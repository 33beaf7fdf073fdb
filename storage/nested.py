"""The nested columns of an episode: chat messages, action tokens, JSON metadata.

Messages are plain dicts shaped like OpenAI chat messages; stored, each becomes one
struct with a fixed set of fields so SQL can ``unnest`` them. A key that is absent is
stored as null and comes back absent, so ``row -> message`` is the exact inverse of
``message -> row``. Keys outside the chat-message shape are kept as a JSON object in
``extra_json`` rather than dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, cast

from rollflow.envs.episode import ActionTokens
from rollflow.envs.types import Message, ToolCall

_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})


def _tool_call_to_row(call: ToolCall, where: str) -> dict[str, str]:
    if set(call) - {"id", "type", "function"} or call.get("type", "function") != "function":
        raise ValueError(f"{where}: a tool call must be {{id, type: 'function', function}}: {call!r}")
    function = call["function"]
    if set(function) != {"name", "arguments"}:
        raise ValueError(f"{where}: a tool call's function must be {{name, arguments}}: {call!r}")
    return {"id": call["id"], "name": function["name"], "arguments": function["arguments"]}


def message_to_row(message: Message, where: str) -> dict[str, Any]:
    if "role" not in message:
        raise ValueError(f"{where}: a message without a role: {message!r}")
    extra = {k: v for k, v in message.items() if k not in _MESSAGE_KEYS}
    calls = message.get("tool_calls")
    return {
        "role": message["role"],
        "content": message.get("content"),
        "tool_calls": None if calls is None else [_tool_call_to_row(c, where) for c in calls],
        "tool_call_id": message.get("tool_call_id"),
        "name": message.get("name"),
        "extra_json": dump_json(extra, where) if extra else None,
    }


def row_to_message(row: Mapping[str, Any]) -> Message:
    message: dict[str, Any] = {"role": row["role"], "content": row["content"]}
    if row["tool_calls"] is not None:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in row["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if row[key] is not None:
            message[key] = row[key]
    if row["extra_json"] is not None:
        message.update(json.loads(row["extra_json"]))
    return cast(Message, message)


def _check_json_data(value: Any, where: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: JSON object keys must be text, got {key!r}")
            _check_json_data(item, where)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_json_data(item, where)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value} is not JSON data")
    elif value is not None and not isinstance(value, str | int | float | bool):
        raise ValueError(f"{where}: {type(value).__name__} {value!r} is not JSON data")


def dump_json(value: Any, where: str) -> str:
    _check_json_data(value, where)
    return json.dumps(value, ensure_ascii=False, default=dict)  # Mapping -> dict


def action_to_row(action: ActionTokens) -> dict[str, Any]:
    return {
        "prompt_delta_ids": list(action.prompt_delta_ids),
        "reset": action.reset,
        "token_ids": list(action.token_ids),
        "logprobs": list(action.logprobs),
        "finish_reason": action.finish_reason,
    }


def row_to_action(row: Mapping[str, Any]) -> ActionTokens:
    return ActionTokens(
        prompt_delta_ids=tuple(row["prompt_delta_ids"]),
        reset=row["reset"],
        token_ids=tuple(row["token_ids"]),
        logprobs=tuple(row["logprobs"]),
        finish_reason=row["finish_reason"],
    )
