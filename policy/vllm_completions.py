"""vLLM's ``/completions`` request and answer, as the policy's sessions send and read them.

``completion_body`` is the request: token ids in, every sampling knob explicit, the
sampled token ids and their logprobs asked back; ``parse_completion`` checks the answer
pairs one logprob with each token id (greedy: a point mass, logprob 0); ``top2_gap``
is the probe ``VLLMPolicy.connect`` sends to see that a server's logprobs are the
temperature-scaled distribution it samples from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from rollflow.policy.retries import server_error_message
from rollflow.policy.sampling import SamplingSettings
from rollflow.policy.vllm_admin import ADMIN_TIMEOUT_S, VLLMPolicyError


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    server_finish: str  # vLLM's finish_reason: "stop" or "length"


def completion_body(
    model: str, context_ids: Sequence[int], max_new: int, seed: int, settings: SamplingSettings
) -> dict[str, Any]:
    """The ``/completions`` request; every sampling knob explicit, so no server default leaks in."""
    return {
        "model": model,
        "prompt": list(context_ids),
        "max_tokens": max_new,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": seed,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }


def parse_completion(url: str, response: httpx.Response, temperature: float) -> Completion:
    """The sampled tokens and their logprobs of a ``/completions`` answer, checked to pair up."""
    if response.status_code != 200:
        raise VLLMPolicyError(f"{url} answered HTTP {response.status_code}: {server_error_message(response)}")
    try:
        choice = response.json()["choices"][0]
        token_ids = tuple(int(t) for t in choice["token_ids"])
        logprobs = tuple(float(lp) for lp in choice["logprobs"]["token_logprobs"])
        spelled = tuple(int(str(t).removeprefix("token_id:")) for t in choice["logprobs"]["tokens"])
        finish = str(choice["finish_reason"])
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise VLLMPolicyError(
            f"{url} sent no completion with token ids and logprobs (a vLLM server?): {response.text[:300]!r}"
        ) from error
    if spelled != token_ids or len(logprobs) != len(token_ids) or not token_ids:
        raise VLLMPolicyError(
            f"{url}: {len(token_ids)} token ids, {len(spelled)} logprob tokens and {len(logprobs)} "
            "logprobs do not pair up one to one"
        )
    if temperature == 0:  # greedy: the distribution sampled from is a point mass
        logprobs = tuple(0.0 for _ in token_ids)
    return Completion(token_ids, logprobs, finish)


def top2_gap(
    url: str, model: str, prompt: Sequence[int], temperature: float, headers: Mapping[str, str] | None = None
) -> float:
    """The logprob gap between the two likeliest first tokens at ``temperature``."""
    settings = SamplingSettings(temperature=temperature)
    body = completion_body(model, prompt, 1, 0, settings) | {"logprobs": 2}
    try:
        response = httpx.post(f"{url}/completions", json=body, timeout=ADMIN_TIMEOUT_S, headers=headers)
        top = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        first, second = sorted((float(v) for v in top.values()), reverse=True)[:2]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        raise VLLMPolicyError(f"{url}: the logprobs probe request failed: {error}") from error
    return first - second
