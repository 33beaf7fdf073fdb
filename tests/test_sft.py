"""SFT: rows from environments and files, the completion-only mask token by token, the
rollout-equal tokens, the loss going down on a tiny model, and GRPO starting from the result."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rollflow.config.run import ModelConfig, RunConfig, SFTConfig, load_config
from rollflow.envs.agent import PolicyAction
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.registry import register_environment
from rollflow.envs.runner import load_environment_handle
from rollflow.envs.types import EnvironmentStepResult, Message, RewardResult, TaskExample, ToolSpec
from rollflow.generators.models import load_policy_for_training
from rollflow.policy.codec import ChatCodec, TokenState
from rollflow.policy.models import ModelRef, load_causal_lm
from rollflow.storage.filemodes import current_umask
from rollflow.tasks.sft import completion_nll, mean_completion_loss, read_sft_result, sft_examples, sft_rows, sft_stage
from rollflow.tasks.sft_rows import (
    SFTDataError,
    SFTExample,
    SFTRow,
    bare_answer_note,
    examples_from_environment,
    examples_from_file,
    tokenize_example,
)

GAME = "rollflow.envs.tool_use_game:load_environment"
GAME_KWARGS = {"num_train": 4, "num_validation": 1}
SHORT_GAME = {**GAME_KWARGS, "worked_example": False}  # ~250-token prompts: fast training tests
GENERATION_PROMPT = "\n<|im_start|>assistant\n"  # what SmolLM2's ChatML template adds after a turn
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def codec(bundled_tokenizer: object) -> ChatCodec:
    return ChatCodec(bundled_tokenizer)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def game_examples() -> list[SFTExample]:
    return examples_from_environment(GAME, GAME_KWARGS)


def pieces(codec: ChatCodec, ids: Sequence[int]) -> list[str]:
    return [codec.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def roles_by_token(texts: Sequence[str]) -> list[str]:
    """The chat role each token belongs to, read from the ``<|im_start|>ROLE`` headers."""
    roles, role, header = [], "?", None
    for text in texts:
        if header is not None:  # the role name may span tokens ("ass" "istant"), up to "\n"
            header += text
            if "\n" in header:
                role, header = header.split("\n")[0], None
        elif text == "<|im_start|>":
            header = ""
        roles.append(role)
    return roles


# ---------------------------------------------------------------- the mask


def test_mask_is_the_start_episode_prefix_and_every_target_token(
    codec: ChatCodec, game_examples: list[SFTExample]
) -> None:
    example = game_examples[0]
    row = tokenize_example(codec, example)
    prompt_text = codec.render_text(example.prompt, example.tool_specs)  # tools as in rollout
    prompt_len = len(codec.encode(prompt_text))
    assert row.loss_mask == (0,) * prompt_len + (1,) * (len(row.input_ids) - prompt_len)
    texts = pieces(codec, row.input_ids)
    assert "".join(texts[:prompt_len]) == prompt_text
    full = codec.render_text([*example.prompt, *example.target], example.tool_specs)
    assert full.startswith(prompt_text) and full.endswith(GENERATION_PROMPT)
    assert "".join(texts[prompt_len:]) == full[len(prompt_text) : -len(GENERATION_PROMPT)]
    assert texts[-1] == "<|im_end|>"  # the answer's end of turn is trained: the model learns to stop


def test_roles_masked_by_position_not_by_role(codec: ChatCodec, game_examples: list[SFTExample]) -> None:
    """The worked example inside start_episode holds assistant and tool turns: all masked.
    The target's tool results are trained like its assistant turns (reference doc 000)."""
    row = tokenize_example(codec, game_examples[1])
    roles = roles_by_token(pieces(codec, row.input_ids))
    masked = {r for r, m in zip(roles, row.loss_mask, strict=True) if m == 0}
    trained = {r for r, m in zip(roles, row.loss_mask, strict=True) if m == 1}
    assert {"system", "user", "assistant", "tool"} <= masked
    assert trained == {"assistant", "tool"}
    tool_results = [m["content"] for m in game_examples[1].target if m["role"] == "tool"]
    trained_text = "".join(t for t, m in zip(pieces(codec, row.input_ids), row.loss_mask, strict=True) if m)
    assert tool_results and all(content in trained_text for content in tool_results)


