"""``rollflow env show``: the exact prompt a policy is given (flows/cli_env.py, ops/prompt_preview.py)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from rollflow.config.run import config_to_toml, load_config
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.runner import load_environment_handle
from rollflow.envs.scripted import ScriptedPolicy
from rollflow.flows.cli import main
from rollflow.policy.codec import ChatCodec
from rollflow.policy.models import ModelRef, load_tokenizer

GAME = "rollflow.envs.tool_use_game:load_environment"


def show(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(["env", "show", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_it_prints_the_rendered_prompt_a_rollout_gives_the_policy(
    capsys: pytest.CaptureFixture[str], bundled_tokenizer: PreTrainedTokenizerBase
) -> None:
    status, out, err = show([GAME, "--task", "2", "--kwargs", '{"worked_example": false}'], capsys)
    assert status == 0
    handle = load_environment_handle(GAME, {"worked_example": False})
    item = handle.tasks("train")[2]
    seen: list[list[dict]] = []
    policy = ScriptedPolicy(lambda messages, turn: seen.append(list(messages)) or "42")
    asyncio.run(handle.play(item, policy, EpisodeLimits(max_turns=1)))  # what a rollout gives the policy
    messages, specs = seen[0], list(policy.opened_tool_specs[0])
    assert out == ChatCodec(bundled_tokenizer).render_text(messages, specs)  # byte for byte
    assert out.startswith("<|im_start|>system\n") and out.endswith("<|im_start|>assistant\n")
    assert "- lookup: " in out and '{"name": "list_fact_keys", "arguments": {}}' in out
    assert "TOOL_NAME" not in out
    tokens = len(ChatCodec(bundled_tokenizer).render_prompt_ids(messages, specs))
    assert err.strip() == (
        f"train task 2 ({item.task_id!r}): {tokens} tokens with the chat template of the bundled "
        "SmolLM2-135M-Instruct; tools: list_fact_keys, lookup, calculator"
    )


def test_a_config_gives_the_environment_its_kwargs_and_its_model(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = Path(__file__).resolve().parent.parent
    config = load_config(repo / "configs" / "tiny.toml")
    config = replace(config, model=replace(config.model, path=str(tiny_model_dir)),
                     env=replace(config.env, kwargs={"num_validation": 3}))
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(config))
    status, out, err = show(["--config", str(path), "--split", "validation", "--task", "2"], capsys)
    assert status == 0 and out.endswith("<|im_start|>assistant\n")
    assert err.startswith("validation task 2 ") and f"chat template of {tiny_model_dir};" in err
    status, _, err = show(["--config", str(path), "--split", "validation", "--task", "3"], capsys)
    assert status == 1
    assert err.strip() == f"rollflow env: --task 3: {GAME} has 3 validation tasks, numbered 0 to 2"


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        ([], "give the environment (module:function) or a --config"),
        (["no_such_env:load_environment"], "no module named 'no_such_env'"),
        ([GAME, "--kwargs", "[1]"], "--kwargs must be a JSON object, got list"),
        ([GAME, "--kwargs", "{nope"], "--kwargs is not JSON"),
        ([GAME, "--kwargs", json.dumps({"colour": 1})], "unexpected keyword argument 'colour'"),
    ],
)
def test_mistakes_are_one_line(argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = show(argv, capsys)
    assert status == 1 and out == "" and len(err.splitlines()) == 1 and problem in err


# ---------------------------------------------------------------- an agent environment

AGENT = "rollflow.envs.openai_agent:load_environment"
REPO = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).parent / "templates"
GAME_TOOLS = "tools: list_fact_keys, lookup, calculator"
ONE_CALL_AGENT = {"agent": "test_envs_openai_agent:uses_a_tool", "tasks": "test_envs_openai_agent:tasks",
                  "reward": "test_envs_openai_agent:reward"}  # fmt: skip


def family_config(tmp_path: Path, tiny_model_dir: Path, template: str) -> Path:
    """configs/openai_agent.toml (the example agent) on the tiny model with ``template``."""
    import shutil

    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    tokenizer.save_pretrained(str(model_dir))
    config = load_config(REPO / "configs" / "openai_agent.toml")
    path = tmp_path / "agent.toml"
    path.write_text(config_to_toml(replace(config, model=replace(config.model, path=str(model_dir)))))
    return path


@pytest.mark.parametrize(("template", "kwargs", "marker", "tools"), [
    ("qwen2.5-instruct.jinja", None, '<tools>\n{"type": "function", "function": {"name": "list_fact_keys"', GAME_TOOLS),
    ("llama-3.1-instruct.jinja", ONE_CALL_AGENT, "Given the following functions", "tools: lookup"),
])  # fmt: skip
def test_an_agent_environment_shows_the_tool_format_training_on_the_model_uses(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str],
    template: str, kwargs: dict[str, str] | None, marker: str, tools: str,
) -> None:  # fmt: skip
    """tool_format "auto" reads the policy's chat template. The preview's probe had none, so
    the agent always got rollflow's protocol, although training on a model whose template
    renders tools= uses that family's format (hermes, llama3_json): what is shown is now what
    a policy with that template is given."""
    path = family_config(tmp_path, tiny_model_dir, template)
    flags = [] if kwargs is None else ["--kwargs", json.dumps(kwargs)]
    status, out, err = show(["--config", str(path), *flags], capsys)
    assert status == 0, err
    config = load_config(path)
    codec = ChatCodec(load_tokenizer(ModelRef(path=config.model.path)))
    seen: list[list[dict]] = []
    policy = ScriptedPolicy(lambda messages, turn: seen.append(list(messages)) or "42")
    policy.codec = codec  # type: ignore[attr-defined]  # a policy rendering with this template, as in training
    handle = load_environment_handle(AGENT, kwargs or config.env.kwargs)
    asyncio.run(handle.play(handle.tasks("train")[0], policy, EpisodeLimits(max_turns=1)))
    assert out == codec.render_text(seen[0], policy.opened_tool_specs[0])  # byte for byte
    assert marker in out and "You can call tools." not in out  # the template's tools, not rollflow's protocol
    assert err.strip().endswith(tools)


def test_a_prompt_the_chat_template_cannot_render_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Llama 3.1's template refuses the example agent's worked example (two calls in one
    reply): a traceback before, now the one line a task that cannot start gets."""
    status, out, err = show(["--config", str(family_config(tmp_path, tiny_model_dir, "llama-3.1-instruct.jinja"))], capsys)
    assert status == 1 and out == "" and len(err.splitlines()) == 1, err
    assert "does not render with the chat template of" in err and "only supports single tool-calls at once" in err


def test_an_agent_environment_in_rollflows_protocol_lists_the_agents_tools(capsys: pytest.CaptureFixture[str]) -> None:
    """The bundled model's template ignores tools=, so the endpoint describes the agent's
    tools in the system message and the policy is given no tool specs: the last line said
    "tools: none" of a prompt that lists three."""
    status, out, err = show(["--config", str(REPO / "configs" / "openai_agent.toml")], capsys)
    assert status == 0, err
    assert "- lookup: " in out and '<tool_call>{"name": "list_fact_keys", "arguments": {}}</tool_call>' in out
    assert err.strip().endswith(GAME_TOOLS)
