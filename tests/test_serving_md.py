"""An export's serving path as its ``SERVING.md`` writes it (``flows/export_serving.py``): the
server line runs on this machine's vLLM for CPU, the model name it gives is the trained
policy's, and the ``rollflow chat`` / ``rollflow eval`` lines it prints parse and work
against that server (issue 59: F5 of the review, F1, F2 and F5 of the newcomer's trial)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from rollflow.config.run import load_config
from rollflow.flows.cli import build_parser
from rollflow.flows.eval_config import EvalOverrides, eval_config
from rollflow.flows.export import ExportError, export_policy
from rollflow.policy.vllm_spec import DEFAULT_PYTHON
from rollflow.storage.runfolder import RunFolder
from test_export import run_with_checkpoints

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class ShellLine:
    """One line of a ``sh`` block: its leading ``NAME=value`` assignments and its words."""

    environment: dict[str, str]
    argv: list[str]

    def flag(self, name: str) -> str:
        return self.argv[self.argv.index(name) + 1]


def shell_lines(guide: str) -> list[ShellLine]:
    """The command lines of ``guide``'s fenced ``sh`` blocks, split as a shell splits them."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)\n```", guide, re.S):
        words = shlex.split(block)
        assigned = 0
        while assigned < len(words) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[assigned]):
            assigned += 1
        environment = dict(word.split("=", 1) for word in words[:assigned])
        lines.append(ShellLine(environment, words[assigned:]))
    return lines


def guide_lines(guide: str) -> tuple[ShellLine, ShellLine, ShellLine]:
    """(server, chat, eval) lines of a SERVING.md."""
    lines = shell_lines(guide)
    server = [line for line in lines if SERVER_MODULE in line.argv]
    chat = [line for line in lines if line.argv[:2] == ["rollflow", "chat"]]
    evaluate = [line for line in lines if line.argv[:2] == ["rollflow", "eval"]]
    assert len(server) == len(chat) == len(evaluate) == 1, f"SERVING.md's command lines: {lines}\n{guide}"
    return server[0], chat[0], evaluate[0]


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> RunFolder:
    return run_with_checkpoints(tmp_path_factory.mktemp("serving") / "run", tiny_model_dir, use_lora=True, steps=1)


def test_serving_md_of_an_adapter_serves_it_as_policy_on_the_cpu_and_its_lines_parse(
    adapter_run: RunFolder, tmp_path: Path
) -> None:
    """The old guide said `vllm serve BASE ...` (dies in the CPU wheel), MODEL "the export
    folder by default" (404; the other name served, BASE, is the untrained model), and a
    chat line without RUN_DIR that argparse refused."""
    out = tmp_path / "adapter"
    result = export_policy(adapter_run.root, out)
    server, chat, evaluate = guide_lines((out / "SERVING.md").read_text())
    assert server.environment["VLLM_CPU_KVCACHE_SPACE"] == "2" and server.environment["HF_HUB_OFFLINE"] == "1"
    assert server.argv[1:3] == ["-m", SERVER_MODULE]
    assert server.flag("--model") == result.base_model and server.flag("--served-model-name") == "base"
    assert server.flag("--lora-modules") == f"policy={out}" and server.flag("--max-lora-rank") == "8"
    assert (server.flag("--host"), server.flag("--dtype")) == ("127.0.0.1", "float32")
    assert result.serve.endswith(shlex.join(server.argv))  # what `rollflow export` prints
    assert json.loads((out / "export.json").read_text())["served_model"] == "policy"

    config = load_config(adapter_run.config_path)
    chat_args = build_parser().parse_args(chat.argv[1:])
    assert chat_args.run_dir is None and chat_args.tools_in_system_prompt
    assert (chat_args.api_model, chat_args.env) == ("policy", config.env.name)
    assert chat_args.base_url == f"http://127.0.0.1:{server.flag('--port')}/v1"
    eval_args = build_parser().parse_args(evaluate.argv[1:])
    assert (eval_args.api_model, eval_args.base_url) == ("policy", chat_args.base_url)
    assert eval_args.tools_in_system_prompt and eval_args.config == str(adapter_run.config_path)