@pytest.mark.parametrize("assistant_only", [None, True, False])
def test_sft_assistant_only_masks_the_targets_tool_results(codec: ChatCodec, assistant_only: bool | None) -> None:
    """``[sft].assistant_only = true``: the game's looked-up numbers (which the policy never
    writes, and GRPO never trains) become context; unset or false: trained, as the reference's
    completion-only loss. The tokens are the same either way; only the mask moves."""
    env = replace(RunConfig().env, name=GAME, kwargs=GAME_KWARGS)
    config = RunConfig(env=env, sft=SFTConfig(assistant_only=assistant_only))
    (example,) = sft_examples(config, limit=1)
    every = tokenize_example(codec, replace(example, assistant_only=False))
    row = tokenize_example(codec, example)
    assert row.input_ids == every.input_ids
    roles = roles_by_token(pieces(codec, row.input_ids))
    trained = {r for r, m in zip(roles, row.loss_mask, strict=True) if m == 1}
    assert trained == ({"assistant"} if assistant_only else {"assistant", "tool"})
    if assistant_only:
        assert 0 < row.num_trained < every.num_trained


class ExpertTokens:
    """A policy that 'samples' the given actions as their canonical tokens + end of turn,
    keeping the context exactly like the transformers backend does (the chat codec)."""

    version = 0

    def __init__(self, codec: ChatCodec, actions: Sequence[str]) -> None:
        self.codec, self.actions = codec, list(actions)

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> ExpertTokens.Session:
        return ExpertTokens.Session(self, list(tool_specs))

    class Session:
        def __init__(self, policy: ExpertTokens, tools: list[ToolSpec]) -> None:
            self.policy, self.tools, self.state, self.turn = policy, tools, None, 0
            self.state: TokenState | None = None

        async def act(self, messages: Sequence[Message]) -> PolicyAction:
            codec = self.policy.codec
            self.state, delta, reset = codec.next_prompt(self.state, messages, self.tools)
            text = self.policy.actions[self.turn]
            self.turn += 1
            ids = (*codec.encode(text), codec.tokenizer.eos_token_id)
            self.state = codec.record_action(self.state, ids)
            return PolicyAction(text, ids, (0.0,) * len(ids), delta, reset, "stop")

        async def close(self) -> None:
            pass


def test_sft_tokens_equal_the_tokens_of_a_played_expert_episode(
    codec: ChatCodec, game_examples: list[SFTExample]
) -> None:
    """SFT and GRPO see the same tokens: a rollout that samples the expert's actions holds
    exactly the SFT row's ids; only the mask differs (GRPO masks the tool results)."""
    handle = load_environment_handle(GAME, GAME_KWARGS)
    item = handle.tasks("train")[2]
    example = next(e for e in game_examples if e.row_id == item.task_id)
    actions = [m["content"] for m in example.target if m["role"] == "assistant"]
    rollout = asyncio.run(handle.play(item, ExpertTokens(codec, actions), EpisodeLimits(max_turns=8)))
    assert rollout.error is None and rollout.terminated
    played = [t for a in rollout.actions for t in (*a.prompt_delta_ids, *a.token_ids)]
    row = tokenize_example(codec, example)
    assert tuple(played) == row.input_ids
    assert row.loss_mask.count(0) == len(rollout.actions[0].prompt_delta_ids)


# ---------------------------------------------------------------- sources


class ScalarQuiz(EnvironmentMultiTurn):
    dataset = [{"input": "What is 2 + 2?", "output": 4, "id": "q1"}]

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": prompt_text}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return 1

    def step_episode(self, example: TaskExample, messages: list[Message], response: str) -> EnvironmentStepResult:
        return EnvironmentStepResult(done=True)

    def score_episode(self, example: TaskExample, episode: object) -> RewardResult:
        return RewardResult(score=0.0)


def test_a_scalar_output_is_one_assistant_turn(codec: ChatCodec) -> None:
    spec = register_environment("sft-scalar-quiz", ScalarQuiz())
    [example] = examples_from_environment(spec, {"key": "sft-scalar-quiz"})
    assert example.row_id == "q1" and example.target == ({"role": "assistant", "content": "4"},)
    row = tokenize_example(codec, example)
    trained = [t for t, m in zip(pieces(codec, row.input_ids), row.loss_mask, strict=True) if m]
    assert "".join(trained) == "4<|im_end|>"


