"""KV reuse across turns on a tiny real model: only the delta is prefilled, nothing else changes.

Every check compares against what reuse must not change: the logprobs of a full forward
pass over the episode's concatenated tokens, and the tokens sampled without reuse at the
same seed. The prefill counts show what reuse saved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import rollflow.policy.prefill as prefill
import rollflow.policy.transformers_backend as backend
from rollflow.envs.agent import PolicyAction
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.generation import GenerationOutput, GenerationRequest, generate_batch
from rollflow.policy.models import ModelRef, build_tiny_model, load_causal_lm
from rollflow.policy.sampling import SamplingSettings, sampling_logprobs
from rollflow.policy.transformers_backend import TransformersPolicy

LOOKUP: ToolSpec = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a fact by key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    },
}
TEMPERATURE, TOP_P = 0.8, 0.95
EPISODES, TURNS = 3, 4


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4-head tiny model: at the shared 2-head default one same-seed draw lands within
    float noise of the boundary between two adjacent token ids (logprob about -10.7), so
    the KV-reuse and full-prefix runs can part there for reasons that are not KV reuse."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-4-heads"), num_heads=4)


def make_policy(model_dir: Path, **settings: Any) -> TransformersPolicy:
    model, tokenizer = load_causal_lm(ModelRef(path=str(model_dir)))
    defaults: dict[str, Any] = {
        "max_completion_tokens": 12, "max_model_length": 2048, "temperature": TEMPERATURE, "top_p": TOP_P,
    }
    return TransformersPolicy(model, tokenizer, SamplingSettings(**{**defaults, **settings}))


def opening(index: int) -> list[Message]:  # openings of different lengths: caches of different lengths
    return [{"role": "user", "content": f"Question {index}:{' and then some' * index} how many crates?"}]


def reply(index: int, turn: int) -> Message:  # replies of different lengths: deltas of different lengths
    return {"role": "user", "content": f"reply {turn}{' with more detail' * ((index + turn) % 3)}"}


async def episode(policy: TransformersPolicy, index: int, turns: int) -> list[PolicyAction]:
    session = policy.open_session([LOOKUP])
    messages = opening(index)
    actions = []
    try:
        for turn in range(turns):
            action = await session.act(messages)
            actions.append(action)
            messages += [policy.codec.parse_action(action.text)[1], reply(index, turn)]
    finally:
        await session.close()
    return actions


def play(policy: TransformersPolicy, episodes: int = EPISODES, turns: int = TURNS) -> list[list[PolicyAction]]:
    async def main() -> list[list[PolicyAction]]:
        return list(await asyncio.gather(*(episode(policy, i, turns) for i in range(episodes))))

    return asyncio.run(main())


def assert_logprobs_match_a_forward_pass(
    model: PreTrainedModel, actions: Sequence[PolicyAction], settings: SamplingSettings, first: int = 0
) -> None:
    """Each action's logprobs (from ``first`` on) are those of one unbatched, uncached pass over
    its transcript."""
    sequence: list[int] = []
    for turn, action in enumerate(actions):
        if action.reset:  # a fresh prompt: the model saw only it
            sequence = []
        sequence += action.prompt_delta_ids
        start = len(sequence)
        sequence += action.token_ids
        if turn < first:
            continue
        with torch.no_grad():
            logits_TV = model(torch.tensor([sequence])).logits[0]
        logits_TV = logits_TV[start - 1 : len(sequence) - 1]
        logprobs_TV = sampling_logprobs(logits_TV, settings.temperature, settings.top_p)
        expected_T = logprobs_TV.gather(-1, torch.tensor(action.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(action.logprobs), expected_T, atol=1e-4), (
            f"turn {turn}: {(torch.tensor(action.logprobs) - expected_T).abs().max()}"
        )


@dataclass(frozen=True)
class Played:
    policy: TransformersPolicy
    episodes: list[list[PolicyAction]]


# Plain sampling (top_p = 1): a nucleus's edge is where float rounding can change a draw.
# The tiny random model spreads its mass over all 49k tokens, so near-ties at the edge
# are common: with top_p = 0.95, reuse on and off drew differently in 3 of these 12
# actions (logprobs 1e-6 apart). A trained model's mass sits on few tokens, far from its edge.
PLAIN = {"seed": 3, "top_p": 1.0}


@pytest.fixture(scope="module")
def with_reuse(tiny_model_dir: Path) -> Played:
    policy = make_policy(tiny_model_dir, **PLAIN)
    return Played(policy, play(policy))


@pytest.fixture(scope="module")
def without_reuse(tiny_model_dir: Path) -> Played:
    policy = make_policy(tiny_model_dir, **PLAIN, kv_reuse=False)
    return Played(policy, play(policy))


@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_every_action_s_logprobs_equal_a_full_forward_pass(with_reuse: Played) -> None:
    assert with_reuse.policy.stats.batch_sizes == [EPISODES] * TURNS  # batched across episodes
    for actions in with_reuse.episodes:
        assert_logprobs_match_a_forward_pass(with_reuse.policy.model, actions, with_reuse.policy.settings)


def test_from_turn_two_on_only_the_delta_is_prefilled(with_reuse: Played, without_reuse: Played) -> None:
    prompts = [len(actions[0].prompt_delta_ids) for actions in with_reuse.episodes]
    assert with_reuse.policy.stats.batches[0].prefill_tokens == sum(prompts)
    for turn in range(1, TURNS):
        # the delta, and the previous action's last token, whose keys were never computed
        delta = sum(len(actions[turn].prompt_delta_ids) + 1 for actions in with_reuse.episodes)
        assert with_reuse.policy.stats.batches[turn].prefill_tokens == delta
    for turn in range(TURNS):  # without reuse: the whole transcript, every turn
        transcript = sum(
            sum(len(a.prompt_delta_ids) + len(a.token_ids) for a in actions[:turn]) + len(actions[turn].prompt_delta_ids)
            for actions in without_reuse.episodes
        )
        assert without_reuse.policy.stats.batches[turn].prefill_tokens == transcript


def test_reuse_on_and_off_sample_the_same_tokens_at_the_same_seed(
    with_reuse: Played, without_reuse: Played
) -> None:
    for on, off in zip(with_reuse.episodes, without_reuse.episodes, strict=True):
        assert [a.token_ids for a in on] == [a.token_ids for a in off]
        for a, b in zip(on, off, strict=True):
            assert a.prompt_delta_ids == b.prompt_delta_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_a_replay_is_bit_exact_and_closed_sessions_hold_no_cache(tiny_model_dir: Path, with_reuse: Played) -> None:
    replay = make_policy(tiny_model_dir, **PLAIN)
    assert [[a.logprobs for a in actions] for actions in play(replay)] == [
        [a.logprobs for a in actions] for actions in with_reuse.episodes
    ]
    assert with_reuse.policy.cached_tokens == replay.cached_tokens == 0


async def three_turns(
    policy: TransformersPolicy, between: Callable[[], None], second_opening: list[Message] | None = None
) -> tuple[list[PolicyAction], int]:
    """Three actions of one episode, ``between`` run after the first (the second turn may
    rewrite the opening); also the tokens cached once ``between`` ran."""
    session = policy.open_session([LOOKUP])
    first = await session.act(opening(0))
    assert policy.cached_tokens == len(first.prompt_delta_ids) + len(first.token_ids) - 1
    between()
    cached = policy.cached_tokens
    history = [*(second_opening or opening(0)), policy.codec.parse_action(first.text)[1], reply(0, 0)]
    second = await session.act(history)
    third = await session.act([*history, policy.codec.parse_action(second.text)[1], reply(0, 1)])
    await session.close()
    return [first, second, third], cached


def test_a_rewritten_history_falls_back_to_a_full_prefill(tiny_model_dir: Path) -> None:
    policy = make_policy(tiny_model_dir)
    actions, _ = asyncio.run(three_turns(policy, lambda: None, second_opening=opening(5)))
    assert [a.reset for a in actions] == [False, True, False]
    prefilled = [batch.prefill_tokens for batch in policy.stats.batches]
    assert prefilled == [len(actions[0].prompt_delta_ids), len(actions[1].prompt_delta_ids),
                         len(actions[2].prompt_delta_ids) + 1]  # the fresh prompt whole, then deltas again
    assert_logprobs_match_a_forward_pass(policy.model, actions, policy.settings)


def test_new_weights_drop_every_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    other, _ = load_causal_lm(ModelRef(path=str(build_tiny_model(tmp_path / "other", seed=9, num_heads=4))))
    policy = make_policy(tiny_model_dir)
    actions, cached = asyncio.run(three_turns(policy, lambda: policy.set_weights(other.state_dict(), version=1)))
    assert cached == 0
    first, second, _ = actions
    assert policy.stats.batches[1].prefill_tokens == (
        len(first.prompt_delta_ids) + len(first.token_ids) + len(second.prompt_delta_ids)
    )
    assert_logprobs_match_a_forward_pass(other, actions, policy.settings, first=1)  # the transcript so far, under the new weights
    assert policy.stats.batches[2].prefill_tokens == len(actions[2].prompt_delta_ids) + 1


def test_a_new_adapter_drops_every_cache(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(load_causal_lm(ModelRef(path=str(tiny_model_dir)))[0], lora).save_pretrained(
        str(tmp_path / "adapter")
    )
    policy = make_policy(tiny_model_dir)
    actions, cached = asyncio.run(three_turns(policy, lambda: policy.load_adapter(tmp_path / "adapter", version=1)))
    assert cached == 0
    first, second, _ = actions
    assert policy.stats.batches[1].prefill_tokens == (
        len(first.prompt_delta_ids) + len(first.token_ids) + len(second.prompt_delta_ids)
    )
    adapted = load_causal_lm(ModelRef(path=str(tiny_model_dir), adapter=str(tmp_path / "adapter")))[0]
    assert_logprobs_match_a_forward_pass(adapted, actions, policy.settings, first=1)


def test_a_timed_out_attempt_retries_from_the_previous_cache(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = backend.generate_batch_and_report
    calls = 0

    def second_call_times_out(model: Any, requests: Any, **options: Any) -> Any:
        nonlocal calls
        calls += 1
        outputs, report = real(model, requests, **options)
        if calls == 2:  # turn 2's first attempt: its tokens and its cache are discarded
            return [GenerationOutput((), (), False, True, o.prefilled_tokens) for o in outputs], report
        return outputs, report

    monkeypatch.setattr(backend, "generate_batch_and_report", second_call_times_out)
    policy = make_policy(tiny_model_dir, generation_timeout_s=60.0)
    actions = asyncio.run(episode(policy, 1, turns=3))
    assert [a.sampling_attempts for a in actions] == [1, 2, 1]
    delta = len(actions[1].prompt_delta_ids) + 1
    assert [b.prefill_tokens for b in policy.stats.batches][1:3] == [delta, delta]
    assert_logprobs_match_a_forward_pass(policy.model, actions, policy.settings)


# ---------------------------------------------------------------- generate_batch itself


OPTIONS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "stop_token_ids": set(), "pad_token_id": 2}


def test_rows_with_caches_of_different_lengths_batch_and_slice_like_fresh_ones(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    firsts = [GenerationRequest(tuple(range(100 + 40 * i, 103 + 47 * i)), 4 + 3 * i, i) for i in range(4)]
    cached = generate_batch(model, firsts, keep_caches=True, **OPTIONS)
    assert [len(o.cache) for o in cached] == [len(r.context_ids) + len(o.token_ids) - 1 for r, o in zip(firsts, cached, strict=True)]
    contexts = [
        first.context_ids + out.token_ids + tuple(range(7, 7 + 5 * i))
        for i, (first, out) in enumerate(zip(firsts, cached, strict=True))
    ]
    contexts[0] = firsts[0].context_ids + cached[0].token_ids[:-1]  # its cache spells all of it
    prefixes = [cached[0].cache, cached[1].cache, None, cached[3].cache]  # row 2 starts fresh
    reused = [GenerationRequest(c, 9, 50 + i, p) for i, (c, p) in enumerate(zip(contexts, prefixes, strict=True))]
    fresh = [GenerationRequest(c, 9, 50 + i) for i, c in enumerate(contexts)]
    monkeypatch.setattr(prefill, "PREFILL_TOKENS_PER_PASS", 20)  # several slices of different widths
    with_cache = generate_batch(model, reused, **OPTIONS)
    without = generate_batch(model, fresh, **OPTIONS)
    assert [o.prefilled_tokens for o in with_cache] == [1, 6, len(contexts[2]), 16]
    for request, a, b in zip(fresh, with_cache, without, strict=True):
        assert a.token_ids == b.token_ids
        ids_T = torch.tensor(request.context_ids + a.token_ids)
        with torch.no_grad():
            logits_TV = model(ids_T[None]).logits[0]
        start = len(request.context_ids) - 1
        expected_TV = sampling_logprobs(logits_TV[start : start + len(a.token_ids)], 1.0, 1.0)
        expected_T = expected_TV.gather(-1, torch.tensor(a.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(a.logprobs), expected_T, atol=1e-4)


def test_a_cache_of_another_transcript_is_refused(tiny_model_dir: Path) -> None:
    model, _ = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    [out] = generate_batch(model, [GenerationRequest((5, 6, 7), 3, 0)], keep_caches=True, **OPTIONS)
    assert out.cache is not None and out.cache.token_ids == (5, 6, 7, *out.token_ids[:2])
    with pytest.raises(ValueError, match="does not start the context"):
        GenerationRequest((5, 6, 8, 9, 10, 11), 3, 0, out.cache)



def test_the_bench_prints_both_runs_and_reuse_prefills_less(capsys: pytest.CaptureFixture[str]) -> None:
    from repo_script import load_script

    bench = load_script("bench/kv_reuse_bench.py")
    assert bench.main(["--tiny", "--episodes", "2", "--turns", "3", "--tokens", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    reuse = next(line.split() for line in lines if line.split()[:1] == ["reuse"])
    no_reuse = next(line.split() for line in lines if line.split()[:2] == ["no", "reuse"])
    assert int(reuse[1]) < int(no_reuse[2])  # prefill tokens
    assert lines[-1].endswith("identical actions: 6 of 6")
