"""A test environment whose groups' reward variance is chosen by the task, for the backfill
and the curriculum (``tests/test_backfill.py``, ``tests/test_curriculum.py``).

Three kinds of one-turn task, each labelled with its kind as ``difficulty`` metadata:
``pass-N`` (the seeded policy answers 1: every episode passes, no variance), ``fail-N``
(it answers 0: every episode fails, no variance) and ``mixed-N`` (it answers a number drawn
from its seeded generator: the reward is that number, so a group's rewards vary, and an
episode passes when it is at least 0.5). ``SeededPolicy`` is reseeded with each chunk's
seed, as a model's sampler is, so a replayed chunk must give the same answers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.scripted import ScriptedPolicy
from rollflow.envs.types import (
    EnvironmentEpisode,
    EnvironmentStepResult,
    Message,
    RewardResult,
    Split,
    TaskExample,
)


class DifficultyEnv(EnvironmentMultiTurn):
    checks_tool_protocol = False  # free text

    def __init__(self, mixed: int = 4, passing: int = 4, failing: int = 4) -> None:
        counts = {"mixed": mixed, "pass": passing, "fail": failing}
        self.rows = [
            TaskExample(input=f"{kind} {n}", metadata={"difficulty": kind}, id=f"{kind}-{n}")
            for kind, count in counts.items() for n in range(count)
        ]

    def examples(self, split: Split) -> Sequence[TaskExample]:
        return self.rows if split == "train" else self.rows[:2]

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "user", "content": str(example.input)}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return 1

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        return EnvironmentStepResult(done=True)

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        return RewardResult(score=float(episode.response_text), threshold=0.5)


def load_environment(mixed: int = 4, passing: int = 4, failing: int = 4) -> DifficultyEnv:
    return DifficultyEnv(mixed, passing, failing)


class SeededPolicy(ScriptedPolicy):
    """Answers 1 to ``pass`` tasks, 0 to ``fail`` tasks and a seeded draw to ``mixed`` ones;
    records the seeds it was given (one per chunk played)."""

    def __init__(self) -> None:
        super().__init__(self.answer)
        self.rng = random.Random(0)
        self.seeds: list[int] = []

    def reseed(self, seed: int) -> None:
        self.seeds.append(seed)
        self.rng = random.Random(seed)

    def answer(self, messages: Sequence[Message], turn: int) -> str:
        kind = str(messages[0]["content"]).split()[0]
        return {"pass": "1", "fail": "0"}.get(kind) or f"{self.rng.random():.6f}"
