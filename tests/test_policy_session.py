"""What the backends share (``policy/session.py``): the finish rule, seeds, the token session's
own duties and the error root. The backends' tests (test_policy_transformers_backend.py,
test_vllm_backend.py, test_policy_openai_backend.py) check the same through real models
and servers; here each rule is pinned on its own, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio

import pytest
from transformers import PreTrainedTokenizerBase

from rollflow.envs.handle import describe_error
from rollflow.envs.types import Message
from rollflow.policy.codec import ChatCodec
from rollflow.policy.openai_backend import OpenAIChatPolicy, OpenAIPolicyError
from rollflow.policy.sampling import SamplingSettings, request_seed
from rollflow.policy.session import GenerationError, Sampled, TokenPolicy, TokenSession, finish_reason
from rollflow.policy.transformers_backend import GenerationTimeoutError
from rollflow.policy.vllm_admin import VLLMPolicyError

QUESTION: list[Message] = [{"role": "user", "content": "How many crates?"}]


@pytest.mark.parametrize(("stopped", "cut", "tokens", "expected"), [
    (True, False, 100, "stop"),  # a stop token wins, even on the last position
    (False, False, 99, "length"),  # max_completion_tokens ended it, room left
    (False, False, 100, "context"),  # the episode's context is full
    (False, False, 120, "context"),  # a server that let it run past our limit
    (False, True, 50, "context"),  # the server's own context limit cut it short
    (False, False, None, "length"),  # no usage reported: room left
])
def test_one_finish_rule(stopped: bool, cut: bool, tokens: int | None, expected: str) -> None:
    assert finish_reason(stopped=stopped, cut_by_server=cut, episode_tokens=tokens, max_model_length=100) == expected


def test_request_seeds_are_the_sampling_seed_cut_to_the_backends_bits() -> None:
    policy = OpenAIChatPolicy("http://127.0.0.1:1/v1", "m", settings=SamplingSettings(seed=7))
    full = request_seed(7, 11, 2, 3, 1)
    assert policy.request_seed((11, 2), 3, 1) == full % 2**31
    assert TokenPolicy(SamplingSettings(seed=7), 0).request_seed((11, 2), 3, 1) == full  # 63 bits: the draw's own


def test_reseed_starts_the_episode_identities_over() -> None:
    policy = TokenPolicy(SamplingSettings(seed=1), version=3)
    first = policy.episode_seeds.identity("opening")
    assert policy.episode_seeds.identity("opening") == (first[0], 1)  # a second episode of one opening
    policy.reseed(5)
    assert (policy.settings.seed, policy.version) == (5, 3)
    assert policy.episode_seeds.identity("opening") == first


class _Scripted(TokenSession[TokenPolicy]):
    """A token session whose backend answers a fixed list of tokens: the base's duties alone."""

    def __init__(self, policy: TokenPolicy, answer: tuple[int, ...], stopped: bool) -> None:
        super().__init__(policy, ())
        self.answer, self.stopped = answer, stopped
        self.asked: list[tuple[int, int, tuple[int, int]]] = []
        self.released = 0

    async def _sample(self, context_ids: tuple[int, ...], max_new: int, turn: int) -> Sampled:
        self.asked.append((max_new, turn, self.episode))
        return Sampled(self.answer, tuple(-1.0 for _ in self.answer), self.stopped, False, attempts=2)

    async def _release(self) -> None:
        self.released += 1


def _policy(tokenizer: PreTrainedTokenizerBase, **settings: int) -> TokenPolicy:
    policy = TokenPolicy(SamplingSettings(**settings), version=0)
    policy.codec = ChatCodec(tokenizer)
    return policy


def test_a_token_session_budgets_counts_turns_and_records_the_action(bundled_tokenizer: PreTrainedTokenizerBase) -> None:
    policy = _policy(bundled_tokenizer, max_completion_tokens=8)
    stop = bundled_tokenizer.eos_token_id
    hello = tuple(bundled_tokenizer.encode("Hello", add_special_tokens=False))
    session = _Scripted(policy, (*hello, stop), stopped=True)

    async def two_turns() -> tuple[object, object]:
        first = await session.act(QUESTION)
        following = [*QUESTION, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "And?"}]
        return first, await session.act(following)

    first, second = asyncio.run(two_turns())
    assert (first.text, first.finish_reason, first.sampling_attempts) == ("Hello", "stop", 2)
    assert [(max_new, turn) for max_new, turn, _ in session.asked] == [(8, 0), (8, 1)]
    assert session.asked[0][2] == session.asked[1][2]  # one episode identity for every turn
    assert not second.reset and second.prompt_delta_ids  # the second prompt extends the first


def test_no_room_for_a_token_is_context_without_sampling(bundled_tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = len(ChatCodec(bundled_tokenizer).render_prompt_ids(QUESTION, ()))
    session = _Scripted(_policy(bundled_tokenizer, max_model_length=prompt), (1,), stopped=False)
    action = asyncio.run(session.act(QUESTION))
    assert (action.finish_reason, action.token_ids, action.sampling_attempts) == ("context", (), 0)
    assert session.asked == []


def test_an_action_that_fills_the_context_is_context_and_one_cut_by_the_limit_is_length(
    bundled_tokenizer: PreTrainedTokenizerBase,
) -> None:
    prompt = len(ChatCodec(bundled_tokenizer).render_prompt_ids(QUESTION, ()))
    filled = _Scripted(_policy(bundled_tokenizer, max_model_length=prompt + 3, max_completion_tokens=3), (5, 6, 7), False)
    assert asyncio.run(filled.act(QUESTION)).finish_reason == "context"
    cut = _Scripted(_policy(bundled_tokenizer, max_model_length=prompt + 4, max_completion_tokens=3), (5, 6, 7), False)
    assert asyncio.run(cut.act(QUESTION)).finish_reason == "length"


def test_a_closed_session_releases_once_and_refuses_to_act(bundled_tokenizer: PreTrainedTokenizerBase) -> None:
    session = _Scripted(_policy(bundled_tokenizer), (1,), stopped=False)

    async def close_twice_then_act() -> None:
        await session.close()
        await session.close()
        await session.act(QUESTION)

    with pytest.raises(RuntimeError, match="closed policy session"):
        asyncio.run(close_twice_then_act())
    assert session.released == 1


@pytest.mark.parametrize("error", [GenerationTimeoutError, VLLMPolicyError, OpenAIPolicyError])
def test_backend_errors_share_one_root_and_are_recorded_by_their_own_name(error: type[GenerationError]) -> None:
    assert issubclass(error, GenerationError) and issubclass(error, RuntimeError)
    assert describe_error(error("all 2 attempts failed"), "policy") == f"{error.__name__}: all 2 attempts failed (in policy)"
