"""SFT for an agent environment: the user's agent, unchanged, played against an expert through
the capture endpoint gives transcripts that win, rows of exactly the tokens the policy would
sample (and only those trained), an SFT run on them, and a one-line refusal without an expert."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest

from rollflow.config.run import ModelConfig, SFTConfig, load_config
from rollflow.envs.agent import PolicyAction
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.openai_agent_expert import ExpertPolicy, play_expert
from rollflow.envs.runner import load_environment_handle
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.codec import ChatCodec, TokenState
from rollflow.policy.models import ModelRef, load_tokenizer
from rollflow.tasks.sft import read_sft_result, sft_examples, sft_rows, sft_stage
from rollflow.tasks.sft_rows import SFTDataError, examples_from_environment, tokenize_example

SPEC = "rollflow.envs.openai_agent:load_environment"
EXAMPLE = "rollflow.envs.openai_agent_example"
KWARGS = {"agent": f"{EXAMPLE}.agent:run", "tasks": f"{EXAMPLE}.game:tasks", "reward": f"{EXAMPLE}.game:reward",
          "expert": f"{EXAMPLE}.expert:expert"}  # fmt: skip
HERE = "test_agent_sft"
REPO = Path(__file__).resolve().parent.parent
QWEN = Path(__file__).parent / "templates" / "qwen2.5-instruct.jinja"


def tokenizer_with(tiny_model_dir: Path, template: Path | None) -> Any:
    tokenizer = load_tokenizer(ModelRef(path=str(tiny_model_dir)))
    if template is not None:
        tokenizer.chat_template = template.read_text()
    return tokenizer


class SampledAsTokens:
    """The expert's replies 'sampled' as their canonical tokens and the end of turn, the
    context kept by the chat codec as the transformers backend keeps it: an episode of the
    tokens a policy that writes the expert's replies would record."""

    version = 0

    def __init__(self, expert: ExpertPolicy, codec: ChatCodec) -> None:
        self.expert, self.codec = expert, codec

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> SampledAsTokens.Session:
        return SampledAsTokens.Session(self.expert.open_session(tool_specs), self.codec, list(tool_specs))

    class Session:
        def __init__(self, expert: Any, codec: ChatCodec, tools: list[ToolSpec]) -> None:
            self.expert, self.codec, self.tools = expert, codec, tools
            self.state: TokenState | None = None

        async def act(self, messages: Sequence[Message]) -> PolicyAction:
            self.state, delta, reset = self.codec.next_prompt(self.state, messages, self.tools)
            text = (await self.expert.act(messages)).text
            ids = (*self.codec.encode(text), self.codec.tokenizer.eos_token_id)
            self.state = self.codec.record_action(self.state, ids)
            return PolicyAction(text, ids, (0.0,) * len(ids), delta, reset, "stop")

        async def close(self) -> None:
            pass


# ---------------------------------------------------------------- the transcripts


def test_the_experts_transcripts_of_the_example_agent_win_the_game() -> None:
    """The example agent, unchanged, plays the game's own expert: each episode scores 1.0 by
    the environment's reward, and its transcript is the four actions and the tool results."""
    handle = load_environment_handle(SPEC, KWARGS)
    items = handle.tasks("train")[:4]
    played = asyncio.run(play_expert(handle, items))
    scores = [asyncio.run(handle.score(item, [rollout]))[0] for item, (rollout, _) in zip(items, played, strict=True)]
    assert [(s.reward, s.error) for s in scores] == [(1.0, None)] * 4
    for item, (rollout, found) in zip(items, played, strict=True):
        (transcript,) = found
        task = item.payload.metadata  # type: ignore[union-attr]
        assert transcript.prompt[-1] == {"role": "user", "content": task["question"]}
        assert "lookup: Look up the value of one fact" in transcript.prompt[0]["content"]  # rollflow's protocol
        replies = [m for m in transcript.target if m["role"] == "assistant"]
        assert [[c["function"]["name"] for c in m.get("tool_calls", [])] for m in replies] == [
            ["list_fact_keys"], ["lookup"] * len(task["needed_keys"]), ["calculator"], []]
        assert replies[-1]["content"] == str(task["answer"]) and rollout.response_text == str(task["answer"])
        # what the endpoint recorded, the system prompt as the policy saw it (with the tools)
        assert [*transcript.prompt, *transcript.target][1:] == list(rollout.messages[1:])
        assert transcript.prompt[0]["content"].startswith(rollout.messages[0]["content"] + "\n\nYou can call tools.")