def test_a_target_from_the_default_hook_and_a_bare_output_is_announced() -> None:
    """The newcomer's F6: an environment without sft_completion trained on its bare answer
    without a word."""
    spec = register_environment("sft-scalar-quiz-note", ScalarQuiz())
    note = bare_answer_note(spec, examples_from_environment(spec, {"key": "sft-scalar-quiz-note"}))
    assert note is not None and "\n" not in note
    assert f"{spec} defines no sft_completion" in note and "1 of 1 SFT rows" in note
    assert "output alone as one assistant message (e.g. '4')" in note
    assert "[sft].transcripts" in note and "--preview" in note
    assert bare_answer_note(GAME, examples_from_environment(GAME, GAME_KWARGS)) is None  # its own hook


def test_transcript_files_jsonl_and_parquet_give_the_same_rows(tmp_path: Path, codec: ChatCodec) -> None:
    tool: ToolSpec = {"type": "function", "function": {"name": "lookup", "description": "Look up.",
                                                       "parameters": {"type": "object", "properties": {}}}}
    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "a"}'}}
    transcript = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},  # structured only, as APIs write it
        {"role": "tool", "content": "7", "tool_call_id": "call_0", "name": "lookup"},
        {"role": "assistant", "content": "7"},
    ]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(json.dumps({"messages": transcript, "tools": [tool], "id": "r1"}) + "\n\n"
                     + json.dumps(transcript[1:]) + "\n")
    rows = examples_from_file(jsonl)
    assert [r.row_id for r in rows][0] == "r1" and len(rows) == 2
    assert [m["role"] for m in rows[0].prompt] == ["system", "user"] and rows[0].tool_specs == (tool,)
    assert rows[0].target[0]["content"].startswith("<tool_call>")  # the protocol text the policy writes
    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.table({"messages": [json.dumps(transcript)], "tools": [json.dumps([tool])], "id": ["r1"]}),
                   parquet)
    [from_parquet] = examples_from_file(parquet)
    assert from_parquet == rows[0]
    assert tokenize_example(codec, from_parquet).input_ids == tokenize_example(codec, rows[0]).input_ids


@pytest.mark.parametrize(
    ("content", "suffix", "pattern"),
    [
        ('[{"role": "user", "content": "hi"}]', ".jsonl", "no assistant message"),
        ('[{"role": "assistant", "content": "hi"}]', ".jsonl", "the prompt is empty"),
        ('{"turns": []}', ".jsonl", "expected a message list or an object with 'messages'"),
        ("not json", ".jsonl", "line 1 is not JSON"),
        ('[{"role": "user"}]', ".jsonl", "needs text 'role' and 'content'"),
        ("[]", ".csv", "must be a .jsonl or .parquet file"),
    ],
)
def test_bad_transcript_files_name_the_problem(tmp_path: Path, content: str, suffix: str, pattern: str) -> None:
    path = tmp_path / f"bad{suffix}"
    path.write_text(content + "\n")
    with pytest.raises(SFTDataError, match=pattern):
        examples_from_file(path)


def test_environments_that_cannot_give_rows_are_refused() -> None:
    with pytest.raises(SFTDataError, match="async-style environment"):
        examples_from_environment("rollflow.envs.calculator_math:load_environment", {})

    class UserFirst(ScalarQuiz):
        def sft_completion(self, example: TaskExample) -> list[Message]:
            return [{"role": "user", "content": "hm"}, {"role": "assistant", "content": "4"}]

    spec = register_environment("sft-user-first", UserFirst())
    with pytest.raises(SFTDataError, match="must start with an assistant message, got user"):
        examples_from_environment(spec, {"key": "sft-user-first"})


def test_rows_longer_than_the_context_budget_are_skipped(codec: ChatCodec) -> None:
    config = RunConfig(sft=SFTConfig(max_rows=3))
    config = replace(config, env=replace(config.env, kwargs=GAME_KWARGS))
    rows, skipped = sft_rows(config, codec)
    assert (len(rows), skipped) == (3, 0)
    longest = max(len(r.input_ids) for r in rows)
    shorter = replace(config, rollout=replace(config.rollout, max_model_length=longest - 1, max_completion_tokens=8))
    rows, skipped = sft_rows(shorter, codec)
    assert skipped >= 1 and all(len(r.input_ids) < longest for r in rows)
    too_short = replace(config, rollout=replace(config.rollout, max_model_length=64, max_completion_tokens=8))
    with pytest.raises(SFTDataError, match="longer than"):
        sft_rows(too_short, codec)


# ---------------------------------------------------------------- training


