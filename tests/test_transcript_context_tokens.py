"""A transcript's token line after the chat template re-rendered the prompt (issue 13):
the final context and its parts add up, and the tokens processed are said apart."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rollflow.envs.episode import ActionTokens
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import episode_records_to_table
from rollflow.storage.synthetic import synthetic_episode
from rollflow.storage.transcript import render_episode


def test_a_rerendered_episode_shows_its_final_context_and_what_it_processed(tmp_path: Path) -> None:
    first = ActionTokens(tuple(range(30)), False, (1, 2, 3, 4), (-0.5,) * 4, "stop")
    rerendered = ActionTokens(tuple(range(40)), True, (5, 6), (-0.5,) * 2, "stop")  # the whole prompt again
    base = synthetic_episode("run-a", 0, 0, 0)
    record = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, actions=(first, rerendered)))
    folder = RunFolder(tmp_path / "run-a")
    folder.write_stage(episode_records_to_table([record]), 0, "episodes")
    header = render_episode(folder.root, record.episode_id).splitlines()[2]
    assert "2 turns · 42 tokens (40 context + 2 sampled; 6 sampled in all, 76 processed)" in header
