"""A step's failed episodes made loud: their tracebacks kept, a step that trained on nothing refused.

Failures are data (an episode's ``error``, a score's ``scoring_error``), so one bad episode
never sinks a batch. Three things keep that from hiding a broken environment:

- **tracebacks are kept** in the step's folder, ``errors.jsonl`` (``steps/step=N/`` or
  ``validation/step=N/``): one JSON object a line, ``{"stage", "episode_id", "task_id",
  "error", "traceback"}``, written by the rollout stage (the episode raised) and the scoring
  stage (its scorer raised). An async step's rollout lines are its admitted groups' own
  files (``async/groups/group-N.errors.jsonl``, written by the rollout workers with the
  group), copied in under the step's episode ids by its admission (``tasks/collect.py``).
  ``traceback`` is None where the error was no exception (a
  scorer that returned the wrong type). A stage writing again (a replayed chunk, a resumed
  scoring) replaces its own lines for the episodes it covers, so the file holds each
  episode's latest attempt.
- **a step whose every episode failed or overflowed the context fails the run**
  (``StepFailedError``, raised by the scoring stage before it writes ``scores.parquet``,
  so a resume after the fix scores again): its message names the most common error and
  the traceback file, or the prompt's length against ``[rollout].max_model_length``.
  Where episodes errored in the rollout itself, the error says so (``rollout_failed``) and
  the step that ran the stage discards the step's episodes (``discard_episodes``; an async
  step's admission with them: ``flows/step.py``), so the resume plays them again with the
  fixed environment. No stage deletes another stage's output.
- **each step line** says the step's reward, pass rate, failed and overflowed counts, its
  tool calls and the tool errors among them, and how many groups had reward variance
  (``step_summary``); a step where none had says plainly that it learned nothing, and what
  to try (``NOTHING_TO_LEARN``). Each validation pass gets the same line but the groups
  (``validation_summary``): nothing is trained on it.

Simplified: an overflowed episode counts as useless whatever it sampled before the
context filled; a step with any other ending in it trains and passes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rollflow.envs.types import TruncationCause
from rollflow.storage.async_groups import admission_path
from rollflow.storage.parquet import temporary_path, write_bytes_atomic
from rollflow.storage.records import EpisodeRecord, ScoreRecord
from rollflow.storage.runfolder import RunFolder

ERRORS_JSONL = "errors.jsonl"


class StepFailedError(RuntimeError):
    """Every episode of a step failed or overflowed: there is nothing to learn from it.

    ``rollout_failed``: some of its episodes errored in the rollout itself, so they teach
    nothing and a resume should play them again (the step discards them)."""

    def __init__(self, message: str, *, rollout_failed: bool = False) -> None:
        super().__init__(message)
        self.rollout_failed = rollout_failed


@dataclass(frozen=True)
class EpisodeError:
    stage: str  # "rollout" (the episode raised) or "scoring" (its scorer raised)
    episode_id: str
    task_id: str
    error: str
    traceback: str | None


def errors_path(folder: RunFolder, step: int, split: str) -> Path:
    return folder.step_dir(step, split) / ERRORS_JSONL


def read_episode_errors(path: Path) -> list[EpisodeError]:
    if not path.is_file():
        return []
    return [EpisodeError(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def keep_episode_errors(
    folder: RunFolder, step: int, split: str, stage: str, covered: Iterable[str], errors: Sequence[EpisodeError]
) -> Path | None:
    """Replace ``stage``'s lines for the ``covered`` episode ids with ``errors``; the file's
    path, or None when it has no line and never had one."""
    path = errors_path(folder, step, split)
    ids = set(covered)
    kept = [e for e in read_episode_errors(path) if not (e.stage == stage and e.episode_id in ids)]
    rows = [*kept, *errors]
    if not rows and not path.exists():
        return None
    write_bytes_atomic(_jsonl(rows), path)
    return path


def write_episode_errors(path: Path, errors: Sequence[EpisodeError]) -> None:
    """``errors`` as the whole of ``path`` (an async group's own file); no file when there are none."""
    if errors:
        write_bytes_atomic(_jsonl(errors), path)
    else:
        path.unlink(missing_ok=True)


def _jsonl(rows: Sequence[EpisodeError]) -> bytes:
    return "".join(json.dumps(asdict(e)) + "\n" for e in rows).encode()


def episode_errors(
    stage: str, failed: Iterable[tuple[EpisodeRecord, str]], tracebacks: Mapping[str, str]
) -> list[EpisodeError]:
    """One ``EpisodeError`` per (episode, error line), with the traceback kept under that line."""
    return [EpisodeError(stage, e.episode_id, e.task_id, error, tracebacks.get(error)) for e, error in failed]


# ---------------------------------------------------------------- a step with nothing to learn from


def check_step_outcome(
    episodes: Sequence[EpisodeRecord],
    records: Sequence[ScoreRecord],
    where: Path,
    max_model_length: int,
    prompt_tokens: Callable[[EpisodeRecord], int],
) -> None:
    """Raise ``StepFailedError`` when every episode failed or overflowed the context.

    ``records[i]`` scores ``episodes[i]``; ``where`` is the traceback file;
    ``prompt_tokens(episode)`` measures a prompt (called only when every episode overflowed
    before its first action).
    """
    if not episodes:
        return
    failed = [e.rollout.error or r.scoring_error for e, r in zip(episodes, records, strict=True) if r.scoring_error]
    overflowed = [
        e for e, r in zip(episodes, records, strict=True)
        if r.scoring_error is None and e.rollout.truncation_cause == TruncationCause.CONTEXT_OVERFLOW
    ]
    if len(failed) + len(overflowed) < len(episodes):
        return
    first = episodes[0]
    label = f"step {first.step}" if first.split == "train" else f"{first.split} step {first.step}"
    total = len(episodes)
    if failed and not overflowed:
        raise StepFailedError(f"{label}: all {total} episodes failed: {_commonest(failed)} (tracebacks in {where})")
    budget = f"[rollout].max_model_length is {max_model_length}"
    if not failed and all(e.rollout.turns == 0 for e in overflowed):
        raise StepFailedError(
            f"{label}: all {total} episodes overflowed the context before their first action: the prompt of "
            f"task {first.task_id} is {prompt_tokens(first)} tokens, {budget}"
        )
    if not failed:
        raise StepFailedError(f"{label}: all {total} episodes overflowed the context ({budget})")
    raise StepFailedError(
        f"{label}: no episode to learn from: {len(failed)} of {total} failed ({_commonest(failed)}; tracebacks "
        f"in {where}), the other {len(overflowed)} overflowed the context ({budget})"
    )


def discard_episodes(folder: RunFolder, step: int, split: str) -> None:
    """Take the step's episodes out of the run (renamed to a temporary, then removed), so
    a resume plays them again: episodes the rollout itself failed teach nothing. An async
    step's admission goes after them, so the resume admits again (and plays the failed
    groups again: ``tasks/collect.py``)."""
    output = folder.stage_output(step, "episodes", split)
    if output is not None:
        doomed = temporary_path(output)
        os.rename(output, doomed)  # atomic: a crash leaves a temporary, which a resume discards
        if doomed.is_dir():
            shutil.rmtree(doomed)
        else:
            doomed.unlink()
    if split == "train":
        admission_path(folder, step).unlink(missing_ok=True)


def _commonest(errors: Sequence[str]) -> str:
    counted = Counter(errors).most_common()
    error, count = counted[0]
    others = len(errors) - count
    return error if not others else f"{error} ({count} of them; the other {others}: {len(counted) - 1} other errors)"


# ---------------------------------------------------------------- the step line

NOTHING_TO_LEARN = (
    "nothing to learn: in every group all episodes scored alike, so GRPO had no advantage to follow "
    "(grad_norm 0). Try a warm start (`rollflow sft`, then its [model].adapter), partial credit in the "
    "reward (a near miss scoring above a blank), or a worked example in the prompt"
)


def step_summary(metrics: Mapping[str, float | None]) -> str:
    """``reward 0.412 pass 25% errors 0/8 overflows 1/8 tool errors 3/12 calls groups with
    reward variance 2/2`` from a training step's ``metrics.json``."""
    line = _outcome(metrics, "")
    varied = _varied_groups(metrics)
    if varied is None:
        return line
    line += f" groups with reward variance {varied[0]}/{varied[1]}"
    return line + (": nothing to learn" if varied[0] == 0 and varied[1] > 0 else "")


def step_hint(metrics: Mapping[str, float | None]) -> str | None:
    """What to try when no group of a training step had reward variance; None otherwise."""
    varied = _varied_groups(metrics)
    return NOTHING_TO_LEARN if varied is not None and varied[0] == 0 and varied[1] > 0 else None


def _varied_groups(metrics: Mapping[str, float | None]) -> tuple[int, int] | None:
    """(groups with reward variance, groups) of a training step; None for a step written
    before groups were counted."""
    groups, flat = metrics.get("episodes/groups"), metrics.get("reward/zero_variance_skip_ratio")
    if groups is None or flat is None:
        return None
    return round(groups * (1.0 - flat)), int(groups)


def validation_summary(metrics: Mapping[str, float | None]) -> str:
    """The step line's numbers for a validation pass, from its ``metrics.json`` (``val/`` keys)."""
    return _outcome(metrics, "val/")


def _outcome(metrics: Mapping[str, float | None], prefix: str) -> str:
    count = int(metrics.get(prefix + "episodes/count") or 0)

    def share(key: str) -> int:
        return round((metrics.get(prefix + key) or 0.0) * count)

    reward, passed = metrics.get(prefix + "reward/mean"), metrics.get(prefix + "reward/pass_rate")
    shown_reward = "n/a" if reward is None else f"{reward:.3f}"
    shown_pass = "n/a" if passed is None else f"{passed:.0%}"
    line = (
        f"reward {shown_reward} pass {shown_pass} errors {share('episodes/failed_ratio')}/{count} "
        f"overflows {share('episodes/context_overflow_ratio')}/{count}"
    )
    calls, errors = metrics.get(prefix + "tools/calls"), metrics.get(prefix + "tools/errors")
    if calls is not None:  # else a step written before tool calls were counted
        line += f" tool errors {int(errors or 0)}/{int(calls)} calls" if calls else " tool calls 0"
    agent_calls = metrics.get(prefix + "agent/calls")
    if agent_calls is not None:  # an agent environment: calls that restarted the sample
        line += f" agent resets {int(metrics.get(prefix + 'agent/resets') or 0)}/{int(agent_calls)} calls"
    return line + _by_env(metrics, prefix)


def _by_env(metrics: Mapping[str, float | None], prefix: str) -> str:
    """`` [tool_use_game pass 50% of 8, arith pass 25% of 4]``: a mixture's environments."""
    labels = sorted({key[len(prefix) + 4:].rsplit("/", 1)[0] for key in metrics if key.startswith(prefix + "env/")})
    parts = []
    for label in labels:
        passed, episodes = metrics.get(f"{prefix}env/{label}/pass"), metrics.get(f"{prefix}env/{label}/episodes")
        shown = "n/a" if passed is None else f"{passed:.0%}"
        parts.append(f"{label} pass {shown} of {int(episodes or 0)}")
    return f" [{', '.join(parts)}]" if parts else ""
