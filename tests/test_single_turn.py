"""Single-turn environments: one-action episodes through the runner, exact arithmetic
scoring, SFT rows from build_prompt_messages, and a tiny GRPO run through the real flow."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from rollflow import EnvironmentSingleTurn
from rollflow.envs.arithmetic_answer import SYSTEM_PROMPT, expert_policy, load_environment
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import EnvironmentHandle, EpisodeLimits, EpisodeScore
from rollflow.envs.registry import register_environment
from rollflow.envs.runner import load_environment_handle, play_groups
from rollflow.envs.scripted import ScriptedPolicy, constant_policy
from rollflow.envs.types import EnvironmentStepResult, Message, RewardResult, TaskExample
from rollflow.policy.codec import ChatCodec
from rollflow.tasks.sft_rows import examples_from_environment, tokenize_example

SPEC = "rollflow.envs.arithmetic_answer:load_environment"
SMALL = {"num_train": 6, "num_validation": 4}


def play_and_score(
    handle: EnvironmentHandle, policy: ScriptedPolicy, split: str = "validation", group_size: int = 1
) -> list[tuple[EpisodeRollout, EpisodeScore]]:
    items = handle.tasks(split)  # type: ignore[arg-type]
    groups = asyncio.run(play_groups(handle, items, group_size, policy, EpisodeLimits(), concurrency=8))
    pairs = []
    for item, group in zip(items, groups, strict=True):
        scores = asyncio.run(handle.score(item, group))
        pairs.extend(zip(group, scores, strict=True))
    return pairs


def test_the_expert_answers_every_question_in_one_turn_and_scores_one() -> None:
    handle = load_environment_handle(SPEC, SMALL)
    pairs = play_and_score(handle, expert_policy(), group_size=2)
    assert len(pairs) == 8
    for rollout, score in pairs:
        assert rollout.error is None and rollout.terminated and not rollout.truncated
        assert rollout.turns == 1
        assert [m["role"] for m in rollout.messages] == ["system", "user", "assistant"]
        assert rollout.messages[0]["content"] == SYSTEM_PROMPT
        assert rollout.response_text == rollout.messages[-1]["content"]
        assert score.error is None and score.reward == 1.0
        assert score.components == {"correct": 1.0, "answered": 1.0}


def test_a_wrong_answer_scores_zero_and_the_episode_never_takes_a_second_turn() -> None:
    handle = load_environment_handle(SPEC, SMALL)

    def off_by_one(messages: list[Message], turn: int) -> str:
        assert turn == 0, "a single-turn episode asked for a second action"
        example = next(e for e in load_environment(**SMALL).examples("validation")
                       if e.input == messages[-1]["content"])
        return str(int(example.output) + 1)

    pairs = play_and_score(handle, ScriptedPolicy(off_by_one))  # type: ignore[arg-type]
    assert [(r.turns, s.reward, s.components["answered"]) for r, s in pairs] == [(1, 0.0, 1.0)] * 4


def test_a_tool_call_in_the_reply_is_scored_as_text_not_a_parse_failure() -> None:
    handle = load_environment_handle(SPEC, SMALL)
    pairs = play_and_score(handle, constant_policy('<tool_call>{"name": "calculator"'))
    for rollout, score in pairs:
        assert rollout.terminated and rollout.truncation_cause is None
        assert "tool_calls" not in rollout.messages[-1]
        assert score.reward == 0.0 and score.components["answered"] == 0.0
    assert all(specs == () for specs in expert_policy().opened_tool_specs)


@pytest.mark.parametrize(
    ("reply", "target", "correct", "answered"),
    [
        ("8360", 8360, 1.0, 1.0),
        ("The answer is 8,360.", 8360, 1.0, 1.0),
        ("(63 + 47) * 76 = 8360", 8360, 1.0, 1.0),
        ("8360.5", 8360, 0.0, 1.0),
        ("8361", 8360, 0.0, 1.0),
        ("8360, or maybe 8359", 8360, 0.0, 1.0),  # the last number is the answer
        ("-286", -286, 1.0, 1.0),
        ("286", -286, 0.0, 1.0),
        ("I cannot say.", 8360, 0.0, 0.0),
        ("", 8360, 0.0, 0.0),
    ],
)
def test_score_response_is_exact_on_the_last_number(
    reply: str, target: int, correct: float, answered: float
) -> None:
    env = load_environment(**SMALL)
    example = TaskExample(input="What is x?", output=target)
    result = env.score_response(example, reply)
    assert result.score == correct and result.threshold == 1.0
    assert result.components == {"correct": correct, "answered": answered}


def test_targets_are_the_values_of_their_questions() -> None:
    env = load_environment(seed=3, num_train=50, num_validation=10)
    examples = [*env.examples("train"), *env.examples("validation")]
    assert len({e.id for e in examples}) == 60
    for example in examples:
        expression = example.metadata["expression"]
        assert example.input == f"What is {expression}?"
        assert example.output == eval(expression)  # noqa: S307 - our own generated digits and + - * ( )



def test_the_loader_keywords_choose_an_easier_mix_and_bad_ones_are_named() -> None:
    env = load_environment(min_operand=1, max_operand=9, operand_counts=[2], operators="+-", num_train=80)
    examples = env.examples("train")
    seen_operators = set()
    for example in examples:
        left, operator, right = example.metadata["expression"].split(" ")
        assert 1 <= int(left) <= 9 and 1 <= int(right) <= 9
        seen_operators.add(operator)
        assert example.output == eval(example.metadata["expression"])  # noqa: S307 - our own digits
    assert seen_operators == {"+", "-"}
    three = load_environment(operand_counts=[3], operators="*", num_train=20).examples("train")
    assert all(e.metadata["expression"].replace("(", "").replace(")", "").count("*") == 2 for e in three)
    for bad, named in (({"max_operand": 1}, "max_operand"), ({"operand_counts": [4]}, "operand_counts"),
                       ({"operand_counts": "2"}, "operand_counts"), ({"operators": "/"}, "operators"),
                       ({"operators": ""}, "operators"), ({"min_operand": -1}, "min_operand")):
        with pytest.raises(ValueError, match=named):
            load_environment(**bad)

class AsyncQuiz(EnvironmentSingleTurn):
    """An ``async def`` scorer and a plain dataset list, as a user might write one."""

    def __init__(self) -> None:
        self.dataset = [{"input": "2 + 2?", "output": "4", "id": "q1"}]

    def build_prompt_messages(self, example: TaskExample) -> list[Message]:
        return [{"role": "user", "content": str(example.input)}]

    async def score_response(self, example: TaskExample, response_text: str) -> RewardResult:
        await asyncio.sleep(0)
        return RewardResult(score=float(response_text.strip() == example.output))


def test_an_async_scorer_and_a_plain_dataset_run_through_the_runner() -> None:
    spec = register_environment("single-turn-async-quiz", AsyncQuiz())
    handle = load_environment_handle(spec, {"key": "single-turn-async-quiz"})
    right = play_and_score(handle, constant_policy(" 4 "), split="train")
    wrong = play_and_score(handle, constant_policy("5"), split="train")
    assert [(r.messages[0]["content"], s.reward) for r, s in right] == [("2 + 2?", 1.0)]
    assert [s.reward for _, s in wrong] == [0.0]


def test_overriding_an_episode_hook_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match="Sneaky overrides step_episode: .*subclass EnvironmentMultiTurn"):

        class Sneaky(AsyncQuiz):
            def step_episode(
                self, example: TaskExample, messages: list[Message], assistant_response: str
            ) -> EnvironmentStepResult:
                return EnvironmentStepResult(done=False)


def test_missing_hooks_make_the_class_abstract() -> None:
    class Half(EnvironmentSingleTurn):
        def build_prompt_messages(self, example: TaskExample) -> list[Message]:
            return []

    with pytest.raises(TypeError, match="score_response"):
        Half()  # type: ignore[abstract]


def test_sft_rows_are_the_prompt_then_the_bare_answer(bundled_tokenizer: object) -> None:
    [example] = examples_from_environment(SPEC, SMALL, limit=1)
    env_example = load_environment(**SMALL).examples("train")[0]
    assert example.row_id == env_example.id
    assert [m["content"] for m in example.prompt] == [SYSTEM_PROMPT, env_example.input]
    assert example.target == ({"role": "assistant", "content": str(env_example.output)},)
    codec = ChatCodec(bundled_tokenizer)  # type: ignore[arg-type]
    row = tokenize_example(codec, example)
    pieces = [codec.tokenizer.decode([i], skip_special_tokens=False) for i in row.input_ids]
    trained = "".join(p for p, m in zip(pieces, row.loss_mask, strict=True) if m)
    assert trained == f"{env_example.output}<|im_end|>"


@pytest.mark.slow  # three LoRA SFT steps: 10-30 s on 2 busy cores
def test_sft_on_the_arithmetic_answers_lowers_their_loss(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rollflow.policy.models import ModelRef, load_causal_lm
    from rollflow.config.run import ModelConfig, SFTConfig, load_config
    from rollflow.tasks.sft import mean_completion_loss, read_sft_result, sft_rows, sft_stage
    from tiny_run import REPO

    config = load_config(REPO / "configs" / "tiny.toml")
    config = replace(
        config,
        model=ModelConfig(path=str(tiny_model_dir)),
        env=replace(config.env, name=SPEC, kwargs=SMALL),
        sft=SFTConfig(epochs=3, learning_rate=3e-2, batch_size=2, max_rows=2),
        tracking=replace(config.tracking, enabled=False),
    )
    base, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    rows, _ = sft_rows(config, ChatCodec(tokenizer))
    before = mean_completion_loss(base, rows, tokenizer.pad_token_id)
    policy = sft_stage(config, tmp_path / "run" / "sft" / "policy")
    tuned, _ = load_causal_lm(ModelRef(path=str(tiny_model_dir), adapter=str(policy)))
    after = mean_completion_loss(tuned, rows, tokenizer.pad_token_id)
    assert read_sft_result(policy).rows == 2
    assert after < before - 0.2, (before, after)


# ---------------------------------------------------------------- GRPO through the real flow


class LetterShareAnswer(EnvironmentSingleTurn):
    """Single-turn, with a reward that varies even over a random tiny model's replies
    (the share of letters), so the GRPO update really changes the weights."""

    def __init__(self) -> None:
        rows = [{"input": f"Describe the number {n}.", "id": f"describe-{n}"} for n in range(4)]
        self.dataset = {"train": rows, "validation": rows[:1]}

    def build_prompt_messages(self, example: TaskExample) -> list[Message]:
        return [{"role": "user", "content": str(example.input)}]

    def score_response(self, example: TaskExample, response_text: str) -> RewardResult:
        share = sum(c.isalpha() for c in response_text) / max(1, len(response_text))
        return RewardResult(score=share, threshold=0.5)


@pytest.mark.slow  # one GRPO step plus two validation passes: ~20 s on 2 busy cores
@pytest.mark.usefixtures("prefect_harness")
def test_one_grpo_step_on_a_single_turn_environment(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from rollflow.flows.train import train_flow
    from rollflow.storage.query import open_run_sql, run_query
    from rollflow.storage.runfolder import RunFolder
    from rollflow.config.run import config_to_toml, load_config
    from tiny_run import REPO

    spec = register_environment("single-turn-letters", LetterShareAnswer())
    config = load_config(REPO / "configs" / "tiny.toml")
    config = replace(
        config,
        model=replace(config.model, path=str(tiny_model_dir)),
        env=replace(config.env, name=spec, kwargs={"key": "single-turn-letters"}),
        train=replace(config.train, num_steps=1),
        validation=replace(config.validation, validation_interval=1, num_tasks=1),
        storage=replace(config.storage, runs_dir=str(tmp_path / "runs")),
        tracking=replace(config.tracking, enabled=False),
    )
    config_path = tmp_path / "single_turn.toml"
    config_path.write_text(config_to_toml(config))
    run_dir = Path(train_flow(config_path=str(config_path), run_dir=str(tmp_path / "run")))

    con = open_run_sql([run_dir])
    _, rows = run_query(con, "SELECT split, turns, terminated, truncated, error FROM episodes ORDER BY ALL")
    assert len(rows) == 4 + 2  # 2 tasks x 2 episodes, then 1 validation task before and after
    assert {tuple(r[1:]) for r in rows} == {(1, True, False, None)}
    _, advantages = run_query(con, "SELECT count(*) FROM scores WHERE advantage <> 0 AND split = 'train'")
    assert advantages[0][0] > 0
    folder = RunFolder(run_dir)
    assert folder.read_train_result(0).grad_norm > 0
    _, adapter = folder.latest_checkpoint()  # type: ignore[misc]
    lora_b = [t for name, t in load_file(str(adapter / "adapter_model.safetensors")).items() if "lora_B" in name]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # B starts at zero: the step moved it
