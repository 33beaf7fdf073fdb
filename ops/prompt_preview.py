"""``rollflow env show``: the exact prompt a policy is given for one task of an environment.

What the model reads is more than the environment's messages: the policy's codec adds the
tool descriptions and the tool-call protocol (``envs.protocol.describe_tools``) to the
system prompt and renders the whole conversation with the model's chat template. Reading
the environment's code shows none of that; ``preview_prompt`` renders it the way a
rollout does, so an author sees what a small model will copy (its example call, say).

The task's episode really starts (``start_episode`` / ``Env.reset`` run, then its close),
through the same probe policy preflight measures prompts with
(``tasks.prompts.first_policy_call``), and the text is ``ChatCodec.render_text``: the
very string whose tokens the policy is given for its first action. The probe renders with
the shown model's codec, so an environment that picks its tool-call format from the chat
template (an agent environment's ``tool_format = "auto"``) picks what training on that model
picks. Only the opening prompt is shown: later turns depend on what the model replies.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig
from rollflow.envs.handle import EnvironmentHandle
from rollflow.envs.types import Split


@dataclass(frozen=True)
class PromptPreview:
    split: Split
    index: int  # the task's position in its split
    task_id: str
    text: str  # the rendered prompt, chat template and generation prompt included
    tokens: int  # its length in the model's tokens
    tools: tuple[str, ...]  # the tools offered (an agent's: its request's), in the order they are described


def preview_prompt(config: RunConfig, handle: EnvironmentHandle, split: Split = "train", index: int = 0) -> PromptPreview:
    """The opening prompt of task ``index`` of ``split``, rendered for ``config``'s model.

    Raises ``ConfigError`` for a task that does not exist or cannot start, its prompt one the
    chat template cannot render included.
    """
    from rollflow.generators.models import base_model_ref
    from rollflow.policy.codec import ChatCodec, ChatTemplateError
    from rollflow.policy.models import load_tokenizer
    from rollflow.tasks.prompts import first_policy_call, unrenderable_prompt

    items = handle.tasks(split)
    if not items:
        raise ConfigError(f"{config.env.name} has no {split} tasks")
    if not 0 <= index < len(items):
        raise ConfigError(f"--task {index}: {config.env.name} has {len(items)} {split} tasks, numbered 0 to {len(items) - 1}")
    item = items[index]
    codec = ChatCodec(load_tokenizer(base_model_ref(config)))
    first = first_policy_call(config.env.name, handle, item, codec)
    try:
        text = codec.render_text(first.messages, first.tool_specs)
    except ChatTemplateError as error:  # as a rollout's first action would fail
        raise unrenderable_prompt(config, item, error) from error
    return PromptPreview(split, index, item.task_id, text, len(codec.encode(text)), first.tools)


def describe_preview(preview: PromptPreview, model: str) -> str:
    """One line about the prompt: which task, how long, for which model, which tools."""
    tools = ", ".join(preview.tools) if preview.tools else "none"
    return (
        f"{preview.split} task {preview.index} ({preview.task_id!r}): {preview.tokens} tokens "
        f"with the chat template of {model}; tools: {tools}"
    )
