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
are free text (``checks_tool_protocol = False``). A pass is a win: the suite's pass
threshold is ``pass_threshold`` (1.0, TextArena's reward for a won game), so ``passed``,
pass@k and the validation pass rate count games won, while the reward keeps the game's
partial credit for a loss (GuessTheNumber pays how close the last guess was) as the
training signal; ``won`` (reward >= 1) in ``scores.components`` stays the win whatever
``pass_threshold`` says. The game has no turn budget rollflow can read, so
``[rollout].max_turns`` must be set (async style); a game cut off there has reward 0.

A task is one seed: training plays seeds ``seed .. seed+num_train-1``, validation the
``num_validation`` seeds after them, so the splits never share a seed (a game with few
distinct states, such as GuessTheNumber's 20 targets, still repeats *positions* across
seeds).

Each episode draws from its own ``random.Random``, seeded from its seed. TextArena's games
call the module-level ``random`` (``State`` reseeds it at reset; Blackjack, 2048 and
Minesweeper draw from it again in ``step``), so concurrent episodes sharing the process's
generator would deal each other's cards, and a replayed chunk or a resumed step would not see
its games again. The ``random`` name inside TextArena's modules is therefore a router
(``_RoutedRandom``): while an episode's call into the game runs, the module-level draws go
to that episode's generator, chosen by a context variable set around the call. That is
exact however episodes interleave: on one event loop the game's calls are synchronous, and
a context variable is per thread, so episodes in worker threads do not see each other's
either. Swapping the process's state in and out (``random.setstate``) would not be: any
other thread drawing during the swap would take from, and shift, the episode's stream. The
rest of the process keeps the plain ``random``, untouched by the games' reseeding.
``numpy.random`` is not routed (none of the games verified below draws from it).

Before anything runs, ``load_environment`` makes the game and resets it once: a missing
library, an unknown game (with close names), a game for more players, or a library-side
failure (Wordle, Hangman and other word games download NLTK corpora when made, which an
offline machine cannot; NLTK's own download messages are silenced so the refusal is the one
line), and a game whose module does not import on this Python (Chess) is one line naming
``[env].kwargs``. Verified offline here
(0.7.4: make and reset with one player): 2048, Blackjack, Countdown, Crosswords,
Cryptarithm, FifteenPuzzle, FrozenLake, GuessTheNumber, LightsOut, LogicPuzzle, Mastermind,
Minesweeper, PegJump, RushHour, Secretary, Slitherlink, Sokoban, Sudoku, ThreeCardMonte,
TowerOfHanoi (each ``-v0``).
"""

from __future__ import annotations

import difflib
import importlib
import io
import numbers
import random
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial
from typing import Any, TypeVar

from rollflow.envs.checks import require_int
from rollflow.envs.env import AnnotatedStepResult, AsyncEnvSuite, Env
from rollflow.envs.handle import checked_score
from rollflow.envs.types import Message, StepResult, Task, ToolSpec

EXTRA = "pip install 'rollflow[textarena]'"
PLAYER = 0
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
T = TypeVar("T")

# The module-level draws of ``random`` (``random.choice`` is the hidden shared instance's bound
# method); anything else there (``random.Random``, constants) is the module's own.
_DRAWS = frozenset(name for name, value in vars(random).items() if isinstance(getattr(value, "__self__", None), random.Random))
_EPISODE_RNG: ContextVar[random.Random | None] = ContextVar("textarena_episode_rng", default=None)
_NLTK_LOCK = threading.Lock()


class _RoutedRandom:
    """Stands in for ``random`` inside TextArena's modules: a module-level draw goes to the
    running episode's generator, or to the process's ``random`` outside an episode."""

    def __getattr__(self, name: str) -> Any:
        episode_rng = _EPISODE_RNG.get()
        if episode_rng is not None and name in _DRAWS:
            return getattr(episode_rng, name)
        return getattr(random, name)


_ROUTER = _RoutedRandom()
_routed_module_count = 0


def _route_textarena_random() -> None:
    """Point ``random`` at the router in every TextArena module imported so far (a game's
    module is imported when first made, so this runs again whenever more have been loaded)."""
    global _routed_module_count
    if len(sys.modules) == _routed_module_count:
        return
    for name, module in list(sys.modules.items()):
        if (name == "textarena" or name.startswith("textarena.")) and getattr(module, "random", None) is random:
            setattr(module, "random", _ROUTER)
    _routed_module_count = len(sys.modules)


def drawing_from(episode_rng: random.Random, call: Callable[[], T]) -> T:
    """``call()`` with TextArena's module-level ``random`` draws taken from ``episode_rng``."""
    _route_textarena_random()
    token = _EPISODE_RNG.set(episode_rng)
    try:
        return call()
    finally:
        _EPISODE_RNG.reset(token)


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
    with _quiet_nltk_downloads():
        _import_game_module(game, ENV_REGISTRY[game].entry_point)
        _route_textarena_random()  # before the game's constructor can draw
        try:
            return _core(textarena.make(game, **game_kwargs))
        except Exception as exc:
            raise ValueError(
                f"[env].kwargs: TextArena's {game!r} could not be made with {dict(game_kwargs)!r}: {_one_line(exc)}"
            ) from None


def _import_game_module(game: str, entry_point: object) -> None:
    """Import the game's module first, so that one that does not import here (Chess's
    f-strings need Python 3.12) is named as such rather than as a failed make."""
    if not isinstance(entry_point, str):
        return
    try:
        importlib.import_module(entry_point.split(":")[0])
    except (ImportError, SyntaxError) as exc:
        raise ValueError(f"[env].kwargs game = {game!r}: TextArena's game does not import on Python {PYTHON}: {_one_line(exc)}") from None


@contextmanager
def _quiet_nltk_downloads() -> Iterator[None]:
    """NLTK's downloader writes its failures to the stderr it captured at import, past any
    redirection: the word games' modules call it when made, and offline it prints several
    lines before the failure rollflow reports in one. Its messages go nowhere meanwhile."""
    nltk = sys.modules.get("nltk")  # imported by ``import textarena``
    download = getattr(nltk, "download", None)
    if nltk is None or download is None:
        yield
        return
    with _NLTK_LOCK:
        setattr(nltk, "download", partial(download, print_error_to=io.StringIO()))
        try:
            yield
        finally:
            setattr(nltk, "download", download)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).replace("*", " ").split())
    return f"{type(exc).__name__}: {text[:300] or '(no message)'}"


