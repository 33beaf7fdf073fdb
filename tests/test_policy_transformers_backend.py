"""The transformers policy on a tiny real model: batching, budgets, exact tokens, retries."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import rollflow.policy.transformers_backend as backend
from rollflow.envs.agent import PolicyAction
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.generation import GenerationOutput
from rollflow.policy.models import ModelRef, build_tiny_model, load_causal_lm
from rollflow.policy.sampling import SamplingSettings, sampling_logprobs
from rollflow.policy.transformers_backend import GenerationTimeoutError, TransformersPolicy

LOOKUP: ToolSpec = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a fact by key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}


def make_policy(model_dir: Path, **settings: object) -> TransformersPolicy:
    model, tokenizer = load_causal_lm(ModelRef(path=str(model_dir)))
    defaults: dict = {"max_completion_tokens": 12, "max_model_length": 1024}
    return TransformersPolicy(model, tokenizer, SamplingSettings(**{**defaults, **settings}))


def opening(index: int) -> list[Message]:
    return [{"role": "user", "content": f"Question number {index}: how many crates?"}]


async def play(policy: TransformersPolicy, episodes: int, turns: int) -> list[list[PolicyAction]]:
    """What the runner does, minus an environment: act, append the action and a reply."""

    async def episode(index: int) -> list[PolicyAction]:
        session = policy.open_session([LOOKUP])
        messages = opening(index)
        actions = []
        try:
            for turn in range(turns):
                action = await session.act(messages)
                actions.append(action)
                _, assistant = policy.codec.parse_action(action.text)
                messages += [assistant, {"role": "user", "content": f"reply {turn}"}]
        finally:
            await session.close()
        return actions

    return list(await asyncio.gather(*(episode(i) for i in range(episodes))))


def test_waiting_episodes_share_one_batch_and_get_their_own_tokens(tiny_model_dir: Path) -> None:
    policy = make_policy(tiny_model_dir)
    episodes = asyncio.run(play(policy, episodes=4, turns=2))
    assert policy.stats.batch_sizes == [4, 4]
    for actions in episodes:
        for action in actions:
            assert len(action.token_ids) == len(action.logprobs) == 12
            assert action.finish_reason == "length" and action.sampling_attempts == 1
            assert action.text == policy.codec.action_text(action.token_ids)
        assert actions[0].reset is False and actions[1].reset is False
    assert len({episode[0].token_ids for episode in episodes}) == 4  # distinct samples


def test_context_is_the_exact_prompt_plus_sampled_tokens_and_logprobs_match_a_forward_pass(
    tiny_model_dir: Path,
) -> None:
    policy = make_policy(tiny_model_dir, temperature=0.8, top_p=0.95)
    [actions] = asyncio.run(play(policy, episodes=1, turns=3))
    sequence: list[int] = []
    for action in actions:
        sequence += action.prompt_delta_ids
        start = len(sequence)
        sequence += action.token_ids
        with torch.no_grad():
            logits_TV = policy.model(torch.tensor([sequence])).logits[0]
        logprobs_TV = sampling_logprobs(logits_TV[start - 1 : len(sequence) - 1], 0.8, 0.95)
        expected_T = logprobs_TV.gather(-1, torch.tensor(action.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(action.logprobs), expected_T, atol=1e-4)
    assert actions[0].prompt_delta_ids == tuple(
        policy.codec.render_prompt_ids(opening(0), [LOOKUP])
    )


def test_same_seed_same_episodes_other_seed_other_episodes(tiny_model_dir: Path) -> None:
    def tokens(policy: TransformersPolicy) -> list[tuple[int, ...]]:
        played = asyncio.run(play(policy, episodes=3, turns=2))
        return [action.token_ids for actions in played for action in actions]

    policy = make_policy(tiny_model_dir, seed=5)
    first = tokens(policy)
    assert tokens(policy) != first  # the same prompts again are new episodes: new draws
    policy.reseed(5)
    assert tokens(policy) == first == tokens(make_policy(tiny_model_dir, seed=5))
    assert tokens(make_policy(tiny_model_dir, seed=6)) != first


def test_samples_do_not_depend_on_the_order_episodes_start_in(tiny_model_dir: Path) -> None:
    async def one_episode(policy: TransformersPolicy, index: int) -> tuple[int, ...]:
        session = policy.open_session([LOOKUP])
        action = await session.act(opening(index))
        await session.close()
        return action.token_ids

    async def forwards(policy: TransformersPolicy) -> list[tuple[int, ...]]:
        return list(await asyncio.gather(*(one_episode(policy, i) for i in range(4))))

    async def backwards_one_at_a_time(policy: TransformersPolicy) -> list[tuple[int, ...]]:
        return [await one_episode(policy, i) for i in reversed(range(4))][::-1]

    batched = asyncio.run(forwards(make_policy(tiny_model_dir)))
    assert asyncio.run(backwards_one_at_a_time(make_policy(tiny_model_dir))) == batched


def test_a_group_sharing_one_prompt_gets_distinct_samples(tiny_model_dir: Path) -> None:
    policy = make_policy(tiny_model_dir)

    async def group() -> list[tuple[int, ...]]:
        sessions = [policy.open_session([LOOKUP]) for _ in range(4)]
        actions = await asyncio.gather(*(s.act(opening(0)) for s in sessions))
        return [action.token_ids for action in actions]

    assert len(set(asyncio.run(group()))) == 4


def test_a_prompt_that_does_not_fit_returns_context_without_tokens(tiny_model_dir: Path) -> None:
    policy = make_policy(tiny_model_dir)
    prompt_length = len(policy.codec.render_prompt_ids(opening(0), [LOOKUP]))
    policy = make_policy(tiny_model_dir, max_model_length=prompt_length)
    [[action]] = asyncio.run(play(policy, episodes=1, turns=1))
    assert action.finish_reason == "context" and action.token_ids == () and action.text == ""
    assert len(action.prompt_delta_ids) == prompt_length  # the prompt was not cut
    assert action.sampling_attempts == 0 and policy.stats.batch_sizes == []


def test_generation_that_fills_the_context_ends_with_context(tiny_model_dir: Path) -> None:
    policy = make_policy(tiny_model_dir)
    prompt_length = len(policy.codec.render_prompt_ids(opening(0), [LOOKUP]))
    policy = make_policy(tiny_model_dir, max_model_length=prompt_length + 5)
    [[action]] = asyncio.run(play(policy, episodes=1, turns=1))
    assert action.finish_reason == "context" and len(action.token_ids) == 5


def test_timed_out_output_is_discarded_and_retried(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = backend.generate_batch_and_report
    calls: list[int] = []

    def first_attempt_times_out(model, requests, **options):  # type: ignore[no-untyped-def]
        calls.append(len(requests))
        outputs, report = real(model, requests, **options)
        if len(calls) == 1:  # tokens were sampled, then the deadline passed
            return [GenerationOutput((), (), stopped=False, timed_out=True) for _ in outputs], report
        return outputs, report

    monkeypatch.setattr(backend, "generate_batch_and_report", first_attempt_times_out)
    policy = make_policy(tiny_model_dir, generation_timeout_s=30.0, max_sampling_attempts=2)
    [[action]] = asyncio.run(play(policy, episodes=1, turns=1))
    assert calls == [1, 1] and action.sampling_attempts == 2 and len(action.token_ids) == 12


def test_every_attempt_past_the_deadline_raises_a_clear_error(tiny_model_dir: Path) -> None:
    policy = make_policy(tiny_model_dir, generation_timeout_s=1e-9, max_sampling_attempts=3)
    with pytest.raises(GenerationTimeoutError, match="all 3 attempts"):
        asyncio.run(play(policy, episodes=1, turns=1))
    assert policy.stats.batch_sizes == [1, 1, 1] and policy.stats.generated_tokens == 0


def test_the_event_loop_stays_free_while_a_batch_generates(tiny_model_dir: Path) -> None:
    policy = make_policy(tiny_model_dir, max_completion_tokens=64)

    async def main() -> int:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        await play(policy, episodes=2, turns=1)
        stop.set()
        await task
        return ticks

    assert asyncio.run(main()) > 10


@pytest.mark.slow  # 3 s in a loaded suite run (docs/testing.md)
def test_new_weights_and_adapters_change_the_policy_and_its_version(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from peft import LoraConfig, get_peft_model

    other_dir = build_tiny_model(tmp_path / "other", seed=9)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(load_causal_lm(ModelRef(path=str(other_dir)))[0], lora).save_pretrained(
        str(tmp_path / "adapter")
    )

    def first_action(policy: TransformersPolicy) -> tuple[tuple[int, ...], tuple[float, ...]]:
        action = asyncio.run(play(policy, 1, 1))[0][0]
        return action.token_ids, action.logprobs

    original = first_action(make_policy(tiny_model_dir))
    swapped = make_policy(tiny_model_dir)
    other, _ = load_causal_lm(ModelRef(path=str(other_dir)))
    swapped.set_weights(other.state_dict(), version=1)
    assert swapped.version == 1
    assert first_action(swapped) == first_action(make_policy(other_dir)) != original
    with pytest.raises(KeyError, match="unknown parameter names"):
        swapped.set_weights({"no.such.weight": torch.zeros(1)}, version=2)

    adapted = make_policy(other_dir)
    adapted.load_adapter(tmp_path / "adapter", version=3)
    adapted.load_adapter(tmp_path / "adapter", version=4)  # replaces, does not stack
    assert adapted.version == 4 and len(adapted.model.peft_config) == 1
    reference = make_policy(other_dir)
    reference.model = load_causal_lm(ModelRef(path=str(other_dir), adapter=str(tmp_path / "adapter")))[0]
    assert first_action(adapted) == first_action(reference) != first_action(make_policy(other_dir))


def test_misuse_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_policy(tiny_model_dir, max_model_length=100_000)
    policy = make_policy(tiny_model_dir)

    async def act_after_close(messages: Sequence[Message]) -> None:
        session = policy.open_session([])
        await session.close()
        await session.act(messages)

    with pytest.raises(RuntimeError, match="closed policy session"):
        asyncio.run(act_after_close(opening(0)))