@pytest.mark.parametrize("template", [None, QWEN], ids=["bundled-rollflow", "qwen-hermes"])
def test_sft_rows_are_the_tokens_a_policy_would_sample_and_train_only_its_own(
    tiny_model_dir: Path, template: Path | None
) -> None:
    """A rollout through the endpoint whose policy samples the expert's replies holds exactly
    the SFT row's ids, in the tool format the chat template picks; the row trains exactly
    the sampled tokens (the agent's tool results and the prompt are context)."""
    tokenizer = tokenizer_with(tiny_model_dir, template)
    codec = ChatCodec(tokenizer)
    [example] = examples_from_environment(SPEC, KWARGS, 1, tokenizer=lambda: tokenizer)
    handle = load_environment_handle(SPEC, KWARGS)
    item = handle.tasks("train")[0]
    expert = handle.env.expert  # type: ignore[attr-defined]
    policy = SampledAsTokens(ExpertPolicy(expert, item.payload.metadata, codec), codec)  # type: ignore[union-attr]
    rollout = asyncio.run(handle.play(item, policy, EpisodeLimits()))
    assert rollout.error is None and rollout.terminated and not any(a.reset for a in rollout.actions[1:])
    assert {m["tool_format"] for m in rollout.step_metadata[:-1]} == {"rollflow" if template is None else "hermes"}
    row = tokenize_example(codec, example)
    played, sampled = [], []
    for action in rollout.actions:
        played += [*action.prompt_delta_ids, *action.token_ids]
        sampled += [0] * len(action.prompt_delta_ids) + [1] * len(action.token_ids)
    assert row.input_ids == tuple(played)
    assert row.loss_mask == tuple(sampled) and example.assistant_only
    trained = tokenizer.decode([t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m])
    keys = example.target[1]  # the list_fact_keys result: the agent's tool wrote it, never the policy
    assert keys["name"] == "list_fact_keys" and keys["content"] in tokenizer.decode(row.input_ids)
    assert keys["content"] not in trained and '"lookup"' in trained
    assert trained.endswith(example.target[-1]["content"] + "<|im_end|>")  # the answer and its end of turn


# ---------------------------------------------------------------- agents that do other things


async def asks_twice_in_two_threads(task: dict[str, Any], client: openai.AsyncOpenAI, model: str) -> str:
    """A main thread and a sub-agent's own thread: two histories that do not extend each other."""
    first = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": task["q"]}])
    fresh = [{"role": "system", "content": "Check it."}, {"role": "user", "content": first.choices[0].message.content}]
    second = await client.chat.completions.create(model=model, messages=fresh)
    return second.choices[0].message.content or ""


def two_tasks(split: str) -> list[dict[str, Any]]:
    return [{"id": f"{split}-{i}", "q": f"What is {i} + {i}?"} for i in range(2)]


def echo_expert(task: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": f"{messages[-1]['content']} -> {len(messages)}"}


def says_nothing(task: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": ""}


def zero(task: dict[str, Any], result: Any, messages: list[dict[str, Any]]) -> float:
    return 0.0


def own_agent(expert: str | None) -> dict[str, Any]:
    kwargs = {"agent": f"{HERE}:asks_twice_in_two_threads", "tasks": f"{HERE}:two_tasks", "reward": f"{HERE}:zero"}
    return kwargs if expert is None else {**kwargs, "expert": f"{HERE}:{expert}"}


def test_a_rewritten_history_gives_one_row_per_thread() -> None:
    examples = examples_from_environment(SPEC, own_agent("echo_expert"), 1)
    assert [e.row_id for e in examples] == ["train-0/0", "train-0/1"]
    first, second = examples
    assert first.prompt == ({"role": "user", "content": "What is 0 + 0?"},)
    assert first.target == ({"role": "assistant", "content": "What is 0 + 0? -> 1"},)
    assert second.prompt[1] == {"role": "user", "content": "What is 0 + 0? -> 1"}
    assert second.target == ({"role": "assistant", "content": "What is 0 + 0? -> 1 -> 2"},)


def test_no_expert_is_refused_in_one_line_before_any_model_loads() -> None:
    def no_tokenizer() -> Any:
        raise AssertionError("the tokenizer is not needed to refuse")

    with pytest.raises(SFTDataError) as refused:
        examples_from_environment(SPEC, own_agent(None), 2, tokenizer=no_tokenizer)
    said = str(refused.value)
    assert "\n" not in said and f"{HERE}:asks_twice_in_two_threads has no expert" in said
    assert 'add expert = "module:function" to [env].kwargs' in said and "[sft].transcripts" in said
    with pytest.raises(SFTDataError, match="did not finish: .*neither content nor tool_calls"):
        examples_from_environment(SPEC, own_agent("says_nothing"), 1)


# ---------------------------------------------------------------- rollflow sft


def agent_sft_config(tiny_model_dir: Path, runs: Path) -> Any:
    """configs/openai_agent.toml as it is, on the tiny model, 4 rows for one epoch."""
    config = load_config(REPO / "configs" / "openai_agent.toml")
    return replace(
        config, model=ModelConfig(path=str(tiny_model_dir)),
        sft=replace(config.sft, max_rows=4, epochs=1, batch_size=2),
        storage=replace(config.storage, runs_dir=str(runs)), tracking=replace(config.tracking, enabled=False),
    )  # fmt: skip


def test_rollflow_sft_on_the_example_agent_trains_the_experts_rows(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = agent_sft_config(tiny_model_dir, tmp_path / "runs")
    assert config.env.kwargs["expert"] == f"{EXAMPLE}.expert:expert"
    codec = ChatCodec(load_tokenizer(ModelRef(path=str(tiny_model_dir))))
    rows, skipped = sft_rows(config, codec, sft_examples(config))
    assert (len(rows), skipped) == (4, 0)
    policy = sft_stage(config, tmp_path / "run" / "sft" / "policy")
    result = read_sft_result(policy)
    assert (policy / "adapter_config.json").is_file()
    assert (result.rows, result.optimizer_steps, len(result.epoch_losses)) == (4, 2, 1)
    assert result.trained_tokens == sum(r.num_trained for r in rows) < result.tokens // 4
    assert 0 < result.epoch_losses[0] < 20 and json.loads((policy / "sft.json").read_text())["rows"] == 4