def test_serving_md_of_a_merged_export_names_the_policy_on_the_command_line(
    adapter_run: RunFolder, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollflow.flows.cli import main

    out = tmp_path / "merged"
    assert main(["export", str(adapter_run.root), "--out", str(out), "--merged"]) == 0
    printed = capsys.readouterr().out
    server, chat, _ = guide_lines((out / "SERVING.md").read_text())
    assert server.flag("--model") == str(out) and server.flag("--served-model-name") == "policy"
    assert "--enable-lora" not in server.argv and chat.flag("--api-model") == "policy"
    assert f"  serve: {json.loads((out / 'export.json').read_text())['serve']}\n" in printed
    assert 'the trained policy is served as model "policy"' in printed
    if DEFAULT_PYTHON.is_file() and "ROLLFLOW_VLLM_PYTHON" not in os.environ:
        assert server.argv[0] == str(DEFAULT_PYTHON)  # the project's vLLM, not a `python` to find


def test_the_environments_kwargs_travel_in_the_chat_line(adapter_run: RunFolder, tmp_path: Path) -> None:
    from rollflow.flows.chat import chat_env_config
    from rollflow.flows.export_serving import client_commands, serve_command

    config = load_config(adapter_run.config_path)
    config = replace(config, env=replace(config.env, kwargs={"num_tasks": 3}))
    chat, _ = client_commands(config, serve_command(config, str(tmp_path)), str(adapter_run.root))
    args = build_parser().parse_args(shlex.split(chat)[1:])
    assert json.loads(args.kwargs) == {"num_tasks": 3}
    assert chat_env_config(args.run_dir, args.env, json.loads(args.kwargs)) == (config.env.name, {"num_tasks": 3})


def test_a_lora_rank_vllm_cannot_serve_is_refused_with_the_way_out() -> None:
    """export.py had its own rank table, which wrote `--max-lora-rank 600` for rank 600
    (vLLM refuses it); the spec's ``lora_rank_limit`` raises, and the export says --merged."""
    from rollflow.config.run import RunConfig
    from rollflow.flows.export import ExportResult, served_by

    result = ExportResult(out="/x/out", run_dir="/x/run", step=0, policy_version=1, format="adapter",
                          base_model="/x/base", lora_rank=600)
    with pytest.raises(ExportError, match=r"LoRA rank 600 is above vLLM's largest --max-lora-rank 512.*--merged"):
        served_by(RunConfig(), result)
    assert served_by(RunConfig(), replace(result, lora_rank=512)).argv[-1] == "512"
    assert served_by(RunConfig(), replace(result, lora_rank=4)).argv[-1] == "8"


# ---------------------------------------------------------------- an agent environment's export

AGENT = "rollflow.envs.openai_agent:load_environment"
AGENT_KWARGS: dict[str, object] = {
    "agent": "rollflow.envs.openai_agent_example.agent:run",
    "tasks": "rollflow.envs.openai_agent_example.game:tasks",
    "reward": "rollflow.envs.openai_agent_example.game:reward",
}
TEMPLATES = Path(__file__).parent / "templates"


def agent_run(source: RunFolder, root: Path, model_dir: Path | None = None, **kwargs: object) -> RunFolder:
    """A copy of ``source`` (its checkpoints) whose config trains the example agent with
    ``kwargs`` (on the model at ``model_dir``, when given)."""
    import shutil

    from rollflow.config.run import EnvConfig, config_to_toml

    shutil.copytree(source.root, root)
    folder = RunFolder(root)
    config = load_config(folder.config_path)
    config = replace(config, env=EnvConfig(AGENT, {**AGENT_KWARGS, **kwargs}))
    if model_dir is not None:
        config = replace(config, model=replace(config.model, path=str(model_dir)))
    folder.config_path.write_text(config_to_toml(config))  # the run as if it had trained the agent
    return folder


def family_model(tiny_model_dir: Path, root: Path, template: str) -> Path:
    """The tiny model with a model family's real chat template (tests/templates)."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(tiny_model_dir, root)
    tokenizer = AutoTokenizer.from_pretrained(str(root))
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    tokenizer.save_pretrained(str(root))
    return root


def test_an_agent_export_says_its_tools_are_the_agents_and_serves_it_through_rollflows_endpoint(
    adapter_run: RunFolder, tmp_path: Path
) -> None:
    """An agent environment's export had no SERVING.md at all (its tools come per call, so
    there was no tools.json to write): nothing said where the tools come from or which
    tool-call format the policy learned. The bundled model's template ignores tools, so the
    endpoint used rollflow's protocol, which no vLLM parser reads: no parser on the server
    line, and the guide's eval line plays the agent through the endpoint."""
    prompt = "Look the facts up before you answer."
    run = agent_run(adapter_run, tmp_path / "agent-run", system_prompt=prompt)
    out = tmp_path / "adapter"
    result = export_policy(run.root, out)
    assert not (out / "tools.json").exists() and not (out / "system_prompt.txt").exists()
    guide = (out / "SERVING.md").read_text()
    assert "Tool-call format: `rollflow`." in guide and "the tools come from the agent's\n`tools=`" in guide
    assert "`rollflow.envs.openai_agent_example.agent:run`" in guide and prompt in guide
    server, evaluate = (line for line in shell_lines(guide))
    assert SERVER_MODULE in server.argv and "--tool-call-parser" not in server.argv and "--tool-call-parser" not in result.serve
    args = build_parser().parse_args(evaluate.argv[1:])
    assert (args.command, args.config) == ("eval", str(run.config_path))
    assert (args.base_url, args.api_model, args.tools_in_system_prompt) == ("http://127.0.0.1:8000/v1", "policy", False)


