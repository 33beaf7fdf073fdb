"""``rollflow env show``: the exact prompt a policy is given for one task of an environment.

What the model reads is more than the environment's messages: the policy's codec adds the
tool descriptions and the tool-call protocol (``envs.protocol.describe_tools``) to the
system prompt and renders the whole conversation with the model's chat template. Reading
the environment's code shows none of that; ``preview_prompt`` renders it the way a
rollout does, so an author sees what a small model will copy (its example call, say).

The task's episode really starts (``start_episode`` / ``Env.reset`` run, then its close),
through the same probe policy preflight measures prompts with
(``tasks.prompts.opening_prompt``), and the text is ``ChatCodec.render_text``: the
very string whose tokens the policy is given for its first action. The probe renders with
the shown model's codec, so an environment that picks its tool-call format from the chat
template (an agent environment's ``tool_format = "auto"``) picks what training on that model
picks. Only the opening prompt is shown: later turns depend on what the model replies.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig
from rollflow.envs.handle import EnvironmentHandle
from rollflow.envs.protocol import describe_tools
from rollflow.envs.types import Split


@dataclass(frozen=True)
class PromptPreview:
    split: Split
    index: int  # the task's position in its split
    task_id: str
    text: str  # the rendered prompt, chat template and generation prompt included
    tokens: int  # its length in the model's tokens
    tools: tuple[str, ...]  # the tools offered, in the order they are described


def preview_prompt(config: RunConfig, handle: EnvironmentHandle, split: Split = "train", index: int = 0) -> PromptPreview:
    """The opening prompt of task ``index`` of ``split``, rendered for ``config``'s model.

    Raises ``ConfigError`` for a task that does not exist or cannot start, its prompt one the
    chat template cannot render included.
    """
    from rollflow.generators.models import base_model_ref
    from rollflow.policy.codec import ChatCodec, ChatTemplateError
    from rollflow.policy.models import load_tokenizer
    from rollflow.tasks.prompts import opening_prompt, unrenderable_prompt

    items = handle.tasks(split)
    if not items:
        raise ConfigError(f"{config.env.name} has no {split} tasks")
    if not 0 <= index < len(items):
        raise ConfigError(f"--task {index}: {config.env.name} has {len(items)} {split} tasks, numbered 0 to {len(items) - 1}")
    item = items[index]
    codec = ChatCodec(load_tokenizer(base_model_ref(config)))
    messages, tool_specs = opening_prompt(config.env.name, handle, item, codec)
    try:
        text = codec.render_text(messages, tool_specs)
    except ChatTemplateError as error:  # as a rollout's first action would fail
        raise unrenderable_prompt(config, item, error) from error
    tools = tuple(str(spec.get("function", {}).get("name", "?")) for spec in tool_specs)
    if not tools and messages and messages[0].get("role") == "system":
        tools = described_tool_names(str(messages[0].get("content") or ""))
    return PromptPreview(split, index, item.task_id, text, len(codec.encode(text)), tools)


def describe_preview(preview: PromptPreview, model: str) -> str:
    """One line about the prompt: which task, how long, for which model, which tools."""
    tools = ", ".join(preview.tools) if preview.tools else "none"
    return (
        f"{preview.split} task {preview.index} ({preview.task_id!r}): {preview.tokens} tokens "
        f"with the chat template of {model}; tools: {tools}"
    )


def described_tool_names(system_text: str) -> tuple[str, ...]:
    """The tools that rollflow's protocol text at the end of ``system_text`` describes: the
    ``describe_tools`` text an agent environment's endpoint writes from the agent's own
    ``tools=`` (its policy is given no tool specs). Read back, and kept only when describing
    what was read gives that very text again; () when there is none."""
    start = system_text.rfind(_DESCRIBED_TOOLS_HEADER)
    if start < 0:
        return ()
    described = system_text[start:]
    try:
        specs = [
            {"type": "function", "function": {"name": name, "description": description, "parameters": json.loads(schema)}}
            for name, description, schema in _DESCRIBED_TOOL.findall(described)
        ]  # fmt: skip
        read_back = bool(specs) and describe_tools(specs) == described
    except ValueError:  # not a schema, or not a spec: not describe_tools' text
        return ()
    return tuple(spec["function"]["name"] for spec in specs) if read_back else ()


_DESCRIBED_TOOLS_HEADER = describe_tools([{"type": "function", "function": {"name": "any"}}]).partition("\n")[0]
# one tool of that text: "- NAME: DESCRIPTION" (of one line or several), then its schema's line
_DESCRIBED_TOOL = re.compile(r"^- ([^:\n]+): (.*?)\n  arguments schema: (\{[^\n]*\})$", re.M | re.S)
