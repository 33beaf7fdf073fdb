"""OPD teachers: the logprob a teacher model gives each token of a student's own sequence.

Two teachers answer the same question, "``log p_teacher(input_ids[t] | input_ids[:t])`` for
the wanted positions ``t``", aligned to ``input_ids`` like the sampler's logprobs (0 where
not wanted):

- ``LocalTeacher``: a model loaded with ``rollflow.policy.models`` (an HF folder, a GGUF
  file, the bundled model, optionally a peft adapter on it), one forward pass per sequence
  under ``log_softmax(logits / temperature)``: the trainer's convention, so the teacher's
  and the student's logprobs describe the same tempered distributions.
- ``ServerTeacher``: a vLLM server, ``POST /v1/completions`` with all but the last token
  id as ``prompt``, ``max_tokens = 1`` and ``prompt_logprobs = 0``; vLLM answers each
  prompt token's logprob given its prefix (the first is ``null``), keyed by the token id,
  and ``logprob_token_ids = [last]`` gives the last token's at the generated position. So
  a sample as long as the server's ``max_model_len`` fits (prompt + 1 generated token); a
  longer one is refused naming that limit (read once from ``GET /v1/models``). Those are
  the raw model's logprobs (temperature 1, no top-p or top-k), so
  ``check_server_temperature`` refuses a run sampling at another temperature rather than
  compare unlike distributions.

A token-level signal needs one vocabulary: ``check_same_tokenizer`` compares the two
sides' fingerprints (model vocabulary size, tokenizer length, special-token ids, the ids
of a probe text and of a probe chat rendered with the template) and raises
``TokenizerMismatchError`` naming both models. A server's fingerprint comes from its
``/tokenize`` endpoint (no vocabulary size there).

Simplified: a local teacher scores one sequence per forward pass (no padding, no
micro-batches: on CPU a step's few dozen samples are seconds next to rollout), and a
server teacher posts one request per sequence, sequentially, through the student's retry
loop (``rollflow.policy.retries``: connection errors, timeouts, 408, 429 and 5xx), three
attempts with a short pause between them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import torch
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from rollflow.policy.models import ModelRef, hf_model_folder, load_causal_lm, load_tokenizer
from rollflow.policy.retries import RetriesExhausted, post_with_retries, server_error_message
from rollflow.policy.vllm_admin import VLLMPolicyError, served_models

PROBE_TEXT = 'Probe: 12 + 30 = 42; {"name": "lookup", "arguments": {"key": "élan"}}\n'
PROBE_CHAT = (
    {"role": "system", "content": "You are a probe."},
    {"role": "user", "content": "Say ok."},
    {"role": "assistant", "content": "ok"},
)
_SERVER_ATTEMPTS = 3
_SERVER_TIMEOUT_S = 300.0
_SERVER_RETRY_DELAY_S = 0.5  # times the attempt number: a restarting server gets a moment


class TeacherError(RuntimeError):
    """A teacher could not be reached or answered something unusable; the message names it."""


class TokenizerMismatchError(ValueError):
    """Student and teacher do not share a tokenizer: token-level distillation is meaningless."""


class Teacher(Protocol):
    name: str

    def token_logprobs(self, input_ids: Sequence[int], wanted: Sequence[bool]) -> list[float]:
        """``log p(input_ids[t] | input_ids[:t])`` where ``wanted[t]``, else 0; len = len(input_ids)."""
        ...


@dataclass(frozen=True)
class TokenizerFingerprint:
    """What two models must agree on to share token ids; None = this side cannot tell."""

    vocab_size: int | None  # the model's embedding rows (config.json)
    tokenizer_size: int | None
    special_ids: tuple[tuple[str, int | None], ...]
    probe_ids: tuple[int, ...]
    chat_ids: tuple[int, ...]


def model_ref_for(path: str | None, adapter: str | None = None) -> ModelRef:
    """A ``ModelRef`` from a path that is an HF folder or a ``.gguf`` file (None: bundled)."""
    if path is not None and path.endswith(".gguf"):
        return ModelRef(gguf_file=path, adapter=adapter)
    return ModelRef(path=path, adapter=adapter)


def describe_ref(ref: ModelRef) -> str:
    base = ref.gguf_file or ref.path or "the bundled SmolLM2-135M-Instruct"
    return f"{base} + adapter {ref.adapter}" if ref.adapter else str(base)


def local_fingerprint(ref: ModelRef, tokenizer: PreTrainedTokenizerBase | None = None) -> TokenizerFingerprint:
    tokenizer = tokenizer or load_tokenizer(ref)
    vocab = int(AutoConfig.from_pretrained(str(hf_model_folder(ref))).vocab_size)
    specials = tuple(
        (name, getattr(tokenizer, f"{name}_token_id")) for name in ("bos", "eos", "pad", "unk")
    )
    chat = tokenizer.apply_chat_template(list(PROBE_CHAT), tokenize=True, return_dict=False)
    return TokenizerFingerprint(
        vocab_size=vocab,
        tokenizer_size=len(tokenizer),
        special_ids=specials,
        probe_ids=tuple(tokenizer.encode(PROBE_TEXT, add_special_tokens=False)),
        chat_ids=tuple(int(i) for i in chat),
    )


def check_same_tokenizer(
    student: TokenizerFingerprint, teacher: TokenizerFingerprint, student_name: str, teacher_name: str
) -> None:
    """Raise ``TokenizerMismatchError`` naming both models unless the fingerprints agree."""
    problems = []
    for what, mine, theirs in (
        ("model vocabulary size", student.vocab_size, teacher.vocab_size),
        ("tokenizer length", student.tokenizer_size, teacher.tokenizer_size),
    ):
        if mine is not None and theirs is not None and mine != theirs:
            problems.append(f"{what} {mine} vs {theirs}")
    if student.special_ids and teacher.special_ids and student.special_ids != teacher.special_ids:
        problems.append(f"special token ids {dict(student.special_ids)} vs {dict(teacher.special_ids)}")
    if student.probe_ids != teacher.probe_ids:
        problems.append(f"the probe text {PROBE_TEXT!r} tokenizes differently")
    if student.chat_ids != teacher.chat_ids:
        problems.append("a probe chat renders to different token ids (chat template or special tokens)")
    if problems:
        raise TokenizerMismatchError(
            f"student {student_name} and teacher {teacher_name} do not share a tokenizer "
            f"({'; '.join(problems)}): on-policy distillation scores the student's token ids "
            "with the teacher, so both must use the same vocabulary and chat template"
        )


# ---------------------------------------------------------------- a local model


class LocalTeacher:
    """A frozen model in this process (``rollflow.policy.models``), scoring one sequence a pass."""

    def __init__(
        self, ref: ModelRef, temperature: float, dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        model, tokenizer = load_causal_lm(ref, dtype, device=device)
        model.requires_grad_(False)
        self.model: PreTrainedModel = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.ref = ref
        self.name = describe_ref(ref)

    def fingerprint(self) -> TokenizerFingerprint:
        return local_fingerprint(self.ref, self.tokenizer)

    def token_logprobs(self, input_ids: Sequence[int], wanted: Sequence[bool]) -> list[float]:
        assert len(input_ids) == len(wanted), f"{len(input_ids)} tokens but {len(wanted)} wanted flags"
        ids_1T = torch.tensor([list(input_ids)], dtype=torch.long, device=self.model.device)
        with torch.no_grad():
            logits_TV = self.model(input_ids=ids_1T, use_cache=False).logits[0, :-1].float()
        logprobs_TV = torch.log_softmax(logits_TV / self.temperature, dim=-1)  # row t-1 predicts token t
        picked_T = logprobs_TV.gather(-1, ids_1T[0, 1:].unsqueeze(-1)).squeeze(-1)  # (T-1,)
        out = [0.0] + [float(v) for v in picked_T]  # token 0 has nothing to predict it
        return [lp if w else 0.0 for lp, w in zip(out, wanted, strict=True)]


# ---------------------------------------------------------------- a vLLM server


class ServerTeacher:
    """A vLLM server's ``prompt_logprobs`` for token-id prompts (raw logprobs: temperature 1)."""

    def __init__(self, base_url: str, api_model: str) -> None:
        root = base_url.rstrip("/")
        self.url = root if root.endswith("/v1") else f"{root}/v1"
        self.api_model = api_model
        self.name = f"{api_model} at {base_url}"
        self._max_model_len: int | None = None  # from GET /models, on the first sample

    def token_logprobs(self, input_ids: Sequence[int], wanted: Sequence[bool]) -> list[float]:
        assert len(input_ids) == len(wanted), f"{len(input_ids)} tokens but {len(wanted)} wanted flags"
        if len(input_ids) < 2:
            return [0.0] * len(input_ids)  # token 0 has nothing to predict it
        self._check_fits(len(input_ids))
        # The prompt is all but the last token, whose logprob is read at the one generated
        # position: prompt + 1 token fits a server whose max_model_len is the sample's length.
        *context, last = input_ids
        body = {
            "model": self.api_model, "prompt": context, "max_tokens": 1, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "min_p": 0.0, "prompt_logprobs": 0, "logprobs": 0,
            "logprob_token_ids": [last], "return_tokens_as_token_ids": True,
        }
        answer = self._post("/completions", body)
        logprobs = [*parse_prompt_logprobs(answer, context, self.name), parse_next_logprob(answer, last, self.name)]
        return [lp if w else 0.0 for lp, w in zip(logprobs, wanted, strict=True)]

    def _check_fits(self, length: int) -> None:
        """Refuse a sequence longer than the server's ``max_model_len`` (asked once)."""
        if self._max_model_len is None:
            try:
                listed = served_models(self.url)
            except VLLMPolicyError as error:
                raise TeacherError(f"teacher {self.name}: {error}") from error
            if self.api_model not in listed:
                raise TeacherError(f"teacher {self.name}: {self.url} does not serve it; it serves {sorted(listed)}")
            self._max_model_len = listed[self.api_model] or 0  # 0: the server does not say
        if 0 < self._max_model_len < length:
            raise TeacherError(
                f"teacher {self.name}: a sample of {length} tokens does not fit its "
                f"max_model_len={self._max_model_len}; start the teacher server with "
                "--max-model-len at least [rollout].max_model_length"
            )

    def fingerprint(self) -> TokenizerFingerprint:
        probe = self._post("/tokenize", {"model": self.api_model, "prompt": PROBE_TEXT, "add_special_tokens": False})
        chat = self._post("/tokenize", {"model": self.api_model, "messages": list(PROBE_CHAT),
                                        "add_generation_prompt": False})
        try:
            return TokenizerFingerprint(None, None, (), tuple(probe["tokens"]), tuple(chat["tokens"]))
        except (KeyError, TypeError) as error:
            raise TeacherError(f"{self.name}: /tokenize answered no tokens: {json.dumps(probe)[:300]}") from error

    def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        # /tokenize sits at the server root in vLLM, /completions under /v1
        url = self.url.removesuffix("/v1") + path if path == "/tokenize" else self.url + path

        async def post() -> httpx.Response:
            async with httpx.AsyncClient(timeout=_SERVER_TIMEOUT_S) as client:
                posted = await post_with_retries(
                    client, (url,), lambda _: body, attempts=_SERVER_ATTEMPTS, pause_s=_SERVER_RETRY_DELAY_S
                )
                return posted.response

        try:
            response = asyncio.run(post())  # one sequence at a time: the stage is synchronous
        except RetriesExhausted as failed:
            raise TeacherError(
                f"teacher {self.name}: {url} failed {_SERVER_ATTEMPTS} times; last: {failed.reason}"
            ) from None
        if response.status_code != 200:  # a refusal: the same body fails again
            message = f"HTTP {response.status_code}: {server_error_message(response)}"
            raise TeacherError(f"teacher {self.name}: {url} answered {message}")
        return response.json()