def test_the_eval_line_of_an_agent_export_plays_the_agent_through_the_endpoint(
    adapter_run: RunFolder, tmp_path: Path, prefect_harness: object
) -> None:
    """What the rollflow-protocol guide promises: its eval line runs the agent against the
    server with the prompts of training, the tools described in the system message (never
    `tools=`, which the template would drop), every episode played to its end."""
    from json_server import json_server

    from rollflow.envs.openai_agent_example.game import SYSTEM_PROMPT
    from rollflow.flows.cli import main

    bodies: list[dict[str, object]] = []

    def answer(path: str, headers: object, body: dict[str, object]) -> tuple[int, object, float]:
        bodies.append(body)
        choice = {"index": 0, "message": {"role": "assistant", "content": "17"}, "finish_reason": "stop"}
        return 200, {"id": "c", "object": "chat.completion", "choices": [choice],
                     "usage": {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32}}, 0.0  # fmt: skip

    run = agent_run(adapter_run, tmp_path / "agent-run")
    export_policy(run.root, tmp_path / "adapter")
    _, evaluate = shell_lines((tmp_path / "adapter" / "SERVING.md").read_text())
    with json_server(answer) as url:
        argv = _with_flag(evaluate.argv[1:], "--base-url", f"{url}/v1")
        assert main([*argv, "--run-dir", str(tmp_path / "eval"), "--tasks", "2"]) == 0
    assert len(bodies) == 2 and all("tools" not in body and body["model"] == "policy" for body in bodies)
    system = bodies[0]["messages"][0]  # type: ignore[index]
    assert system["role"] == "system" and system["content"].startswith(SYSTEM_PROMPT)
    assert "<tool_call>" in system["content"]  # rollflow's protocol, as the endpoint trained it
    assert _episode_errors(tmp_path / "eval") == [None, None]


