"""TextArena single-player games as rollflow async-style environments (the ``textarena`` extra).

``[env].name = "rollflow.envs.textarena:load_environment"`` with ``[env.kwargs]``
``game = "GuessTheNumber-v0"`` plays one of the library's games, multi-turn: the game's
opening observation is the first user message, each assistant reply is the action given
to the game's own ``step`` (the library's own parsing: GuessTheNumber reads the number in
``[brackets]``), the game's new observations are the next user message, and when the game
says it is done, ``close()`` gives its reward for player 0, which is the episode's reward.
The game's own reason for ending (won, out of turns, an invalid move past its allowance)
is kept in the last step's metadata; ``metrics`` hold ``invalid_move`` and ``turn_count``.

The core game is used without TextArena's LLM wrappers: each user message holds only what
is new since the last action (rollflow keeps the transcript), and the reply is passed on
as written (no brackets added), so what the model is scored on is what it wrote. Actions
are free text (``checks_tool_protocol = False``). An async-style episode carries no pass
threshold, so rollflow's ``passed`` is ``reward > 0``: a game that pays partial credit on
a loss (GuessTheNumber pays how close the last guess was) counts that as a pass; the
``won`` metric (reward >= 1, TextArena's win) is the stricter figure, in
``scores.components``. The game has no turn budget rollflow can read, so
``[rollout].max_turns`` must be set (async style); a game cut off there has reward 0.

A task is one seed: training plays seeds ``seed .. seed+num_train-1``, validation the
``num_validation`` seeds after them, so the splits never share a seed (a game with few
distinct states, such as GuessTheNumber's 20 targets, still repeats *positions* across
seeds). Seeding goes through the library's global ``random``; each ``reset`` seeds and
draws in one call on the event loop, so concurrent episodes do not disturb each other.

Before anything runs, ``load_environment`` makes the game and resets it once: a missing
library, an unknown game (with close names), a game for more players, or a library-side
failure (Wordle, Hangman and other word games download NLTK corpora at reset, which an
offline machine cannot) is one line naming ``[env].kwargs``. Verified offline here
(0.7.4: make and reset with one player): 2048, Blackjack, Countdown, Crosswords,
Cryptarithm, FifteenPuzzle, FrozenLake, GuessTheNumber, LightsOut, LogicPuzzle, Mastermind,
Minesweeper, PegJump, RushHour, Secretary, Slitherlink, Sokoban, Sudoku, ThreeCardMonte,
TowerOfHanoi (each ``-v0``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from rollflow.envs.checks import require_int
from rollflow.envs.env import AnnotatedStepResult, AsyncEnvSuite, Env
from rollflow.envs.types import Message, StepResult, Task, ToolSpec

EXTRA = "pip install 'rollflow[textarena]'"
PLAYER = 0


def _core(wrapped: Any) -> Any:
    """The game under TextArena's wrappers (each keeps the next one as ``.env``)."""
    while hasattr(wrapped, "env"):
        wrapped = wrapped.env
    return wrapped


def make_game(game: str, game_kwargs: Mapping[str, Any]) -> Any:
    """``textarena.make(game, **game_kwargs)`` unwrapped, its failures as one line."""
    try:
        import textarena
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError as exc:
        raise RuntimeError(
            f"[env].kwargs game = {game!r} needs the TextArena library, which is not installed ({exc}): {EXTRA}"
        ) from None
    if not isinstance(game, str) or game not in ENV_REGISTRY:
        close = difflib.get_close_matches(str(game), sorted(ENV_REGISTRY), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"[env].kwargs game = {game!r} is not a TextArena game; {hint}e.g. GuessTheNumber-v0, "
            "Mastermind-v0, TowerOfHanoi-v0"
        )
    try:
        return _core(textarena.make(game, **game_kwargs))
    except Exception as exc:
        raise ValueError(
            f"[env].kwargs: TextArena's {game!r} could not be made with {dict(game_kwargs)!r}: {_one_line(exc)}"
        ) from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).replace("*", " ").split())
    return f"{type(exc).__name__}: {text[:300] or '(no message)'}"


def _new_text(core: Any) -> str:
    """What the game has said to the player since it last asked (its own echoes left out)."""
    _, observations = core.get_observation()
    parts = [str(message) for sender, message, *_ in observations if sender != PLAYER]
    return "\n".join(part.strip() for part in parts if part.strip())


class TextArenaEnv(Env):
    """One episode of one TextArena game (a fresh object per episode, as async style wants)."""

    checks_tool_protocol = False  # free-text moves, read by the game itself

    def __init__(self, game: str, game_kwargs: Mapping[str, Any], system_prompt: str | None) -> None:
        self.game = game
        self.game_kwargs = dict(game_kwargs)
        self.system_prompt = system_prompt
        self._core: Any = None
        self._messages: list[Message] = []

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def reset(self, task: Task) -> list[Message]:
        self._core = make_game(self.game, self.game_kwargs)
        self._core.reset(num_players=1, seed=int(task.metadata["seed"]))
        self._messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self._messages.append({"role": "user", "content": _new_text(self._core)})
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        if self._core is None:
            raise RuntimeError("step() before reset()")
        self._messages.append(message)
        done, _ = self._core.step(str(message.get("content", "")))
        if not done:
            self._messages.append({"role": "user", "content": _new_text(self._core) or "Your move."})
            return AnnotatedStepResult(terminated=False, truncated=False, messages=list(self._messages))
        rewards, game_info = self._core.close()
        info = dict((game_info or {}).get(PLAYER, {}))
        reward = float((rewards or {}).get(PLAYER, 0.0))
        return AnnotatedStepResult(
            terminated=True,
            truncated=False,
            messages=list(self._messages),
            reward=reward,
            metrics={
                "won": float(reward >= 1.0),
                "invalid_move": float(bool(info.get("invalid_move"))),
                "turn_count": float(info.get("turn_count", 0) or 0),
            },
            metadata={"reason": str(info.get("reason", ""))},
        )


def load_environment(
    game: str = "GuessTheNumber-v0",
    num_train: int = 200,
    num_validation: int = 50,
    seed: int = 0,
    system_prompt: str | None = None,
    **game_kwargs: Any,
) -> AsyncEnvSuite:
    """TextArena's ``game`` (keywords other than these go to the game, e.g. ``max_turns``),
    one task per seed; checked by making and resetting the game once."""
    require_int("[env].kwargs num_train", num_train, minimum=1)
    require_int("[env].kwargs num_validation", num_validation, minimum=0)
    require_int("[env].kwargs seed", seed, minimum=0)
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"[env].kwargs system_prompt must be text, got {type(system_prompt).__name__}")
    probe = make_game(game, game_kwargs)
    try:
        probe.reset(num_players=1, seed=seed)
        _new_text(probe)
    except Exception as exc:
        raise ValueError(
            f"[env].kwargs game = {game!r} cannot start a one-player game here: {_one_line(exc)}"
        ) from None

    def task(game_seed: int) -> Task:
        return Task(
            prompt=f"{game} seed={game_seed}",
            metadata={"library": "textarena", "game": game, "seed": game_seed},
            id=f"textarena/{game}/seed={game_seed}",
        )

    return AsyncEnvSuite(
        tasks=tuple(task(seed + i) for i in range(num_train)),
        val_tasks=tuple(task(seed + num_train + i) for i in range(num_validation)),
        env_factory=lambda _task: TextArenaEnv(game, game_kwargs, system_prompt),
    )