def parse_prompt_logprobs(answer: Any, input_ids: Sequence[int], teacher: str) -> list[float]:
    """The logprob of each prompt token from a vLLM completion (0 for the first token).

    vLLM's ``choices[0].prompt_logprobs`` is one entry per prompt token: ``null`` for the
    first, then ``{"<token id>": {"logprob": x, "rank": r, "decoded_token": s}, ...}``
    holding the prompt token itself (plus the top-k, none at ``prompt_logprobs = 0``).
    """
    try:
        entries = answer["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError) as error:
        raise TeacherError(
            f"teacher {teacher} sent no prompt_logprobs (a vLLM server?): {str(answer)[:300]}"
        ) from error
    if not isinstance(entries, list) or len(entries) != len(input_ids):
        raise TeacherError(
            f"teacher {teacher}: {len(input_ids)} prompt tokens but "
            f"{len(entries) if isinstance(entries, list) else 'no list of'} prompt logprobs"
        )
    out = [0.0]
    for position, (token, entry) in enumerate(zip(input_ids[1:], entries[1:], strict=True), start=1):
        found = entry.get(str(token)) if isinstance(entry, dict) else None
        if not isinstance(found, dict) or "logprob" not in found:
            raise TeacherError(f"teacher {teacher}: no logprob for prompt token {token} at position {position}")
        out.append(float(found["logprob"]))
    return out


def parse_next_logprob(answer: Any, token: int, teacher: str) -> float:
    """The logprob of ``token`` at a completion's one generated position.

    ``logprob_token_ids = [token]`` makes vLLM put ``token`` in that position's
    ``top_logprobs``, keyed ``"token_id:<id>"`` (``return_tokens_as_token_ids``), beside
    whatever token it sampled.
    """
    try:
        top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
        return float(top[f"token_id:{token}"])
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise TeacherError(
            f"teacher {teacher}: no logprob for token {token} at the generated position (a vLLM "
            f"server that knows logprob_token_ids, 0.32 or newer?): {str(answer)[:300]}"
        ) from error


def check_server_temperature(temperature: float, teacher: str) -> None:
    if temperature != 1.0:
        raise TeacherError(
            f"teacher {teacher}: vLLM's prompt_logprobs are the raw model's (temperature 1) but "
            f"[rollout].temperature = {temperature}: the student's and the teacher's logprobs would "
            "describe different distributions; sample at 1.0 or use a local teacher"
        )
