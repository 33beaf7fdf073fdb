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