@pytest.mark.parametrize(("template", "tool_format", "parser"), [
    ("qwen2.5-instruct.jinja", "auto", "hermes"),
    ("llama-3.1-instruct.jinja", "auto", "llama3_json"),
    ("qwen3.jinja", "mistral", "mistral"),  # a family named in [env].kwargs wins over the template's
])  # fmt: skip
def test_an_agent_export_in_a_familys_format_is_served_with_vllms_parser_of_that_name(
    adapter_run: RunFolder, tiny_model_dir: Path, tmp_path: Path, template: str, tool_format: str, parser: str
) -> None:
    """The endpoint read the policy's calls in its template's family format; the server must
    read them the same way, so its line (in SERVING.md and export.json) names that parser,
    and the agent calls the server as it called the endpoint."""
    model = family_model(tiny_model_dir, tmp_path / "model", template)
    run = agent_run(adapter_run, tmp_path / "agent-run", model_dir=model, tool_format=tool_format)
    out = tmp_path / "adapter"
    result = export_policy(run.root, out)
    assert not (out / "tools.json").exists()
    guide = (out / "SERVING.md").read_text()
    assert f"Tool-call format: `{parser}`." in guide and "environment's system prompt" not in guide
    (server,) = shell_lines(guide)
    assert server.argv[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    assert server.flag("--model") == str(model) and server.flag("--lora-modules") == f"policy={out}"
    assert result.serve.endswith(f"--enable-auto-tool-choice --tool-call-parser {parser}")
    assert json.loads((out / "export.json").read_text())["serve"] == result.serve
    assert 'base_url="http://127.0.0.1:8000/v1"' in guide and 'await run(task, client, "policy")' in guide


def test_a_family_named_for_a_template_that_ignores_tools_is_said_in_serving_md(
    adapter_run: RunFolder, tmp_path: Path
) -> None:
    """A run whose tool_format the exported template cannot have served (the training would
    have refused it) still exports: SERVING.md says why it has no guide."""
    run = agent_run(adapter_run, tmp_path / "agent-run", tool_format="hermes")
    out = tmp_path / "adapter"
    result = export_policy(run.root, out)
    guide = (out / "SERVING.md").read_text()
    assert "the tools come from the agent's\n`tools=`" in guide
    assert "could not tell which tool-call format" in guide and "tool_format='hermes' has the chat template" in guide
    assert "--tool-call-parser" not in result.serve


# ---------------------------------------------------------------- eval --tools-in-system-prompt


def test_eval_sends_the_tools_in_the_system_prompt_when_asked() -> None:
    """`rollflow eval --base-url` sent the tools as `tools=`, which vLLM refuses (HTTP 400,
    "auto" tool choice) and which the policy never saw in training; there was no flag."""
    from rollflow.config.run import RunConfig
    from rollflow.generators.generator import openai_generator
    from rollflow.policy.openai_backend import OpenAIChatPolicy

    args = build_parser().parse_args(["eval", "--base-url", "http://127.0.0.1:8000/v1", "--api-model", "policy",
                                      "--tools-in-system-prompt"])
    overrides = EvalOverrides(base_url=args.base_url, api_model=args.api_model,
                              tools_in_system_prompt=args.tools_in_system_prompt)
    config = eval_config(RunConfig(), overrides)
    policy = openai_generator(config).policy
    assert isinstance(policy, OpenAIChatPolicy)
    spec = {"type": "function", "function": {"name": "add", "description": "adds", "parameters": {"type": "object"}}}
    body = policy.request_body([{"role": "system", "content": "Play."}, {"role": "user", "content": "hi"}], [spec], 0)
    assert "tools" not in body and body["messages"][0]["content"].startswith("Play.")
    assert "- add: adds" in body["messages"][0]["content"]
    plain = openai_generator(eval_config(RunConfig(), replace(overrides, tools_in_system_prompt=False))).policy
    assert isinstance(plain, OpenAIChatPolicy)
    assert plain.request_body([{"role": "user", "content": "hi"}], [spec], 0)["tools"] == [spec]


REFUSED_TOOLS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def _failure(command: Callable[[], int], capsys: pytest.CaptureFixture[str]) -> str:
    """What a failed ``rollflow`` command said: its one line (exit 1), or the step's error
    where it escaped as an exception (how `rollflow eval` ended when this test was written)."""
    from rollflow.tasks.step_health import StepFailedError

    try:
        assert command() == 1
    except StepFailedError as failed:
        return str(failed)
    return capsys.readouterr().err


def test_rollflow_eval_against_a_server_that_refuses_tools_plays_with_the_flag(
    tmp_path: Path, prefect_harness: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newcomer's F2 through the command: a server that answers `tools=` as a plain vLLM
    server does (HTTP 400) failed every episode; with --tools-in-system-prompt the tools
    travel in the system message and every episode is played."""
    from json_server import json_server

    bodies: list[dict[str, object]] = []

    def answer(path: str, headers: object, body: dict[str, object]) -> tuple[int, object, float]:
        bodies.append(body)
        if "tools" in body:
            return 400, {"object": "error", "message": REFUSED_TOOLS, "type": "BadRequestError", "code": 400}, 0.0
        choice = {"index": 0, "message": {"role": "assistant", "content": "17"}, "finish_reason": "stop"}
        return 200, {"id": "c", "object": "chat.completion", "choices": [choice],
                     "usage": {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32}}, 0.0  # fmt: skip

    from rollflow.flows.cli import main

    config = tmp_path / "served.toml"
    config.write_text("[tracking]\nenabled = false\n[validation]\nnum_tasks = 2\n")
    with json_server(answer) as url:
        served = ["eval", "--config", str(config), "--base-url", f"{url}/v1", "--api-model", "policy"]
        assert "HTTP 400" in _failure(lambda: main([*served, "--run-dir", str(tmp_path / "plain")]), capsys)
        bodies.clear()
        assert main([*served, "--tools-in-system-prompt", "--run-dir", str(tmp_path / "in-system")]) == 0
    assert len(bodies) == 2 and not any("tools" in body for body in bodies)
    system = bodies[0]["messages"][0]  # type: ignore[index]
    assert system["role"] == "system" and "- lookup: " in system["content"] and "<tool_call>" in system["content"]
    assert "episodes" in capsys.readouterr().out  # the report
    assert _episode_errors(tmp_path / "in-system") == [None, None]


def test_tools_in_the_system_prompt_without_a_server_is_refused() -> None:
    from rollflow.config.parsing import ConfigError
    from rollflow.config.run import RunConfig

    with pytest.raises(ConfigError, match="--tools-in-system-prompt is for a server"):
        eval_config(RunConfig(), EvalOverrides(tools_in_system_prompt=True))


# ---------------------------------------------------------------- the real server


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    changed = list(argv)
    changed[changed.index(flag) + 1] = value
    return changed


def _wait_until_healthy(process: subprocess.Popen[bytes], url: str, log: Path, limit_s: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url.removesuffix("/v1") + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    raise AssertionError(f"the server was not healthy within {limit_s} s:\n{log.read_text()[-4000:]}")


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's whole session (its engine outlives the API process by a
    second or two), SIGKILL after 30 s; returns once no process of the group is left."""
    for sent, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sent)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            process.poll()  # reap the leader, else the group never empties
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _episode_errors(run_dir: Path) -> list[str | None]:
    import duckdb

    pattern = str(run_dir / "validation" / "*" / "episodes" / "*.parquet")
    return [row[0] for row in duckdb.sql(f"SELECT error FROM read_parquet('{pattern}')").fetchall()]


@pytest.mark.slow  # a CPU vLLM server with LoRA, an eval and a chat against it: 2-4 minutes, ~5 GB
@pytest.mark.skipif(not DEFAULT_PYTHON.is_file(), reason="needs the vLLM Python (make vllm-setup)")
def test_the_served_export_answers_the_eval_and_chat_lines_of_its_serving_md(
    adapter_run: RunFolder, tmp_path: Path, own_tmpdir: Path
) -> None:
    """The server starts from SERVING.md's own line (only its port changed to a free one: a
    fixed 8000 would collide on a shared machine), on this machine's vLLM for CPU; the
    printed eval line scores the policy it serves by the name it gives, every episode
    played to its end (before: `vllm serve` died of a missing `vllm` distribution, the
    eval had no --tools-in-system-prompt and every episode failed with HTTP 400), and the
    printed chat line talks to it without a run folder."""
    import httpx

    out = tmp_path / "adapter"
    export_policy(adapter_run.root, out)
    server, chat, evaluate = guide_lines((out / "SERVING.md").read_text())
    port = _free_port()
    url = f"http://127.0.0.1:{port}/v1"
    rollflow = str(Path(sys.executable).with_name("rollflow"))
    # The eval's Prefect starts a temporary server; on a loaded machine its default 20 s
    # wait is too short (the Makefile sets this for the suite; the test must not rely on it)
    client_env = {**os.environ}
    client_env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(_with_flag(server.argv, "--port", str(port)), env={**os.environ, **server.environment},
                                   stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        _wait_until_healthy(process, url, log)
        served = {model["id"] for model in httpx.get(f"{url}/models", timeout=30).json()["data"]}
        assert served == {"policy", "base"} and evaluate.flag("--api-model") == "policy"
        eval_run = tmp_path / "eval"
        evaluated = subprocess.run(
            [rollflow, *_with_flag(evaluate.argv[1:], "--base-url", url), "--run-dir", str(eval_run)],
            capture_output=True, text=True, timeout=900, env=client_env,
        )  # fmt: skip
        assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
        errors = _episode_errors(eval_run)
        assert errors == [None, None], errors  # configs/tiny.toml: 2 validation tasks, 1 episode each
        chatted = subprocess.run(
            [rollflow, *_with_flag(chat.argv[1:], "--base-url", url)],
            input="What is 2 + 3?\n/exit\n", capture_output=True, text=True, timeout=300, env=client_env,
        )  # fmt: skip
        assert chatted.returncode == 0, chatted.stdout[-3000:] + chatted.stderr[-3000:]
        assert f"chatting with policy at {url}" in chatted.stdout
        assert "assistant> " in chatted.stdout or "  tool call " in chatted.stdout  # the policy answered
    finally:
        _stop_group(process)
    assert "POST /v1/chat/completions HTTP/1.1\" 200" in log.read_text()