def _reset_and_read(core: Any, seed: int) -> str:
    """Reset the game for one player with ``seed``; its opening text."""
    core.reset(num_players=1, seed=seed)
    return _new_text(core)


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
        self._rng = random.Random()
        self._messages: list[Message] = []

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def reset(self, task: Task) -> list[Message]:
        seed = int(task.metadata["seed"])
        self._rng = random.Random(seed)
        self._core = drawing_from(self._rng, lambda: make_game(self.game, self.game_kwargs))
        opening = drawing_from(self._rng, lambda: _reset_and_read(self._core, seed))
        self._messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self._messages.append({"role": "user", "content": opening})
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        if self._core is None:
            raise RuntimeError("step() before reset()")
        self._messages.append(message)
        done, _ = drawing_from(self._rng, lambda: self._core.step(str(message.get("content", ""))))
        if not done:
            news = drawing_from(self._rng, lambda: _new_text(self._core))
            self._messages.append({"role": "user", "content": news or "Your move."})
            return AnnotatedStepResult(terminated=False, truncated=False, messages=list(self._messages))
        rewards, game_info = drawing_from(self._rng, self._core.close)
        info = dict((game_info or {}).get(PLAYER, {}))
        reward, reason = _reward_and_reason((rewards or {}).get(PLAYER, 0.0), str(info.get("reason", "")))
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
            metadata={"reason": reason},
        )


INVALID_MOVE = "Invalid Move: "  # TextArena's prefix of the reason a game lost to bad moves ends with


def _reward_and_reason(reward: object, reason: str) -> tuple[float, str]:
    """Player 0's reward and the game's reason for ending, as ``close()`` gives them.

    Countdown and Cryptarithm (0.7.4) call ``set_invalid_move(progress, message)``, but
    the library takes ``(reason, reward)``: the message lands in the reward and the
    progress, as text, in the reason. Those two are put back where the game meant them.
    """
    if isinstance(reward, numbers.Real):
        return float(reward), reason
    if not isinstance(reward, str):
        return 0.0, reason  # none given
    try:
        progress = float(reason.removeprefix(INVALID_MOVE))
    except ValueError:
        progress = 0.0  # no number to fall back on: the loss pays nothing
    return progress, f"{INVALID_MOVE}{reward}"


def load_environment(
    game: str = "GuessTheNumber-v0",
    num_train: int = 200,
    num_validation: int = 50,
    seed: int = 0,
    system_prompt: str | None = None,
    pass_threshold: float = 1.0,
    **game_kwargs: Any,
) -> AsyncEnvSuite:
    """TextArena's ``game`` (keywords other than these go to the game, e.g. ``max_turns``),
    one task per seed; checked by making and resetting the game once. An episode passes
    when its reward is at least ``pass_threshold`` (default 1.0: the game was won)."""
    require_int("[env].kwargs num_train", num_train, minimum=1)
    require_int("[env].kwargs num_validation", num_validation, minimum=0)
    require_int("[env].kwargs seed", seed, minimum=0)
    checked_score(pass_threshold, "[env].kwargs pass_threshold")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"[env].kwargs system_prompt must be text, got {type(system_prompt).__name__}")
    probe_rng = random.Random(seed)
    probe = drawing_from(probe_rng, lambda: make_game(game, game_kwargs))
    try:
        drawing_from(probe_rng, lambda: _reset_and_read(probe, seed))
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
        pass_threshold=float(pass_threshold),
    )
