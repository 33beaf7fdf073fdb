"""Sampling settings and the distribution a token is actually drawn from.

``sampling_logprobs`` turns raw logits into the log-probabilities of the distribution we
sample from: logits divided by the temperature, tokens outside the top-p nucleus removed,
renormalised. The logprob recorded for a sampled token is read from exactly this tensor,
so the trainer's importance ratios compare against what really produced the token, not
the raw model distribution.

Simplifications, and why:
- Temperature 0 means greedy: the distribution sampled from is a point mass on the
  argmax, so the recorded logprob is 0. Useful for evaluation; GRPO wants temperature > 0.
- Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (the
  most likely token is always kept). Ties at the boundary fall by sort order.
- Every request draws from its own ``torch.Generator`` seeded from the run seed and the
  request's identity (``EpisodeSeeds``: the episode's opening prompt and occurrence, then
  turn and attempt), so an episode's samples do not depend on which other episodes
  happened to share its batch (up to float rounding of the batched forward pass).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    max_completion_tokens: int = 256  # per assistant action
    max_model_length: int = 2048  # per episode: prompt, every action and every env message
    seed: int = 0
    generation_timeout_s: float | None = None  # per attempt; None = no deadline
    max_sampling_attempts: int = 2  # attempts per action, the first one included
    # keep each open episode's KV cache between its turns and prefill only the new tokens
    # (policy/generation.py); False re-prefills the whole transcript every turn
    kv_reuse: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_completion_tokens < 1:
            problems.append(f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
        if self.max_model_length < 2:
            problems.append(f"max_model_length must be >= 2, got {self.max_model_length}")
        if self.generation_timeout_s is not None and not self.generation_timeout_s > 0:
            problems.append(f"generation_timeout_s must be > 0 or None, got {self.generation_timeout_s}")
        if self.max_sampling_attempts < 1:
            problems.append(f"max_sampling_attempts must be >= 1, got {self.max_sampling_attempts}")
        if problems:
            raise ValueError("invalid SamplingSettings: " + "; ".join(problems))


def sampling_logprobs(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from; -inf where a token cannot be drawn."""
    logits_BV = logits_BV.float()
    if temperature == 0:
        greedy_BV = torch.full_like(logits_BV, -math.inf)
        return greedy_BV.scatter_(-1, logits_BV.argmax(dim=-1, keepdim=True), 0.0)
    logprobs_BV = torch.log_softmax(logits_BV / temperature, dim=-1)
    if top_p >= 1:
        return logprobs_BV
    sorted_BV, order_BV = logprobs_BV.sort(dim=-1, descending=True)
    mass_before_BV = sorted_BV.exp().cumsum(dim=-1) - sorted_BV.exp()
    drop_sorted_BV = mass_before_BV >= top_p  # the first token has mass_before 0: always kept
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter_(-1, order_BV, drop_sorted_BV)
    return torch.log_softmax(logprobs_BV.masked_fill(drop_BV, -math.inf), dim=-1)


def draw_tokens(logprobs_BV: torch.Tensor, generators_B: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row, each row from its own generator. Returns (B,) int64.

    Inverse-CDF sampling: one uniform draw per row, found in the row's cumulative
    probabilities (``torch.multinomial`` costs ~8 ms per row over a 49k vocabulary here).
    """
    assert logprobs_BV.shape[0] == len(generators_B), (
        f"{logprobs_BV.shape[0]} rows but {len(generators_B)} generators"
    )
    probs_BV = logprobs_BV.exp()
    cdf_BV = probs_BV.cumsum(dim=-1)
    uniform_B = torch.cat([torch.rand(1, generator=g) for g in generators_B])
    targets_B1 = (uniform_B * cdf_BV[:, -1])[:, None]
    tokens_B = torch.searchsorted(cdf_BV, targets_B1, right=True).squeeze(-1)
    tokens_B = tokens_B.clamp(max=probs_BV.shape[-1] - 1)
    stranded_B = probs_BV.gather(-1, tokens_B[:, None]).squeeze(-1) == 0
    if stranded_B.any():  # float rounding put a target past the last drawable token
        positions_V = torch.arange(probs_BV.shape[-1])
        last_drawable_B = torch.where(probs_BV > 0, positions_V, -1).max(dim=-1).values
        tokens_B = torch.where(stranded_B, last_drawable_B, tokens_B)
    return tokens_B


class EpisodeSeeds:
    """Seed identities for episodes that do not depend on the order episodes start in.

    The runner opens sessions as each episode's set-up finishes, which varies from run to
    run; so an episode is known by its opening prompt and by how many episodes with the
    same opening were seen before it (since the last ``reset``). Episodes with different
    openings never share draws; the members of a GRPO group (one opening) get distinct
    draws, and at worst trade them among themselves when they race.
    """

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}
        self._lock = threading.Lock()

    def identity(self, opening: str) -> tuple[int, int]:
        """(opening key, occurrence) for a new episode whose first prompt is ``opening``."""
        key = int.from_bytes(hashlib.sha256(opening.encode()).digest()[:8], "big") >> 1
        with self._lock:
            occurrence = self._seen.get(key, 0)
            self._seen[key] = occurrence + 1
        return key, occurrence

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()


def request_seed(run_seed: int, *identity: int) -> int:
    """A 63-bit seed for one generation request, stable across processes and platforms."""
    key = ":".join(str(part) for part in (run_seed, *identity)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1