def sft_config(tiny_model_dir: Path, runs: Path, *, use_lora: bool, learning_rate: float) -> RunConfig:
    config = load_config(REPO / "configs" / "tiny.toml")
    return replace(
        config,
        model=ModelConfig(path=str(tiny_model_dir)),
        env=replace(config.env, kwargs=SHORT_GAME),
        train=replace(config.train, use_lora=use_lora),
        sft=SFTConfig(epochs=3, learning_rate=learning_rate, batch_size=2, max_rows=2),
        storage=replace(config.storage, runs_dir=str(runs)),
        tracking=replace(config.tracking, enabled=False),
    )


def test_loss_counts_exactly_the_trained_tokens(tiny_model_dir: Path) -> None:
    """The sliced logits give the naive full-sequence loss over mask-1 tokens, padding ignored."""
    model, _ = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    rows = [SFTRow("a", (5, 6, 7, 8, 9, 10), (0, 0, 0, 1, 1, 1)), SFTRow("b", (11, 12, 13, 14), (0, 1, 0, 1))]
    naive = 0.0
    with torch.no_grad():
        for row in rows:
            logprobs_TV = torch.log_softmax(model(input_ids=torch.tensor([row.input_ids])).logits[0].float(), -1)
            naive -= sum(logprobs_TV[t - 1, row.input_ids[t]].item() for t in range(1, len(row.input_ids))
                         if row.loss_mask[t])
        batched = completion_nll(model, rows, pad_token_id=2).item()
    assert batched == pytest.approx(naive, rel=1e-5)
    assert mean_completion_loss(model, rows, 2) == pytest.approx(naive / 5, rel=1e-5)


def test_an_epoch_of_many_batches_says_how_far_it_got(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newcomer's item 12: SFT printed once per epoch (110 s of silence each)."""
    import time

    from rollflow.tasks import sft

    monkeypatch.setattr(sft, "PROGRESS_EVERY_S", 0.0)  # a line after every batch but the last
    config = sft_config(tiny_model_dir, tmp_path, use_lora=True, learning_rate=3e-2)
    config = replace(config, sft=replace(config.sft, batch_size=1, epochs=1))
    model, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    rows = [SFTRow(name, (5, 6, 7, 8, 9, 10), (0, 0, 0, 1, 1, 1)) for name in "abc"]
    sft.train_epochs(config, model, rows, tokenizer.pad_token_id or 0, time.perf_counter())
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1].split(",")[0].strip() for line in err[:-1]] == ["1/3 rows", "2/3 rows"], err
    assert err[-1].startswith("  sft epoch 1/1: loss ")


def test_the_stage_writes_where_it_is_told_and_first_says_what_it_trains_on(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = register_environment("sft-scalar-quiz-stage", ScalarQuiz())
    config = sft_config(tiny_model_dir, tmp_path, use_lora=True, learning_rate=1e-2)
    config = replace(config, env=replace(config.env, name=spec, kwargs={"key": "sft-scalar-quiz-stage"}),
                     sft=replace(config.sft, epochs=1))
    out = tmp_path / "somewhere" / "warm-start"
    assert sft_stage(config, out) == out and read_sft_result(out).rows == 1
    assert [p.name for p in out.parent.iterdir()] == ["warm-start"]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"sft: {spec} defines no sft_completion"), err


