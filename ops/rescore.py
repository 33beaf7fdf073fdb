"""Rescore a stored run with a changed environment: no model, no generation.

``rescore_run`` reads every stored episode (train and validation, every step; or those a
``--where`` filter over the ``episodes`` view keeps), scores it with the changed
environment exactly as the scoring stage does (``score_groups``: one ``handle.score`` per
group, parse failures never shown to the scorer; then ``score_episodes_to_records``: the
run's own shaping settings, group baselines and advantages), and writes the rows to
``rescores/<name>/<split>/step=NNNNNN.parquet`` beside the run (``storage/derived.py``).
The SQL view ``rescores`` holds them; join it to ``scores`` or ``episodes`` on
``run_id, episode_id``.

Resuming: one file per (split, step), written atomically, so a killed rescore run again
with the same arguments skips the files it finished and writes the rest; a name already
used with other arguments, or already complete, is refused (``DerivedOutput.open``), and
so is a second command on a name while the first still writes it (``DerivedBusyError``).

Refused before anything is written: a folder that is not a run, an environment whose tasks
do not include every stored episode's task id (per split), a malformed ``--where``.

Simplified: with a ``--where`` filter, group baselines are over the group members the
filter keeps (filter whole groups, e.g. on ``group_id``, to get the advantages training
would have seen). Episodes are rescored as stored: an episode that errored in its rollout
stays an error whatever the new scorer says.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pyarrow as pa

from rollflow.config.run import RunConfig, load_config
from rollflow.envs.handle import EnvironmentHandle
from rollflow.envs.runner import load_environment_handle
from rollflow.envs.types import Split
from rollflow.storage.derived import RESCORE_SCHEMA, DerivedOutput
from rollflow.storage.query import QueryError, open_run_sql, run_query
from rollflow.storage.records import EpisodeRecord
from rollflow.storage.runfolder import SPLIT_DIRS, RunFolder
from rollflow.storage.runs import looks_like_run
from rollflow.storage.schemas import score_records_to_table, table_to_episode_records
from rollflow.tasks.shaping import ScoringSettings, score_episodes_to_records, score_groups


class RescoreError(ValueError):
    """A rescore or replay that cannot start; the message names the folder, task or filter."""


@dataclass(frozen=True)
class StoredRun:
    """A run folder to rescore or replay, its frozen config and the episodes chosen."""

    folder: RunFolder
    config: RunConfig
    chosen_ids: frozenset[str]  # episode ids the filter keeps (every one without a filter)
    task_ids: Mapping[str, frozenset[str]]  # split -> task ids of the chosen episodes

    def chunks(self) -> list[tuple[str, int]]:
        """Every (split, step) with complete episodes, train first, steps ascending."""
        return [
            (split, step)
            for split in SPLIT_DIRS
            for step in self.folder.steps(split)
            if self.folder.is_complete(step, "episodes", split)
        ]

    def chosen_episodes(self, split: str, step: int) -> list[EpisodeRecord]:
        episodes = table_to_episode_records(self.folder.read_stage(step, "episodes", split))
        return [e for e in episodes if e.episode_id in self.chosen_ids]


@dataclass(frozen=True)
class DerivedSummary:
    """What one rescore or replay command did."""

    name: str
    root: Path
    chunks_written: int
    chunks_skipped: int  # already written by an earlier, interrupted command
    rows: int  # rows written by this command


def open_stored_run(run_dir: Path | str, where: str | None = None) -> StoredRun:
    """The run at ``run_dir`` with the episodes ``where`` keeps; refuses a non-run folder."""
    path = Path(run_dir)
    if not looks_like_run(path):
        raise RescoreError(f"{path}: not a run folder (no config.toml, steps/, validation/ or checkpoints/)")
    folder = RunFolder(path)
    if not folder.config_path.exists():
        raise RescoreError(f"{path}: no config.toml, so no scoring settings to rescore with")
    filter_sql = "true" if where is None else f"({where})"
    con = open_run_sql([path])
    try:
        _, rows = run_query(con, f"SELECT split, task_id, episode_id FROM episodes WHERE {filter_sql}")
    except QueryError as exc:
        raise RescoreError(f"--where {where!r} over the episodes view of {path}: {exc}") from exc
    finally:
        con.close()
    task_ids: dict[str, set[str]] = {}
    for split, task_id, _ in rows:
        task_ids.setdefault(split, set()).add(task_id)
    return StoredRun(
        folder=folder,
        config=load_config(folder.config_path, frozen=True),
        chosen_ids=frozenset(r[2] for r in rows),
        task_ids={s: frozenset(ids) for s, ids in task_ids.items()},
    )


def load_changed_environment(
    run: StoredRun, env: str, kwargs: Mapping[str, Any] | None
) -> EnvironmentHandle:
    """Load ``env(**kwargs)`` and check it has every chosen episode's task, split by split."""
    handle = load_environment_handle(env, dict(kwargs or {}))
    for split, stored in sorted(run.task_ids.items()):
        offered = {item.task_id for item in handle.tasks(cast(Split, split))}
        missing = sorted(stored - offered)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            shown = ", ".join(repr(t) for t in missing[:5]) + more
            raise RescoreError(
                f"{env} with kwargs {json.dumps(dict(kwargs or {}))} does not match run "
                f"{run.folder.run_id}: its {split} tasks lack {len(missing)} of the run's "
                f"{len(stored)} task ids ({shown})"
            )
    return handle


