"""A test environment broken on purpose: its scorer or its step raises on every episode, its
prompt is too long for a small context, or its reward never varies (``flat_reward``: every
episode scores 0, so no group has anything to teach) (``tests/test_loud_failures.py``)."""

from __future__ import annotations

from varied_reward_env import LetterShareEnv

from rollflow.envs.types import EnvironmentEpisode, EnvironmentStepResult, Message, RewardResult, TaskExample

BROKEN_PARTS = ("score", "step", "long_prompt", "flat_reward")
REPAIRED: set[str] = set()  # a test "fixes" the environment by adding its broken part here


class BrokenEnv(LetterShareEnv):
    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        if self.broken == "long_prompt":
            return [{"role": "user", "content": "Tell me about the number seven. " * 60}]
        return super().start_episode(example, prompt_text)

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        if self.broken == "step" and "step" not in REPAIRED:
            raise KeyError("the step is broken")
        return super().step_episode(example, messages, assistant_response)

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        if self.broken == "score" and "score" not in REPAIRED:
            raise ValueError("the scorer is broken")
        if self.broken == "flat_reward":
            return RewardResult(score=0.0, threshold=0.5)
        return super().score_episode(example, episode)


def load_environment(broken: str) -> BrokenEnv:
    if broken not in BROKEN_PARTS:
        raise ValueError(f"broken must be one of {BROKEN_PARTS}, got {broken!r}")
    return BrokenEnv(broken)


def load_forwarding(**kwargs: str) -> BrokenEnv:
    """A loader that hands its arguments on to the constructor, which refuses a wrong one."""
    return BrokenEnv(**kwargs)
