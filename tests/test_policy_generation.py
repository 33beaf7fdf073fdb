"""The batched decoding loop on a tiny real model: logprobs, budgets, stops, seeds, deadlines."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollflow.policy.generation import (
    GenerationOutput,
    GenerationRequest,
    generate_batch,
    generate_batch_and_report,
)
from rollflow.policy.models import ModelRef, load_causal_lm
from rollflow.policy.sampling import sampling_logprobs

OPTIONS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "stop_token_ids": {2}, "pad_token_id": 2}
PROMPTS = ["hello there", "a", "one two three four five six seven eight", "tools, tokens"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_causal_lm(ModelRef(path=str(tiny_model_dir)))


def requests_for(
    tokenizer: PreTrainedTokenizerBase, max_new: list[int], seed: int = 0
) -> list[GenerationRequest]:
    return [
        GenerationRequest(tuple(tokenizer.encode(text)), new, seed + index)
        for index, (text, new) in enumerate(zip(PROMPTS, max_new, strict=True))
    ]


def run(
    model: PreTrainedModel, requests: list[GenerationRequest], **overrides: Any
) -> list[GenerationOutput]:
    options: dict[str, Any] = {**OPTIONS, **overrides}
    return generate_batch(model, requests, **options)


@pytest.mark.slow  # 3 s in a loaded suite run (docs/testing.md)
def test_logprobs_are_those_of_the_sampled_distribution_under_a_forward_pass(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = tiny
    requests = requests_for(tokenizer, [12, 5, 20, 9])
    outputs = run(model, requests, temperature=0.7, top_p=0.9)
    for request, output in zip(requests, outputs, strict=True):
        assert len(output.token_ids) == request.max_new_tokens  # a random model rarely stops
        ids_T = torch.tensor(request.context_ids + output.token_ids)
        with torch.no_grad():
            logits_TV = model(ids_T[None]).logits[0]
        start = len(request.context_ids) - 1  # logits at t predict token t + 1
        expected_TV = sampling_logprobs(logits_TV[start : start + len(output.token_ids)], 0.7, 0.9)
        expected_T = expected_TV.gather(-1, torch.tensor(output.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(output.logprobs), expected_T, atol=1e-4)
        assert all(math.isfinite(logprob) for logprob in output.logprobs)


def test_greedy_decoding_matches_hf_generate(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = tiny
    requests = requests_for(tokenizer, [10, 10, 10, 10])
    outputs = run(model, requests, temperature=0.0)
    for request, output in zip(requests, outputs, strict=True):
        generated = model.generate(
            torch.tensor([request.context_ids]),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
        expected = generated[0, len(request.context_ids) :].tolist()
        assert list(output.token_ids) == expected
        assert output.logprobs == (0.0,) * 10


def test_a_row_stops_at_a_stop_token_and_the_others_go_on(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = tiny
    requests = requests_for(tokenizer, [8, 8, 8, 8])
    free = run(model, requests)
    stop = free[2].token_ids[3]  # make row 2's fourth token a stop token: same seeds, same draws
    assert stop not in free[2].token_ids[:3]
    outputs = run(model, requests, stop_token_ids={stop})
    assert outputs[2].token_ids == free[2].token_ids[:4] and outputs[2].stopped
    for before, after in zip(free, outputs, strict=True):
        cut = before.token_ids.index(stop) + 1 if stop in before.token_ids else 8
        assert after.token_ids == before.token_ids[:cut]


@pytest.mark.slow  # 5 s in a loaded suite run (docs/testing.md)
def test_samples_do_not_depend_on_the_batch_and_follow_the_seed(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = tiny
    requests = requests_for(tokenizer, [15, 6, 15, 11])
    batched = run(model, requests)
    alone = [run(model, [request])[0] for request in requests]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    reseeded = run(model, requests_for(tokenizer, [15, 6, 15, 11], seed=100))
    assert all(a.token_ids != b.token_ids for a, b in zip(batched, reseeded, strict=True))


def test_past_the_deadline_nothing_is_returned(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = tiny
    outputs = run(model, requests_for(tokenizer, [50, 50, 50, 50]), timeout_s=1e-9)
    assert all(o.timed_out and o.token_ids == () and o.logprobs == () for o in outputs)


def test_requests_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one context token"):
        GenerationRequest((), 5, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationRequest((1,), 0, 0)


def test_identical_contexts_are_prefilled_once_and_sample_independently(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = tiny
    context = tuple(tokenizer.encode("a GRPO group shares its prompt"))
    group = [GenerationRequest(context, 10, seed) for seed in range(4)]
    mixed = [*group, *requests_for(tokenizer, [7, 7, 7, 7])]
    outputs, report = generate_batch_and_report(model, mixed, **OPTIONS)
    others = sum(len(request.context_ids) for request in mixed[4:])
    assert report.prefill_tokens == len(context) + others  # the shared context once
    assert [o.prefilled_tokens for o in outputs] == [len(r.context_ids) for r in mixed]
    alone = [run(model, [request])[0] for request in mixed]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]
    assert len({o.token_ids for o in outputs[:4]}) == 4  # same prompt, own seeds


def test_a_stop_request_ends_decoding_at_the_next_step(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase], monkeypatch: pytest.MonkeyPatch
) -> None:
    import rollflow.policy.generation as generation
    from rollflow.policy.stopping import StopRequested, request_stop

    model, tokenizer = tiny
    draws = 0
    real_draw = generation.draw_tokens

    def draw_then_stop(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal draws
        draws += 1
        if draws == 3:
            request_stop()  # as SIGTERM's handler does, from another thread
        return real_draw(*args, **kwargs)

    monkeypatch.setattr(generation, "draw_tokens", draw_then_stop)
    with pytest.raises(StopRequested, match="rollflow resume"):
        run(model, requests_for(tokenizer, [50, 50, 50, 50]), stop_token_ids=set())
    assert draws == 3  # the step that saw the request was the last
    with pytest.raises(StopRequested):  # and a new batch does not start
        run(model, requests_for(tokenizer, [5, 5, 5, 5]))
    assert draws == 3


def of_lengths(lengths: list[int], max_new: int = 10) -> list[GenerationRequest]:
    """Requests whose contexts have these lengths (distinct ids, no special tokens)."""
    return [
        GenerationRequest(tuple(range(100 + 50 * index, 100 + 50 * index + length)), max_new, index)
        for index, length in enumerate(lengths)
    ]


def forward_shapes(model: PreTrainedModel, requests: list[GenerationRequest]) -> tuple[list[GenerationOutput], list[tuple[int, int]]]:
    shapes: list[tuple[int, int]] = []  # (rows, positions) of each forward pass
    hook = model.register_forward_pre_hook(
        lambda _module, _args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        return run(model, requests), shapes
    finally:
        hook.remove()


def test_a_sliced_prefill_samples_what_one_pass_samples(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase], monkeypatch: pytest.MonkeyPatch
) -> None:
    import rollflow.policy.prefill as prefill

    model, _ = tiny
    requests = of_lengths([5, 8, 4, 6])
    one_pass, shapes = forward_shapes(model, requests)
    assert shapes[:2] == [(4, 8), (4, 1)]  # one prefill pass, then decoding
    monkeypatch.setattr(prefill, "PREFILL_TOKENS_PER_PASS", 16)  # 2 rows of 8 a pass
    sliced, shapes = forward_shapes(model, requests)
    assert shapes[:3] == [(2, 8), (2, 5), (4, 1)]  # longest first, each slice its own width
    for a, b in zip(one_pass, sliced, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_short_contexts_are_not_padded_to_a_long_one(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, _ = tiny
    requests = of_lengths([3, 40, 2, 1])
    outputs, shapes = forward_shapes(model, requests)
    assert shapes[:4] == [(1, 40), (2, 3), (1, 1), (4, 1)]  # a slice's rows are >= half its width
    _, report = generate_batch_and_report(model, requests, **OPTIONS)
    assert (report.prefill_tokens, report.prefill_padded_tokens, report.prefill_passes) == (46, 47, 3)
    alone = [run(model, [request])[0] for request in requests]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]


def test_a_stop_request_during_the_prefill_ends_it_at_the_next_slice(
    tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase], monkeypatch: pytest.MonkeyPatch
) -> None:
    import rollflow.policy.prefill as prefill
    from rollflow.policy.stopping import StopRequested, request_stop

    model, tokenizer = tiny
    monkeypatch.setattr(prefill, "PREFILL_TOKENS_PER_PASS", 1)  # 1 row a pass
    rows: list[int] = []  # of each forward pass

    def count_and_stop(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        rows.append(kwargs["input_ids"].shape[0])
        request_stop()  # arrives while the first slice runs

    hook = model.register_forward_pre_hook(count_and_stop, with_kwargs=True)
    try:
        with pytest.raises(StopRequested):
            run(model, requests_for(tokenizer, [5, 5, 5, 5]))
    finally:
        hook.remove()  # the stop flag is cleared after every test (conftest)
    assert rows == [1]  # one slice of the 4 rows' prefill, then nothing