def test_rollflow_sft_preview_shows_the_rows_trained_tokens_and_trains_nothing(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollflow.flows.cli import main
    from rollflow.config.run import config_to_toml

    config = sft_config(tiny_model_dir, tmp_path / "runs", use_lora=True, learning_rate=1e-2)
    config_path = tmp_path / "sft.toml"
    config_path.write_text(config_to_toml(config))
    assert main(["sft", str(config_path), "--preview", "1"]) == 0
    printed = capsys.readouterr().out
    assert not (tmp_path / "runs").exists()  # no run folder, no training
    codec = ChatCodec(load_causal_lm(ModelRef(path=str(tiny_model_dir)))[1])
    [example] = examples_from_environment(GAME, {**SHORT_GAME})[:1]
    row = tokenize_example(codec, example)
    trained = codec.tokenizer.decode([t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m],
                                     skip_special_tokens=False)
    header, body = printed.split("\n", 1)
    assert "trained tokens are between ⟦ and ⟧" in header
    marked = "".join(re.findall(r"⟦(.*?)⟧", body, flags=re.S))
    assert marked == trained and f"row 1 {row.row_id}: {len(row.input_ids)} tokens, {row.num_trained} trained" in printed
    assert printed.rstrip().endswith("nothing was trained")


@pytest.mark.slow  # ~12 s on 2 busy cores
def test_lora_sft_lowers_the_loss_on_its_rows_and_saves_an_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = sft_config(tiny_model_dir, tmp_path, use_lora=True, learning_rate=3e-2)
    base, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    rows, _ = sft_rows(config, ChatCodec(tokenizer))
    before = mean_completion_loss(base, rows, tokenizer.pad_token_id)
    policy = sft_stage(config, tmp_path / "run" / "sft" / "policy")
    assert (policy / "adapter_config.json").is_file() and not (policy / "config.json").exists()
    tuned, _ = load_causal_lm(ModelRef(path=str(tiny_model_dir), adapter=str(policy)))
    after = mean_completion_loss(tuned, rows, tokenizer.pad_token_id)
    result = read_sft_result(policy)
    # a random 2-layer model starts near ln(vocab) = 10.8; LoRA on q/k/v/o alone moves it slowly
    assert after < before - 0.2, (before, after)
    assert result.rows == 2 and result.optimizer_steps == 3
    assert list(result.epoch_losses) == sorted(result.epoch_losses, reverse=True)
    assert result.trained_tokens == sum(r.num_trained for r in rows)
    assert sft_stage(config, policy) == policy  # finished: returned, not retrained


@pytest.mark.slow  # ~12 s on 2 busy cores
def test_full_weight_sft_is_a_folder_grpo_loads_as_its_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = sft_config(tiny_model_dir, tmp_path, use_lora=False, learning_rate=1e-2)
    base, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    rows, _ = sft_rows(config, ChatCodec(tokenizer))
    policy = sft_stage(config, tmp_path / "run" / "sft" / "policy")
    assert (policy / "config.json").is_file() and (policy / "tokenizer.json").is_file()
    modes = {p.name: p.stat().st_mode & 0o777 for p in policy.iterdir() if p.is_file()}
    assert modes == dict.fromkeys(modes, 0o666 & ~current_umask())  # safetensors writes 0600
    train_config = replace(config, model=ModelConfig(path=str(policy)))
    model, _ = load_policy_for_training(train_config, None)
    saved, _ = load_causal_lm(ModelRef(path=str(policy)))
    before = mean_completion_loss(base, rows, tokenizer.pad_token_id)
    after = mean_completion_loss(saved, rows, tokenizer.pad_token_id)
    assert after < before - 1.0, (before, after)  # every weight trains: a large drop
    name = "model.layers.0.self_attn.q_proj.weight"
    weights = {n: p for n, p in model.named_parameters()}
    assert torch.equal(weights[name], dict(saved.named_parameters())[name])
    assert not torch.equal(weights[name], dict(base.named_parameters())[name])


@pytest.mark.slow
def test_rollflow_sft_then_a_train_run_starts_from_its_adapter(
    tiny_model_dir: Path, tmp_path: Path, prefect_harness: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    from rollflow.flows.cli import main
    from rollflow.flows.train import train_flow
    from rollflow.storage.runfolder import RunFolder
    from rollflow.storage.tracking import RunTracker
    from rollflow.config.run import config_to_toml

    config = replace(sft_config(tiny_model_dir, tmp_path, use_lora=True, learning_rate=1e-2),
                     tracking=RunConfig().tracking)
    config_path = tmp_path / "sft.toml"
    config_path.write_text(config_to_toml(config))
    assert main(["sft", str(config_path), "--run-dir", str(tmp_path / "sft-run")]) == 0
    policy = tmp_path / "sft-run" / "sft" / "policy"
    printed = capsys.readouterr().out
    assert printed.startswith(f"sft policy {policy}") and f'adapter = "{policy.resolve()}"' in printed
    assert [s for s, _ in RunTracker.open(tmp_path / "sft-run").metric_history("sft/loss")] == [0, 1, 2]
    train = replace(config, model=replace(config.model, adapter=str(policy)),
                    train=replace(config.train, num_steps=1, learning_rate=1e-7),
                    validation=replace(config.validation, validation_interval=0))
    train_path = tmp_path / "train.toml"
    train_path.write_text(config_to_toml(train))
    run = Path(train_flow(config_path=str(train_path), run_dir=str(tmp_path / "train-run")))
    [(_, checkpoint)] = RunFolder(run).checkpoints()
    sft_weights = load_file(str(policy / "adapter_model.safetensors"))
    trained = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert trained.keys() == sft_weights.keys()
    lora_b = [k for k in sft_weights if "lora_B" in k]
    assert max(sft_weights[k].abs().max().item() for k in lora_b) > 1e-3  # SFT moved B off zero...
    assert max((trained[k] - sft_weights[k]).abs().max().item() for k in trained) < 1e-5  # ...GRPO kept it
