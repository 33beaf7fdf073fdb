"""A test environment whose reward varies even for a random tiny model's gibberish.

Flow tests need groups with reward variance: otherwise every advantage is 0, the update
changes nothing, and "a resumed run ends with the same weights" would hold trivially.
The reward is the share of letters in the reply, which differs between any two samples.
"""

from __future__ import annotations

from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.types import EnvironmentEpisode, EnvironmentStepResult, Message, RewardResult, TaskExample


class LetterShareEnv(EnvironmentMultiTurn):
    checks_tool_protocol = False  # free text

    def __init__(self) -> None:
        rows = [{"input": f"Say something about the number {n}.", "id": f"say-{n}"} for n in range(8)]
        self.dataset = {"train": rows, "validation": rows[:2]}

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "user", "content": str(example.input)}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return 2

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        if len(messages) < 4:  # one follow-up question, then done
            return EnvironmentStepResult(done=False, messages=({"role": "user", "content": "Go on."},))
        return EnvironmentStepResult(done=True)

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        text = episode.response_text
        share = sum(c.isalpha() for c in text) / max(1, len(text))
        return RewardResult(score=share, threshold=0.5, components={"letters": share})


def load_environment() -> LetterShareEnv:
    return LetterShareEnv()
