"""Scoring stage: rewards, penalties and group-relative advantages (``scores.parquet``).

The environment scores each group once (``handle.score(item, rollouts)``: hook style
batches ``score_episodes`` over the group, async style takes the terminal step's reward).
Parse-failed episodes are not shown to it: their reward is ``failed_parse_reward`` whatever
a scorer would say, and a scorer written for well-formed transcripts (the reference's
refund agent ``json.loads`` every ``<tool_call>`` block) raises on exactly those, which
would drop them from the baseline, or, with a group ``score_episodes``, error the group.
They get ``PARSE_FAILURE_SCORE`` (reward 0.0, no threshold) in the scores' ``reward``.

Then, per episode:

1. **its ending**, one of six (``ending_of``): ``error`` when the rollout raised;
   ``parse_failure`` when it ended so, whatever the scorer said, errors included; else
   ``error`` when the scorer raised; else ``terminated`` or its truncation cause.
2. **its final reward**: ``shape_reward(ending, env_reward, context_tokens, settings)``,
   one pure function reading this table (``SHAPING_RULES``), one row per ending:

   ================  =======================  ================  ========  ======
   ending            reward                   overlong penalty  baseline  passes
   ================  =======================  ================  ========  ======
   terminated        the environment's        none              counted   if env
   env               the environment's        none              counted   if env
   max_turns         the environment's        by length         counted   if env
   context_overflow  the environment's        full (``-f``)     counted   if env
   parse_failure     ``failed_parse_reward``  none              counted   never
   error             0.0                      none              left out  never
   ================  =======================  ================  ========  ======

   ("if env": the environment's reward against its threshold; see 3.)

   **Soft overlong penalty** (DAPO's soft overlong punishment, applied as the reference
   docs say: only to the two length-budget truncations). With ``L`` the context length the
   episode ended at (``rollout.context_tokens``: the count restarts where the chat template
   re-rendered the prompt, so rewritten history is not counted twice), ``L_max =
   max_model_length``, a buffer ``B`` and ``f = overlong_penalty_factor``::

       penalty = -f * clip((L - (L_max - B)) / B, 0, 1)

   0 until the context enters the last ``B`` tokens of the budget, then linear to ``-f``
   at the budget. A ``context_overflow`` episode spent the budget by definition: ``-f``.
   ``B = overlong_buffer_tokens``, by default ``L_max // 5``, about DAPO's setting (a
   4,096-token buffer for 20,480-token responses): only an episode that came close to the
   budget pays. A buffer of the whole budget makes every ``max_turns`` episode pay
   ``f * L / L_max``, half the factor at half the budget, which
   swamps reward terms of a few tenths: the policy learns to be short, not to be right.
3. **passed** is the environment's verdict, not the shaped reward's: its reward ``>=`` its
   threshold (no threshold: ``> 0``), where the table says an ending can pass at all. So
   ``reward/pass_rate`` does not move with the overlong penalty or ``failed_parse_reward``.
4. **group baseline.** ``mean`` and ``std`` (population, ddof 0) are over the counted
   episodes' final rewards; ``advantage = final - mean``, divided by ``std + 1e-6`` when
   ``scale_advantages_by_std``. A group whose counted rewards are all equal (or that has
   fewer than two) is marked ``zero_variance`` and gets advantage 0.
5. **trained?** Never a validation episode; not when left out of the baseline; not when
   truncated (any cause) under ``overlong_masking``, though its reward stayed in the
   baseline; not in a zero-variance group under ``dynamic_sampling``; not in a group with
   variance beyond the first ``batch_size`` of them (by group number) of a backfilled step
   (``[rollout].backfill_rounds``: a backfill round that found more than were missing).

The pure pieces (the shaping table and function, the group baseline, the environment's
scores per group, and ``score_episodes_to_records``, the records this stage writes, which
``rollflow rescore`` computes too) live in ``tasks/shaping.py``, where the rollout stage's backfill asks
the same question of its groups.

The stage keeps each scorer's traceback in the step's ``errors.jsonl`` and refuses a step
whose every episode failed or overflowed the context (``StepFailedError``, before
``scores.parquet`` is written, so a resume scores again): ``tasks/step_health.py``. Where
episodes failed in the rollout, the error says so and the step discards them
(``flows/step.py``): this stage never deletes the rollout's output.

Simplified on purpose: dynamic sampling alone only skips zero-variance groups (a step
trains on fewer groups); refilling the batch as DAPO does is the rollout stage's
``backfill_rounds``, which plays the extra groups before this stage sees any. The
overlong length counts context tokens of scripted, tokenless episodes as 0. A group
``score_episodes`` sees the group without its parse failures.
"""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path
from typing import cast

from rollflow.config.run import RunConfig
from rollflow.envs.handle import EnvironmentHandle
from rollflow.envs.runner import load_environment_handle
from rollflow.envs.tracebacks import keeping_tracebacks
from rollflow.envs.types import Split
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.schemas import score_records_to_table, table_to_episode_records
from rollflow.storage.stage_outputs import locate_output, read_output, write_output
from rollflow.tasks.prompts import prompt_tokens
from rollflow.tasks.shaping import ScoringSettings, score_episodes_to_records, score_groups
from rollflow.tasks.step_health import (
    StepFailedError,
    check_step_outcome,
    episode_errors,
    errors_path,
    keep_episode_errors,
)


# ---------------------------------------------------------------- the stage


def score_stage(
    config: RunConfig, episodes_path: Path, out: Path, handle: EnvironmentHandle | None = None
) -> Path:
    """Score a step's episodes and write ``out`` (its ``scores.parquet``) atomically.

    ``handle`` defaults to ``config.env``'s environment; the Python API passes the one it
    built from ``env_factory``. The step's ``errors.jsonl`` gains the scorer's failures.
    """
    where = locate_output(out)
    folder, step, split = where.folder, where.step, where.split
    episodes = table_to_episode_records(read_output(episodes_path))
    if handle is None:
        handle = load_environment_handle(config.env.name, config.env.kwargs)
    with keeping_tracebacks() as tracebacks:
        env_scores = asyncio.run(score_groups(handle, split, episodes, config.rollout.concurrency))
    records = score_episodes_to_records(episodes, env_scores, ScoringSettings.from_config(config))
    scorer_failed = [
        (e, r.scoring_error) for e, r in zip(episodes, records, strict=True)
        if r.scoring_error is not None and e.rollout.error is None  # the rollout kept its own
    ]
    errors = episode_errors("scoring", scorer_failed, tracebacks)
    keep_episode_errors(folder, step, split, "scoring", [e.episode_id for e in episodes], errors)
    measure = partial(_prompt_tokens, config, handle, split)
    try:
        check_step_outcome(episodes, records, errors_path(folder, step, split), config.rollout.max_model_length, measure)
    except StepFailedError as failed:  # what to do with the episodes is the step's call (flows/step.py)
        failed.rollout_failed = any(e.rollout.error for e in episodes)
        raise
    return write_output(score_records_to_table(records), out)


def _prompt_tokens(config: RunConfig, handle: EnvironmentHandle, split: str, episode: EpisodeRecord) -> int:
    items = {item.task_id: item for item in handle.tasks(cast(Split, split))}
    return prompt_tokens(config, handle, items[episode.task_id])


