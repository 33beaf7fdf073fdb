"""What an export needs to be served as it was trained: the system text with its tools.

A rollflow policy never sees the tools through its chat template's ``tools=`` argument
(``policy/codec.py``): the codec appends ``envs.protocol.describe_tools`` (the tools, their
argument schemas and the ``<tool_call>`` protocol) to the system message, and the model
answers with ``<tool_call>`` blocks in its text. A server started on the export with
``vllm serve`` and asked with an OpenAI ``tools=[...]`` list would render a prompt the
policy never saw (SmolLM2's template ignores ``tools`` altogether; others write their own
syntax). So every export of a run whose environment offers tools carries:

- ``system_prompt.txt``: the exact system message of the environment's first validation
  task (else training task) with the tool text appended, as the codec builds it;
- ``tools.json``: the OpenAI-style tool specs it describes;
- ``SERVING.md``: how to send it (as the first message, without ``tools=``), how to read
  the calls from a reply and hand back their results, and the ``rollflow chat`` line that
  does all of it against the server.

The text is that of one task: an environment whose system message differs from task to
task (most do not) must build each task's own, which ``rollflow env show SPEC --task N``
prints. An environment that cannot be loaded where the export runs gets a ``SERVING.md``
that says so and how to get the text, and the export goes on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rollflow.config.run import RunConfig

SYSTEM_PROMPT_FILE = "system_prompt.txt"
TOOLS_FILE = "tools.json"
SERVING_FILE = "SERVING.md"


@dataclass(frozen=True)
class ServingText:
    system: str  # the system message's content, tool text included
    tool_specs: list[dict]
    task_id: str


def serving_text(config: RunConfig) -> ServingText | None:
    """The system message a rollout of ``config`` gives the policy for its first
    validation (else training) task; None when the environment offers no tools."""
    from rollflow.envs.protocol import describe_tools
    from rollflow.envs.runner import load_environment_handle
    from rollflow.policy.codec import with_tools_in_system_prompt
    from rollflow.tasks.prompts import opening_prompt

    handle = load_environment_handle(config.env.name, config.env.kwargs)
    items = handle.tasks("validation") or handle.tasks("train")
    if not items:
        return None
    messages, tool_specs = opening_prompt(config.env.name, handle, items[0])
    tools_text = describe_tools(tool_specs)
    if not tools_text:
        return None
    system = with_tools_in_system_prompt(messages, tools_text)[0]
    return ServingText(str(system["content"]), [dict(spec) for spec in tool_specs], items[0].task_id)


def write_serving_files(config: RunConfig, dest: Path, served_as: str) -> None:
    """``system_prompt.txt``, ``tools.json`` and ``SERVING.md`` in ``dest`` (see the module
    docstring); ``served_as`` is the ``vllm serve`` line of this export."""
    try:
        text = serving_text(config)
    except Exception as error:  # noqa: BLE001 - the export stands without them; SERVING.md says why
        (dest / SERVING_FILE).write_text(_unavailable(config, f"{type(error).__name__}: {error}"))
        return
    if text is None:
        return  # no tools: the model's own template serves it as trained
    (dest / SYSTEM_PROMPT_FILE).write_text(text.system)
    (dest / TOOLS_FILE).write_text(json.dumps(text.tool_specs, indent=1, ensure_ascii=False) + "\n")
    (dest / SERVING_FILE).write_text(_guide(config, text, served_as))


def _guide(config: RunConfig, text: ServingText, served_as: str) -> str:
    names = ", ".join(str(spec.get("function", {}).get("name", "?")) for spec in text.tool_specs)
    return f"""# Serving this policy

It was trained on `{config.env.name}` with the tools {names}, described to it in its
system message, never through the chat template's `tools=`. Serve it so that it reads the
same prompt:

1. Start a server: `{served_as}`
2. Send `system_prompt.txt` (this folder) as the first message, `{{"role": "system",
   "content": ...}}`, then the user's message. Do **not** pass `tools=`: the template
   would render a prompt the policy never saw.
3. A reply that calls tools holds one `<tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>`
   block per call (`rollflow.envs.protocol.parse_action` reads them). Run each, and send
   each result back as a message `{{"role": "tool", "name": <tool>, "content": <text>}}`,
   keeping the assistant's reply in the conversation as it was written. A reply without a
   block is the final answer.

`rollflow chat --base-url http://127.0.0.1:8000/v1 --api-model MODEL --env {config.env.name}
--tools-in-system-prompt` does all of it against the server, running the environment's
tools (`MODEL`: the name the server serves, the export folder by default).

The system text is that of task `{text.task_id}`. Where an environment's system message
differs by task, `rollflow env show {config.env.name} --task N` prints each task's prompt.
`tools.json` holds the tool specs that text describes.
"""


def _unavailable(config: RunConfig, why: str) -> str:
    return f"""# Serving this policy

The policy was trained with rollflow's tool text in its system message, not with the chat
template's `tools=`. The export could not load its environment `{config.env.name}` to write
that text here ({why}). Where the environment loads, `rollflow env show {config.env.name}`
prints the exact prompt; send its system message as the first message, without `tools=`.
"""
