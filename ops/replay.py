"""Replay a stored run's recorded actions through a changed environment: no model.

Each stored episode's assistant messages are, in order, the exact texts its policy sampled
(``ParsedAction.to_message`` keeps the raw text as the content), so a scripted policy that
says them again (``replay_actions``) drives the changed environment through the same one
episode loop the rollout uses, under the run's own turn limit for that split. The replayed transcript is
then compared with the stored one, message by message (both in their stored form,
``storage/nested.py``): ``matched`` when every message is equal; otherwise the first
message that differs, the turn it belongs to (``first_diff_turn``: the number of actions
before it, so 0 is the opening messages and ``k`` the environment's reply to action ``k``)
and both texts (null on the side whose transcript had already ended).

Endings follow the stored episode: its last action is replayed with ``finish_reason =
"context"`` when the episode ended ``context_overflow`` (so the environment is not stepped
with it, as in the rollout), and a replay that runs past the recorded actions stops the
same way with no text, which leaves no message. The ending of both sides is recorded
(``old_ending``, ``new_ending``): a replay can match every message and still end
differently (the environment now says ``done`` where it used to cut the episode).

Written like a rescore (``ops/rescore.py``): one file per (split, step) under
``replays/<name>/``, resumable, refused on a name used with other arguments.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pyarrow as pa

from rollflow.envs.agent import PolicyAction
from rollflow.envs.episode import EpisodeRollout
from rollflow.envs.handle import EnvironmentHandle, EpisodeLimits, TaskItem
from rollflow.envs.scripted import ScriptedPolicy
from rollflow.envs.types import Message, Split, TruncationCause
from rollflow.storage.derived import REPLAY_SCHEMA
from rollflow.storage.nested import message_to_row, row_to_message
from rollflow.storage.records import SCHEMA_VERSION, EpisodeRecord
from rollflow.ops.rescore import DerivedSummary, StoredRun, derive_run
from rollflow.tasks.schedule import episode_limits


@dataclass(frozen=True)
class TranscriptDifference:
    """The first message where two transcripts differ; None fields: that side had ended."""

    message: int
    turn: int
    old: Message | None
    new: Message | None


def replay_actions(rollout: EpisodeRollout) -> ScriptedPolicy:
    """A policy that says the stored episode's assistant texts again, in order."""
    texts = [str(m.get("content") or "") for m in rollout.messages if m.get("role") == "assistant"]
    overflowed = rollout.truncation_cause == TruncationCause.CONTEXT_OVERFLOW

    def script(messages: Sequence[Message], turn: int) -> PolicyAction:
        if turn >= len(texts):
            return PolicyAction(text="", finish_reason="context")  # out of recorded actions
        last = turn == len(texts) - 1
        return PolicyAction(text=texts[turn], finish_reason="context" if last and overflowed else "stop")

    return ScriptedPolicy(script)


def stored_form(messages: Sequence[Message], where: str) -> list[Message]:
    """Messages as they read back from Parquet, so that old and new compare like for like."""
    return [row_to_message(message_to_row(m, f"{where} message {i}")) for i, m in enumerate(messages)]


def first_difference(old: Sequence[Message], new: Sequence[Message]) -> TranscriptDifference | None:
    for index in range(max(len(old), len(new))):
        before = old[index] if index < len(old) else None
        after = new[index] if index < len(new) else None
        if before != after:
            turn = sum(m.get("role") == "assistant" for m in old[:index])
            return TranscriptDifference(index, turn, before, after)
    return None


def ending(rollout: EpisodeRollout) -> str:
    if rollout.error is not None:
        return "error"
    return "terminated" if rollout.terminated else str(rollout.truncation_cause)


def _text(message: Message | None) -> str | None:
    return None if message is None else message.get("content")


def replay_row(name: str, episode: EpisodeRecord, replayed: EpisodeRollout) -> dict[str, Any]:
    old = list(episode.rollout.messages)
    new = stored_form(replayed.messages, f"replay of {episode.episode_id}")
    diff = first_difference(old, new)
    return {
        "replay": name, "schema_version": SCHEMA_VERSION, "run_id": episode.run_id,
        "step": episode.step, "split": episode.split, "task_id": episode.task_id,
        "group_id": episode.group_id, "episode_id": episode.episode_id, "matched": diff is None,
        "first_diff_turn": None if diff is None else diff.turn,
        "first_diff_message": None if diff is None else diff.message,
        "old_role": None if diff is None or diff.old is None else diff.old.get("role"),
        "old_text": None if diff is None else _text(diff.old),
        "new_role": None if diff is None or diff.new is None else diff.new.get("role"),
        "new_text": None if diff is None else _text(diff.new),
        "old_turns": episode.rollout.turns, "new_turns": replayed.turns,
        "old_ending": ending(episode.rollout), "new_ending": ending(replayed),
        "replay_error": replayed.error,
    }  # fmt: skip


async def replay_episodes(
    handle: EnvironmentHandle, split: str, episodes: Sequence[EpisodeRecord],
    limits: EpisodeLimits, concurrency: int,
) -> list[EpisodeRollout]:
    """Each episode's actions played again through ``handle``, at most ``concurrency`` at once."""
    items = {item.task_id: item for item in handle.tasks(cast(Split, split))}
    bound = asyncio.Semaphore(concurrency)

    async def replay_one(episode: EpisodeRecord) -> EpisodeRollout:
        item: TaskItem = items[episode.task_id]  # load_changed_environment checked every id
        async with bound:
            return await handle.play(item, replay_actions(episode.rollout), limits)

    return list(await asyncio.gather(*(replay_one(e) for e in episodes)))


def replay_table(
    handle: EnvironmentHandle, run: StoredRun, name: str, split: str, episodes: Sequence[EpisodeRecord]
) -> pa.Table:
    limits = episode_limits(run.config, split, handle.style)  # the rollout stage's own turn cap
    replayed = asyncio.run(replay_episodes(handle, split, episodes, limits, run.config.rollout.concurrency))
    rows = [replay_row(name, e, r) for e, r in zip(episodes, replayed, strict=True)]
    return pa.Table.from_pylist(rows, schema=REPLAY_SCHEMA)


def replay_run(
    run_dir: Path | str, env: str, kwargs: Mapping[str, Any] | None = None,
    name: str | None = None, where: str | None = None,
) -> DerivedSummary:
    """Replay the run at ``run_dir`` through ``env(**kwargs)``; see the module docstring."""
    return derive_run("replays", replay_table, run_dir, env, kwargs, name, where)
