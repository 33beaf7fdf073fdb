"""The transformers policy: every waiting episode's next action in one batched generate call.

Each episode opens a ``TransformersSession``. A session's ``act`` renders only what is
new (the chat codec keeps the episode token-exact), checks the episode's context budget
and queues a generation request. One scheduler task per busy policy collects the queue
into a batch (once every open session has a request waiting, or a short window has
passed), runs ``generate_batch`` in a worker thread so the event loop keeps stepping
environments, and hands each session its tokens.

Budgets, seeds and endings are every token session's (``rollflow.policy.session``): each
request draws from its own generator, seeded with ``request_seed(episode, turn, attempt)``.

KV reuse (``SamplingSettings.kv_reuse``, on by default): the policy keeps each open
session's KV cache, as its last batch left it (the transcript up to its last sampled
token), and the next request prefills only what is new: that token, the environment's
reply and the next assistant header. The cache is dropped when the session closes, when
the chat template rewrote history (``reset``: a full prefill), and for every session when
new weights or an adapter arrive. A timed-out attempt keeps the session's previous cache,
still a prefix of its context. Caches are stored per session without padding and
re-padded into each batch (policy/generation.py says how, and what it costs in floats).

Deadlines: with ``generation_timeout_s`` set, a row still generating when its batch's
deadline passes is discarded (its tokens never leave this module) and queued again, up
to ``max_sampling_attempts`` attempts in all; then ``act`` raises ``GenerationTimeoutError``
and the runner records it on the episode.

Simplifications, and why:
- One batch runs at a time per policy: on a CPU the batch already uses every core, and a
  second concurrent batch would only thrash. New requests wait for the next batch.
- Weight swaps (``set_weights`` / ``load_adapter``) take the same lock as generation, so
  a batch never mixes versions; the version number is read by the runner per episode.
- A policy serves one event loop at a time (its scheduler task lives in that loop).
- A reset drops the whole cache, though the rewritten render often shares its opening
  with it: templates that rewrite history are rare, and a prefix match would have to be
  found in tokens, not text.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollflow.envs.types import ToolSpec
from rollflow.policy.codec import ChatCodec
from rollflow.policy.generation import BatchReport, GenerationOutput, GenerationRequest, generate_batch_and_report
from rollflow.policy.models import ModelRef, generation_stop_ids, load_causal_lm
from rollflow.policy.prefill import CachedPrefix
from rollflow.policy.sampling import SamplingSettings
from rollflow.policy.session import GenerationError, Sampled, TokenPolicy, TokenSession
from rollflow.policy.stopping import StopRequested

_POLL_S = 0.002


class GenerationTimeoutError(GenerationError):
    """Every allowed attempt at one action ran past the generation deadline."""


@dataclass
class _Pending:
    """One queued request and the future its session awaits."""

    session: int  # the session's serial number: the key of its KV cache
    episode: tuple[int, int]  # EpisodeSeeds identity
    turn: int
    context_ids: tuple[int, ...]
    max_new_tokens: int
    future: asyncio.Future[tuple[GenerationOutput, int]]
    attempt: int = 1


@dataclass
class _Stats:
    """Counters for benchmarks and tests: batches run, their sizes and what they computed."""

    batch_sizes: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    batches: list[BatchReport] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(batch.prefill_tokens for batch in self.batches)

    @property
    def prefill_s(self) -> float:
        return sum(batch.prefill_s for batch in self.batches)

    @property
    def decode_s(self) -> float:
        return sum(batch.decode_s for batch in self.batches)


class TransformersPolicy(TokenPolicy):
    """A ``Policy`` (envs/agent.py) over a local transformers model."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        settings: SamplingSettings | None = None,
        *,
        version: int = 0,
        batch_window_s: float = 0.05,
        max_batch_size: int = 64,
    ) -> None:
        super().__init__(settings, version)
        _check_model_length(model, self.settings)
        if batch_window_s < 0 or max_batch_size < 1:
            raise ValueError(
                f"batch_window_s must be >= 0 and max_batch_size >= 1, "
                f"got {batch_window_s} and {max_batch_size}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.codec = ChatCodec(tokenizer, stop_token_ids=generation_stop_ids(model))
        self.batch_window_s = batch_window_s
        self.max_batch_size = max_batch_size
        self.stats = _Stats()
        self._pending: list[_Pending] = []
        self._open_sessions: set[int] = set()
        self._next_session = 0
        self._caches: dict[int, CachedPrefix] = {}  # open session -> its KV cache
        self._caches_lock = threading.Lock()
        self._scheduler: asyncio.Task[None] | None = None
        self._model_lock = threading.Lock()

    @classmethod
    def from_ref(
        cls,
        model_ref: ModelRef,
        settings: SamplingSettings | None = None,
        *,
        version: int = 0,
        batch_window_s: float = 0.05,
    ) -> TransformersPolicy:
        """Load ``model_ref`` (default: the bundled SmolLM2) and wrap it."""
        model, tokenizer = load_causal_lm(model_ref)
        return cls(model, tokenizer, settings, version=version, batch_window_s=batch_window_s)

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> TransformersSession:
        with self._caches_lock:
            number, self._next_session = self._next_session, self._next_session + 1
            self._open_sessions.add(number)
        return TransformersSession(self, number, tuple(tool_specs))

    @property
    def cached_tokens(self) -> int:
        """Tokens whose keys and values are held for open sessions (memory: see generation.py)."""
        with self._caches_lock:
            return sum(len(cache) for cache in self._caches.values())

    # ------------------------------------------------------------ new policy versions

    def set_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy (some of) the model's parameters in; unknown names are an error."""
        with self._model_lock:
            result = self.model.load_state_dict(dict(state_dict), strict=False)
            if result.unexpected_keys:
                raise KeyError(f"set_weights: unknown parameter names {result.unexpected_keys[:5]}")
            self._drop_caches()  # computed by the old weights
            self.version = version

    def load_adapter(self, adapter_dir: str | Path, version: int) -> None:
        """Act with the LoRA adapter in ``adapter_dir`` from now on (replaces the previous one)."""
        from peft import PeftModel

        if not (Path(adapter_dir) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{adapter_dir} is not a peft adapter folder")
        with self._model_lock:
            name = f"v{version}"
            if isinstance(self.model, PeftModel):
                previous = self.model.active_adapter
                self.model.load_adapter(str(adapter_dir), adapter_name=name)
                self.model.set_adapter(name)
                if previous != name:
                    self.model.delete_adapter(previous)
            else:
                self.model = PeftModel.from_pretrained(self.model, str(adapter_dir), adapter_name=name)
            self.model.eval()
            self._drop_caches()  # computed without this adapter
            self.version = version

    # ------------------------------------------------------------ batching

    async def _generate(
        self, session: int, episode: tuple[int, int], turn: int, context_ids: tuple[int, ...],
        max_new_tokens: int,
    ) -> tuple[GenerationOutput, int]:
        """Queue one request; resolves to (output, attempts used)."""
        loop = asyncio.get_running_loop()
        if self._scheduler is not None and not self._scheduler.done():
            if self._scheduler.get_loop() is not loop:
                raise RuntimeError("a TransformersPolicy serves one event loop at a time")
        pending = _Pending(session, episode, turn, context_ids, max_new_tokens, loop.create_future())
        self._pending.append(pending)
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = loop.create_task(self._schedule())
        return await pending.future

    async def _schedule(self) -> None:
        """Run batches until the queue is empty, then end (a new request starts a new task)."""
        while self._pending:
            await self._wait_for_batch()
            # Members and row order by episode identity, not arrival: a batch's padded shape
            # changes floating-point sums, so a replay must batch the same rows the same way.
            self._pending.sort(key=lambda p: p.episode)
            batch = [p for p in self._pending[: self.max_batch_size] if not p.future.done()]
            del self._pending[: self.max_batch_size]
            if not batch:
                continue
            try:
                outputs = await asyncio.to_thread(self._run_batch, batch)
            except StopRequested as stop:  # every waiting episode stops too, none is left hanging
                for pending in [*batch, *self._pending]:
                    if not pending.future.done():
                        pending.future.set_exception(stop)
                self._pending.clear()
                raise
            except Exception as error:  # the model failed: every waiting episode learns why
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(error)
                continue
            for pending, output in zip(batch, outputs, strict=True):
                self._deliver(pending, output)

    async def _wait_for_batch(self) -> None:
        started = time.monotonic()
        while len(self._pending) < min(len(self._open_sessions), self.max_batch_size):
            if time.monotonic() - started >= self.batch_window_s:
                return
            await asyncio.sleep(_POLL_S)

    def _run_batch(self, batch: Sequence[_Pending]) -> list[GenerationOutput]:
        reuse = self.settings.kv_reuse
        with self._model_lock:  # caches are read and written under it: no weight swap between
            requests = [
                GenerationRequest(
                    context_ids=p.context_ids,
                    max_new_tokens=p.max_new_tokens,
                    seed=self.request_seed(p.episode, p.turn, p.attempt),
                    prefix=self._cache_for(p) if reuse else None,
                )
                for p in batch
            ]
            outputs, report = generate_batch_and_report(
                self.model,
                requests,
                temperature=self.settings.temperature,
                top_p=self.settings.top_p,
                stop_token_ids=self.codec.stop_token_ids,
                pad_token_id=int(self.tokenizer.pad_token_id),
                timeout_s=self.settings.generation_timeout_s,
                keep_caches=reuse,
            )
            if reuse:
                self._keep_caches(batch, outputs)
        self.stats.batch_sizes.append(len(batch))
        self.stats.batches.append(report)
        self.stats.generated_tokens += sum(len(o.token_ids) for o in outputs)
        return outputs

    def _cache_for(self, pending: _Pending) -> CachedPrefix | None:
        with self._caches_lock:
            cache = self._caches.get(pending.session)
        if cache is None or pending.context_ids[: len(cache)] != cache.token_ids:
            return None
        return cache

    def _keep_caches(self, batch: Sequence[_Pending], outputs: Sequence[GenerationOutput]) -> None:
        with self._caches_lock:
            for pending, output in zip(batch, outputs, strict=True):
                # a session closed meanwhile (cancelled) keeps nothing; a timed-out row has no
                # cache, so its session keeps the previous one, still a prefix of its context
                if output.cache is not None and pending.session in self._open_sessions:
                    self._caches[pending.session] = output.cache

    def _drop_caches(self, session: int | None = None) -> None:
        """Forget one session's KV cache, or every session's (``None``)."""
        with self._caches_lock:
            if session is None:
                self._caches.clear()
            else:
                self._caches.pop(session, None)

    def _deliver(self, pending: _Pending, output: GenerationOutput) -> None:
        if pending.future.done():  # the episode gave up waiting (cancelled)
            return
        if not output.timed_out:
            pending.future.set_result((output, pending.attempt))
        elif pending.attempt < self.settings.max_sampling_attempts:
            pending.attempt += 1
            self._pending.insert(0, pending)
        else:
            pending.future.set_exception(
                GenerationTimeoutError(
                    f"generation ran past its {self.settings.generation_timeout_s} s deadline "
                    f"on all {pending.attempt} attempts (max_sampling_attempts="
                    f"{self.settings.max_sampling_attempts}); the output was discarded"
                )
            )

    def _session_closed(self, session: int) -> None:
        with self._caches_lock:
            self._open_sessions.discard(session)
            self._caches.pop(session, None)


class TransformersSession(TokenSession[TransformersPolicy]):
    """One episode's view of a ``TransformersPolicy`` (a ``PolicySession``)."""

    def __init__(self, policy: TransformersPolicy, number: int, tool_specs: tuple[ToolSpec, ...]):
        super().__init__(policy, tool_specs)
        self._number = number  # the policy's key for this session's KV cache

    async def _sample(self, context_ids: tuple[int, ...], max_new: int, turn: int) -> Sampled:
        output, attempts = await self._policy._generate(self._number, self.episode, turn, context_ids, max_new)
        assert output.stopped or len(output.token_ids) == max_new, "a generation without a stop token spent its budget"
        return Sampled(output.token_ids, output.logprobs, output.stopped, cut_by_server=False, attempts=attempts)

    async def _release(self) -> None:
        self._policy._session_closed(self._number)

    def _history_rewritten(self) -> None:  # the cache no longer spells the context
        self._policy._drop_caches(self._number)


def _check_model_length(model: PreTrainedModel, settings: SamplingSettings) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and settings.max_model_length > limit:
        raise ValueError(
            f"max_model_length={settings.max_model_length} exceeds the model's "
            f"max_position_embeddings={limit}"
        )
