"""A test environment whose reward and replies change by known amounts through kwargs.

Rescore and replay tests run a tiny pipeline on it once, then load it again with other
kwargs and check that exactly the expected episodes moved:

- the reward is the share of letters in the final reply (it varies even for a random
  tiny model's gibberish); ``threshold`` is the pass mark, so raising it flips exactly the
  episodes whose reward lies between the old mark and the new one;
- ``flat_reward``, when set, replaces every reward: every group loses its variance;
- the reply to action ``k`` (1-based) is ``"Reply k: go on."``, except at ``changed_turn``,
  where it is ``"Reply k: changed."``: a replay of the stored actions differs first there;
- ``score_delay_s`` makes each score take that long (time to kill a rescore mid-way).
"""

from __future__ import annotations

import time
from pathlib import Path

from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.types import EnvironmentEpisode, EnvironmentStepResult, Message, RewardResult, TaskExample

NUM_TURNS = 3


def reply_text(turn: int, changed: bool) -> str:
    return f"Reply {turn}: changed." if changed else f"Reply {turn}: go on."


class ChangeableEnv(EnvironmentMultiTurn):
    checks_tool_protocol = False  # free text

    def __init__(
        self, threshold: float, flat_reward: float | None, changed_turn: int | None, num_tasks: int,
        score_delay_s: float,
    ) -> None:
        self.threshold = threshold
        self.score_delay_s = score_delay_s
        self.flat_reward = flat_reward
        self.changed_turn = changed_turn
        rows = [{"input": f"Say something about the number {n}.", "id": f"say-{n}"} for n in range(num_tasks)]
        self.dataset = {"train": rows, "validation": rows[:2]}

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "user", "content": str(example.input)}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return NUM_TURNS

    def step_episode(
        self, example: TaskExample, messages: list[Message], assistant_response: str
    ) -> EnvironmentStepResult:
        turn = sum(m["role"] == "assistant" for m in messages)
        reply: Message = {"role": "user", "content": reply_text(turn, turn == self.changed_turn)}
        return EnvironmentStepResult(done=turn >= NUM_TURNS, messages=(reply,))

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        time.sleep(self.score_delay_s)
        text = episode.response_text
        share = sum(c.isalpha() for c in text) / max(1, len(text))
        reward = share if self.flat_reward is None else self.flat_reward
        return RewardResult(score=reward, threshold=self.threshold, components={"letters": share})


def load_environment(
    threshold: float = 0.5, flat_reward: float | None = None, changed_turn: int | None = None,
    num_tasks: int = 8, score_delay_s: float = 0.0,
) -> ChangeableEnv:
    return ChangeableEnv(threshold, flat_reward, changed_turn, num_tasks, score_delay_s)


def changeable_run_config(dest: Path, model_dir: Path) -> Path:
    """configs/tiny.toml on ``model_dir`` and this environment: 1 step of 2 tasks x 2
    episodes, validated at step 0 and 1, 3 turns of at most 8 tokens."""
    from dataclasses import replace

    from tiny_run import tiny_config_at

    from rollflow.config.run import config_to_toml, load_config

    path = tiny_config_at(dest, model_dir)
    config = load_config(path)
    config = replace(
        config,
        env=replace(config.env, name="rescore_env:load_environment", kwargs={"num_tasks": 4}),
        rollout=replace(config.rollout, max_turns=NUM_TURNS, max_completion_tokens=8),
        train=replace(config.train, num_steps=1),
        validation=replace(config.validation, validation_interval=1),
        tracking=replace(config.tracking, enabled=False),
    )
    path.write_text(config_to_toml(config))
    return path


def make_changeable_run(dest: Path, model_dir: Path) -> Path:
    """A real tiny run on this environment (train_flow; needs the Prefect harness)."""
    from rollflow.flows.train import train_flow

    path = changeable_run_config(dest, model_dir)
    return Path(train_flow(config_path=str(path), run_dir=str(dest / "run")))
