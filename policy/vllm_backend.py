"""The vLLM policy: our codec renders token ids, vLLM servers sample, tokens come back as ids.

Token in, token out, as in the transformers backend: each session renders only what is
new with ``rollflow.policy.codec.ChatCodec`` (``prompt_delta_ids``, ``reset``) and posts
the whole context *as token ids* to ``{base_url}/completions``::

    {"model": M, "prompt": [ids], "max_tokens": n, "temperature": t, "top_p": p,
     "seed": s, "logprobs": 0, "return_token_ids": true,
     "return_tokens_as_token_ids": true, "stop_token_ids": [...], ...}

The answer's ``token_ids`` (the end-of-turn token included) and ``token_logprobs`` become
the action; the server never re-renders or re-tokenizes anything, so training sees
exactly what was sampled. ``M`` is the loaded adapter's name once an adapter is loaded
(``adapter_name``: ``policy-<run>-v{version}``, named by run so that runs sharing a server
never replace each other's adapters), else the served model name: a server is never sent base and
adapter requests together (on CPU vLLM 0.32 serves a base request batched with adapter
requests with an adapter; upstream bug).

Budgets, seeds and endings are every token session's (``rollflow.policy.session``):
``max_tokens`` is the action's ``max_new``, and an action the server ends short of it
without a stop token (its own context limit) is ``"context"``. One that the server stopped
on a token that is not one of ours (a stop string set on the server) raises.

Logprobs: vLLM returns the raw model's logprobs unless the server runs with
``--logprobs-mode processed_logprobs`` (then: after temperature and top-p, the
distribution actually sampled from). Managed servers (``rollflow.policy.vllm_spec``)
always run with it. An external server is probed on first contact (``connect``): one
1-token request at temperature 1 and one at 0.5 with the top-2 logprobs; with processed
logprobs the gap between the two top tokens doubles at 0.5, with raw ones it does not
move, and ``connect`` refuses the server (run it with the flag). At temperature 0
(greedy) the recorded logprob is 0, the point mass sampled from, as in the transformers
backend.

Several servers (``base_urls``, replicas of one model): sessions are dealt to them round
robin, so every turn of an episode goes to the same server (its prefix cache holds the
episode); a retried request moves on to the next server. Connection errors, timeouts
(``generation_timeout_s`` per request), 408/429/5xx are retried (``rollflow.policy.retries``)
up to ``max_sampling_attempts`` attempts in all; then ``act`` raises ``VLLMPolicyError`` (the
runner records it on the episode). Other HTTP errors raise at once with the server's
message.

Where an action was sampled: each action carries the index of the server that answered
(``PolicyAction.replica``; the episode records its last action's, ``episodes.replica``), and
``VLLMPolicy.stats.sampled_by`` counts actions per (server, model name, version); the
version is also on every episode (``Policy.version``).

Weight sync (``load_adapter``): ``POST /v1/load_lora_adapter`` on every server under the
version's name with ``load_inplace: false``, then ``POST /v1/unload_lora_adapter`` of the
previous version. A name is loaded once: vLLM keeps the request it was loaded with, and
one loaded in place makes the engine read the folder again at every step (and fail once
the folder is pruned); loading a name this policy already loaded from the same folder is
a no-op, from another folder an unload and a load. The server must be able to read the
adapter folder (same machine or a shared filesystem), and must run with ``--enable-lora``
and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. Full weights are swapped in place
(``reload_weights``, through vLLM's development endpoints). The completion request and its
answer are ``rollflow.policy.vllm_completions``; the other HTTP calls ``rollflow.policy.vllm_admin``.

Simplifications, and why:
- One HTTP client per session (sessions live in one event loop; the rollout stage runs a
  new loop per chunk), closed with the session.
- Seeds are 31-bit (``SeededPolicy.seed_bits``), like the OpenAI backend's: the same seed
  gives the same tokens on one server, but not the transformers backend's tokens (the two
  draw differently).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from transformers import PreTrainedTokenizerBase

from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.codec import ChatCodec
from rollflow.policy.retries import RetriesExhausted, post_with_retries
from rollflow.policy.sampling import EpisodeSeeds, SamplingSettings
from rollflow.policy.session import Sampled, TokenPolicy, TokenSession
from rollflow.policy.vllm_admin import (
    DEV_HINT,
    VLLMPolicyError,
    adapter_rank,
    admin_post,
    api_root,
    auth_headers,
    load_lora,
    reset_prefix_cache,
    served_models,
    unload_lora,
)
from rollflow.policy.vllm_completions import Completion, completion_body, parse_completion, top2_gap
from rollflow.policy.vllm_weights import LM_HEAD_SHARD, is_tied

_PROBE_TEMPERATURE = 0.5
_PROBE_MESSAGES: tuple[Message, ...] = ({"role": "user", "content": "Name a colour."},)


@dataclass(frozen=True)
class SampledBy:
    """Which server and model name sampled an action, and the policy version it was."""

    base_url: str
    model: str
    version: int


@dataclass
class VLLMStats:
    """Counters for benchmarks and tests."""

    sampled_by: Counter[SampledBy] = field(default_factory=Counter)
    generated_tokens: int = 0
    prompt_tokens: int = 0  # the whole context of every request (vLLM caches prefixes)
    retries: int = 0
    request_s: float = 0.0  # summed wall time of successful requests


class VLLMPolicy(TokenPolicy):
    """A ``Policy`` (envs/agent.py) served by one or more vLLM servers of one model."""

    seed_bits = 31

    def __init__(
        self,
        base_urls: Sequence[str],
        tokenizer: PreTrainedTokenizerBase,
        settings: SamplingSettings | None = None,
        *,
        served_model: str,
        version: int = 0,
        stop_token_ids: Sequence[int] = (),
        max_lora_rank: int | None = None,
        api_key: str | None = None,
    ) -> None:
        if not base_urls:
            raise VLLMPolicyError("a VLLMPolicy needs at least one base_url")
        super().__init__(settings, version)
        self.base_urls = tuple(api_root(url) for url in base_urls)
        self.codec = ChatCodec(tokenizer, stop_token_ids=stop_token_ids)
        self.served_model = served_model
        self.adapter_name: str | None = None
        self._loaded: dict[str, Path] = {}  # adapter name -> folder, on every server (views share it)
        self.max_lora_rank = max_lora_rank  # known for managed servers; None: ask the server
        self.api_key = api_key  # the managed servers' key (VLLMServerSpec.api_key), sent with every request
        self.stats = VLLMStats()
        # Episodes are dealt to the servers round robin from one count, shared with every
        # pinned view (an async run's groups): each replica gets its share however episodes
        # are grouped. next() on it is atomic, so threads can share it.
        self._sessions_opened = itertools.count()

    @property
    def auth_headers(self) -> dict[str, str]:
        """What every request to the servers carries: the key, where they have one."""
        return auth_headers(self.api_key)

    @property
    def request_model(self) -> str:
        """The ``model`` of every request: the adapter once one is loaded."""
        return self.adapter_name or self.served_model

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> VLLMSession:
        first_server = next(self._sessions_opened) % len(self.base_urls)
        return VLLMSession(self, tuple(tool_specs), first_server)

    # ------------------------------------------------------------ first contact

    def connect(self, *, check_logprobs_mode: bool) -> None:
        """Fail now, naming the server, unless each one answers and serves our model.

        Checks: ``GET /models`` answers and lists ``served_model`` with a
        ``max_model_len`` that holds ``max_model_length``; with ``check_logprobs_mode``,
        the server returns processed logprobs (see the module docstring).
        """
        for url in self.base_urls:
            listed = served_models(url, api_key=self.api_key)
            if self.served_model not in listed:
                raise VLLMPolicyError(f"{url} does not serve {self.served_model!r}; it serves {sorted(listed)}")
            limit = listed[self.served_model]
            if limit is not None and limit < self.settings.max_model_length:
                raise VLLMPolicyError(
                    f"{url} serves {self.served_model!r} with max_model_len={limit}, below "
                    f"[rollout].max_model_length={self.settings.max_model_length}"
                )
            if check_logprobs_mode:
                self._check_processed_logprobs(url)

    def _check_processed_logprobs(self, url: str) -> None:
        prompt = self.codec.render_prompt_ids(_PROBE_MESSAGES, ())
        gaps = [top2_gap(url, self.served_model, prompt, t, self.auth_headers) for t in (1.0, _PROBE_TEMPERATURE)]
        expected = gaps[0] / _PROBE_TEMPERATURE
        if abs(gaps[1] - expected) > 1e-3 * max(1.0, expected):
            raise VLLMPolicyError(
                f"{url} returns logprobs that ignore the temperature (top-2 gap {gaps[0]:.4f} "
                f"at 1.0, {gaps[1]:.4f} at {_PROBE_TEMPERATURE}, expected {expected:.4f}): "
                "run the server with --logprobs-mode processed_logprobs, or GRPO's importance "
                "ratios compare against the wrong distribution"
            )

    # ------------------------------------------------------------ new policy versions

    def load_adapter(self, adapter_dir: str | Path, version: int, name: str) -> None:
        """Act with the LoRA adapter in ``adapter_dir``, served as ``name``, as ``version``
        from now on (the previously loaded one is unloaded)."""
        previous = self.adapter_name
        self.add_adapter(adapter_dir, name)
        if previous is not None and previous != name:
            self.remove_adapter(previous)
        self.adapter_name, self.version = name, version

    def unload_adapter(self) -> None:
        """Act with the base model again (the loaded adapter, if any, is unloaded)."""
        if self.adapter_name is None:
            return
        self.remove_adapter(self.adapter_name)
        self.adapter_name = None

    # ------------------------------------------------------------ several versions at once (async)

    def add_adapter(self, adapter_dir: str | Path, name: str, *, only: Sequence[str] | None = None) -> None:
        """Load ``adapter_dir`` as ``name`` beside the adapters already loaded, once.

        Async collection keeps every version an in-flight group samples with; the server
        needs ``--max-loras`` at least that many. ``only``: load it on these servers alone
        (a replica restarted empty; the others hold it already).
        """
        adapter = Path(adapter_dir).resolve()
        if only is not None:
            for url in only:
                load_lora(api_root(url), name, adapter, api_key=self.api_key)
            return
        if self._loaded.get(name) == adapter:
            return
        rank = adapter_rank(adapter)
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise VLLMPolicyError(
                f"{adapter} has LoRA rank {rank}, above the server's --max-lora-rank {self.max_lora_rank}"
            )
        if name in self._loaded:  # this policy loaded the name from another folder
            self.remove_adapter(name)
        for url in self.base_urls:
            load_lora(url, name, adapter, api_key=self.api_key)
        self._loaded[name] = adapter

    def held_adapters(self) -> dict[str, Path]:
        """The adapters loaded on every server: name -> folder."""
        return dict(self._loaded)

    def adopt_adapters(self, held: Mapping[str, Path], acting: str | None, *, only: Sequence[str]) -> None:
        """Hold ``held`` (another policy's ``held_adapters``, on the same servers) and act
        with ``acting`` among them; load them on the servers ``only`` names (replicas
        restarted empty; the others hold them already)."""
        self._loaded, self.adapter_name = dict(held), acting
        for name, folder in held.items():
            self.add_adapter(folder, name, only=only)

    def remove_adapter(self, name: str) -> None:
        """Unload adapter ``name`` (no request may still name it)."""
        for url in self.base_urls:
            unload_lora(url, name, api_key=self.api_key)
        self._loaded.pop(name, None)

    def reload_weights(self, model_dir: str | Path, version: int, *, only: Sequence[str] | None = None) -> float:
        """Swap the servers' full weights for ``model_dir``'s in place; returns the seconds taken.

        ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
        (vLLM's development endpoints, ``VLLM_SERVER_DEV_MODE=1``; managed servers that
        reload in place run with it), then ``POST /reset_prefix_cache``: cached prefixes hold the
        old weights' keys and values, and a hit would sample the new policy from them.
        Requests already running finish on whichever weights each forward pass meets: the
        caller pauses new requests first when that matters. ``only``: these servers alone (a
        replica restarted on the base weights).
        """
        folder = Path(model_dir).resolve()
        if is_tied(folder) and not (folder / LM_HEAD_SHARD).exists():
            raise VLLMPolicyError(
                f"{folder}: a model with tied input and output embeddings needs its output layer as "
                f"{LM_HEAD_SHARD} to be reloaded in place (vLLM would keep the old one); full-weight "
                "checkpoints of rollflow carry it (rollflow.policy.vllm_weights.write_lm_head_shard)"
            )
        started = time.perf_counter()
        for url in self.base_urls if only is None else tuple(api_root(u) for u in only):
            root = url.removesuffix("/v1")
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
            admin_post(f"{root}/collective_rpc", body, what=f"reloading weights from {folder}", hint=DEV_HINT,
                       api_key=self.api_key)  # fmt: skip
            reset_prefix_cache(root, api_key=self.api_key)
        self.version = version
        return time.perf_counter() - started

    def pinned(self, version: int, *, adapter: str | None, seed: int) -> VLLMPolicy:
        """A view of this policy that always samples ``version`` (with ``adapter``, or the
        served model when None) from ``seed``: one per async group, so a group's every
        request names the version its rollout started under whatever loads later. It
        shares the servers, the stats and the round robin; its seeds are its own."""
        view = copy.copy(self)
        view.adapter_name, view.version = adapter, version
        view.settings = dataclasses.replace(self.settings, seed=seed)
        view.episode_seeds = EpisodeSeeds()
        return view


def adapter_name(prefix: str, version: int) -> str:
    """The name a policy version's LoRA adapter is served under: ``<prefix>-v<version>``
    (the prefix names the run: ``rollflow.generators.generator.run_adapter_prefix``)."""
    return f"{prefix}-v{version}"


class VLLMSession(TokenSession[VLLMPolicy]):
    """One episode against the servers (a ``PolicySession``); owns one HTTP client."""

    def __init__(self, policy: VLLMPolicy, tool_specs: tuple[ToolSpec, ...], first_server: int):
        super().__init__(policy, tool_specs)
        self._first_server = first_server
        self._client: httpx.AsyncClient | None = None

    async def _sample(self, context_ids: tuple[int, ...], max_new: int, turn: int) -> Sampled:
        policy = self._policy

        def body(attempt: int) -> dict[str, Any]:
            seed = policy.request_seed(self.episode, turn, attempt)
            request = completion_body(policy.request_model, context_ids, max_new, seed, policy.settings)
            return request | {"stop_token_ids": sorted(policy.codec.stop_token_ids)}

        settings = policy.settings
        try:
            posted = await post_with_retries(
                self._http(), policy.base_urls, body, attempts=settings.max_sampling_attempts,
                first=self._first_server, path="/completions",
                timeout_reason=f"no answer within generation_timeout_s={settings.generation_timeout_s}",
            )  # fmt: skip
        except RetriesExhausted as failed:
            policy.stats.retries += failed.attempts
            last = f"{failed.url}: {failed.reason}"
            raise VLLMPolicyError(f"all {failed.attempts} attempts at an action failed; last: {last}") from None
        policy.stats.retries += posted.attempt - 1
        completion = parse_completion(posted.url, posted.response, settings.temperature)
        self._count(posted.url, completion, len(context_ids), posted.seconds)
        stopped = policy.codec.ends_with_stop(completion.token_ids)
        if not stopped and completion.server_finish == "stop":
            raise VLLMPolicyError(
                f"the server stopped an action on token {completion.token_ids[-1]}, which is not one "
                f"of our stop tokens {sorted(policy.codec.stop_token_ids)} (a stop string set on the server?)"
            )
        cut = not stopped and len(completion.token_ids) < max_new  # the server's own context limit
        replica = policy.base_urls.index(posted.url) if posted.url in policy.base_urls else None
        return Sampled(completion.token_ids, completion.logprobs, stopped, cut, posted.attempt, replica)

    async def _release(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _count(self, url: str, completion: Completion, prompt_tokens: int, seconds: float) -> None:
        stats = self._policy.stats
        stats.sampled_by[SampledBy(url, self._policy.request_model, self._policy.version)] += 1
        stats.generated_tokens += len(completion.token_ids)
        stats.prompt_tokens += prompt_tokens
        stats.request_s += seconds

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            settings = self._policy.settings
            self._client = httpx.AsyncClient(timeout=settings.generation_timeout_s, headers=self._policy.auth_headers)
        return self._client