def output_manifest(run: StoredRun, env: str, kwargs: Mapping[str, Any] | None, where: str | None) -> dict[str, Any]:
    return {"run_id": run.folder.run_id, "env": env, "kwargs": dict(kwargs or {}), "where": where}


def default_name(manifest: Mapping[str, Any]) -> str:
    """``<env function's module>-<hash of env, kwargs and filter>``: the same command
    gives the same name, so running it again resumes it."""
    module = str(manifest["env"]).split(":")[0].rsplit(".", 1)[-1]
    digest = hashlib.sha256(json.dumps(dict(manifest), sort_keys=True).encode()).hexdigest()[:8]
    return f"{module}-{digest}"


ChunkTable = Callable[[str, int, Sequence[EpisodeRecord]], pa.Table]


def write_chunks(run: StoredRun, output: DerivedOutput, make_table: ChunkTable) -> DerivedSummary:
    """``make_table(split, step, episodes)`` for each chunk not yet written, then seal; under
    the name's lock, which ``DerivedOutput.open`` holds."""
    written = skipped = rows = 0
    for split, step in run.chunks():
        if output.chunk_path(split, step).exists():
            skipped += 1
            continue
        episodes = run.chosen_episodes(split, step)
        if not episodes:
            continue
        table = make_table(split, step, episodes)
        output.write_chunk(table, split, step)
        written += 1
        rows += table.num_rows
    output.seal()
    return DerivedSummary(output.name, output.root, written, skipped, rows)


def rescore_table(
    handle: EnvironmentHandle, run: StoredRun, name: str, split: str, episodes: Sequence[EpisodeRecord]
) -> pa.Table:
    """The rescore rows of one chunk: scored and shaped as the scoring stage does."""
    env_scores = asyncio.run(score_groups(handle, split, episodes, run.config.rollout.concurrency))
    records = score_episodes_to_records(episodes, env_scores, ScoringSettings.from_config(run.config))
    table = score_records_to_table(records)
    table = table.add_column(0, "rescore", pa.array([name] * table.num_rows, pa.string()))
    return table.replace_schema_metadata(RESCORE_SCHEMA.metadata)


def rescore_run(
    run_dir: Path | str, env: str, kwargs: Mapping[str, Any] | None = None,
    name: str | None = None, where: str | None = None,
) -> DerivedSummary:
    """Rescore the run at ``run_dir`` with ``env(**kwargs)``; see the module docstring."""
    return derive_run("rescores", rescore_table, run_dir, env, kwargs, name, where)


# (changed env, run, output name, split, episodes) -> the chunk's rows
ChunkMaker = Callable[[EnvironmentHandle, StoredRun, str, str, Sequence[EpisodeRecord]], pa.Table]


def derive_run(
    kind: str, make_table: ChunkMaker, run_dir: Path | str, env: str,
    kwargs: Mapping[str, Any] | None, name: str | None, where: str | None,
) -> DerivedSummary:
    """Open the run and ``env(**kwargs)``, then write the ``kind`` chunks (``rescores``,
    ``replays``) that ``make_table`` gives and the output does not hold yet."""
    run = open_stored_run(run_dir, where)
    handle = load_changed_environment(run, env, kwargs)
    manifest = output_manifest(run, env, kwargs, where)
    name = name or default_name(manifest)
    with DerivedOutput.open(run.folder, kind, name, manifest) as output:  # the name's lock, to the seal
        return write_chunks(run, output, lambda split, step, episodes: make_table(handle, run, name, split, episodes))
