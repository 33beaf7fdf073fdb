"""How flattening time grows with episode length: it must be linear in the turns.

Builds synthetic episodes of 4, 8, 16 and 32 turns (a 300-token opening prompt, then per
turn a 60-token context delta and a 40-token action), flattens each many times, and
prints the time per episode, per turn and per token. Linear growth shows as a flat
time per token; a quadratic concatenation would double it with every doubling of turns.

    .venv/bin/python bench/flatten_scaling.py [--repeats N]
"""

from __future__ import annotations

import argparse
import time

from rollflow.envs.episode import ActionTokens, EpisodeRollout
from rollflow.storage.records import EpisodeRecord, ScoreRecord
from rollflow.tasks.flatten import flatten_episode_to_samples

OPENING_TOKENS, DELTA_TOKENS, ACTION_TOKENS = 300, 60, 40


def synthetic_episode(turns: int) -> tuple[EpisodeRecord, ScoreRecord]:
    actions = tuple(
        ActionTokens(
            prompt_delta_ids=tuple(range(OPENING_TOKENS if t == 0 else DELTA_TOKENS)),
            reset=False,
            token_ids=tuple(1000 + k for k in range(ACTION_TOKENS)),
            logprobs=tuple(-0.01 * k for k in range(ACTION_TOKENS)),
            finish_reason="stop",
        )
        for t in range(turns)
    )
    rollout = EpisodeRollout(
        messages=(), response_text="", turns=turns, terminated=True, truncated=False,
        truncation_cause=None, actions=actions,
    )
    episode = EpisodeRecord("bench", 0, "train", "t", "train/0/0", "train/0/0/0", 0, rollout)
    score = ScoreRecord(
        "bench", 0, "train", "t", "train/0/0", "train/0/0/0", 1.0, None, {}, 0.0, 1.0, True,
        0.5, 0.5, 2, False, 0.5, True,
    )
    return episode, score


def time_flatten(turns: int, repeats: int) -> tuple[float, int]:
    """Best-of-3 mean seconds per flattened episode, and the tokens in its sample."""
    episode, score = synthetic_episode(turns)
    best = float("inf")
    tokens = 0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            samples = flatten_episode_to_samples(episode, score)
        best = min(best, (time.perf_counter() - start) / repeats)
        tokens = sum(len(s.input_ids) for s in samples)
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(f"{'turns':>5} {'tokens':>7} {'ms/episode':>11} {'us/turn':>8} {'ns/token':>9}")
    base_per_token = None
    for turns in (4, 8, 16, 32):
        seconds, tokens = time_flatten(turns, args.repeats)
        per_token = seconds / tokens * 1e9
        base_per_token = base_per_token or per_token
        print(f"{turns:>5} {tokens:>7} {seconds * 1e3:>11.3f} {seconds / turns * 1e6:>8.1f} "
              f"{per_token:>9.1f}  (x{per_token / base_per_token:.2f} of 4 turns per token)")


if __name__ == "__main__":
    main()
