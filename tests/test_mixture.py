"""Several environments in one run (``[[env.mixture]]``, ``envs/mixture_handle.py``): the
config form and its refusals, the weighted per-step draw (``tasks/schedule.py``) and its
resume, the handle's routing and per-member overrides, the ``env`` column and the
per-environment metrics; and two GRPO steps of the tiny model on a mixture of a hook-style
and an async-style environment, killed in step 1's rollout and resumed."""

from __future__ import annotations

import asyncio
import json
import tomllib
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from rollflow.config.parsing import ConfigError
from rollflow.config.run import EnvConfig, config_to_toml, load_config, parse_config
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.mixture_handle import MIXTURE_SPEC, MixtureHandle, strata
from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle
from rollflow.envs.scripted import ScriptedPolicy
from rollflow.tasks.schedule import (
    backfill_step_tasks,
    draw_step_tasks,
    select_train_tasks,
    stratum_counts,
)

REPO = Path(__file__).resolve().parent.parent
LETTERS = {"name": "varied_reward_env:load_environment", "weight": 2, "label": "letters"}
ASYNC = {"name": "rollflow.envs.starters.async_style:load_environment", "kwargs": {"num_tasks": 10},
         "label": "sums", "max_turns": 1, "max_completion_tokens": 8}  # fmt: skip


def mixture_config(*members: dict[str, object]) -> EnvConfig:
    return parse_config({"env": {"mixture": list(members)}}).env


def test_mixture_tables_become_one_environment_that_round_trips_through_the_frozen_config() -> None:
    text = """
[[env.mixture]]
name = "varied_reward_env:load_environment"
weight = 2
[[env.mixture]]
name = "rollflow.envs.starters.async_style:load_environment"
kwargs = { num_tasks = 10 }
max_turns = 1
"""
    config = parse_config(tomllib.loads(text))
    assert config.env.name == MIXTURE_SPEC
    assert [(m.label, m.weight, m.max_turns) for m in config.env.members] == [
        ("varied_reward_env", 2.0, None), ("async_style", 1.0, 1)]  # fmt: skip
    assert parse_config(tomllib.loads(config_to_toml(config))) == config  # what a run folder keeps
    single = parse_config({})
    assert [(m.label, m.weight) for m in single.env.members] == [("tool_use_game", 1.0)]


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"name": "varied_reward_env:load_environment", "mixture": [LETTERS]}, "either name/kwargs .* or"),
        ({"mixture": []}, "non-empty list of tables"),
        ({"mixture": [LETTERS, dict(LETTERS, weight=1)]}, "#1 and #2 share the label 'letters'"),
        ({"mixture": [dict(LETTERS, weight=0)]}, r"#1: weight must be a positive number, got 0"),
        ({"mixture": [dict(LETTERS, wieght=1)]}, "unknown key 'wieght' \\(did you mean 'weight'\\?\\)"),
        ({"mixture": [dict(LETTERS, name="no_colon")]}, "#1: name must be 'module:function'"),
        ({"mixture": [dict(LETTERS, max_turns=0)]}, "#1: max_turns must be a positive integer"),
        ({"mixture": [dict(LETTERS, label="a/b")]}, "label must be letters"),
    ],
    ids=["both-forms", "empty", "same-label", "zero-weight", "typo", "bad-name", "bad-turns", "bad-label"],
)
def test_a_bad_mixture_is_refused_in_one_line_naming_the_member(env: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_config({"env": env})


def test_a_member_that_cannot_load_is_named() -> None:
    env = mixture_config(LETTERS, {"name": "varied_reward_env:no_such_loader", "label": "broken"})
    with pytest.raises(EnvironmentLoadError, match="^mixture member 'broken': module 'varied_reward_env' has no"):
        load_environment_handle(env.name, env.kwargs)


def test_counts_are_the_floor_or_ceiling_of_each_share_and_exact_on_average() -> None:
    weights = [2.0, 1.0, 1.0]
    totals = Counter[int]()
    for seed in range(4000):
        counts = stratum_counts(weights, 3, seed)
        assert sum(counts) == 3 and counts[0] in (1, 2) and all(c in (0, 1) for c in counts[1:])
        totals.update(dict(enumerate(counts)))
    assert [totals[i] / 4000 for i in range(3)] == pytest.approx([1.5, 0.75, 0.75], abs=0.03)
    assert stratum_counts([1.0], 5, 0) == [5]


def test_one_environment_draws_exactly_what_a_run_before_mixtures_drew() -> None:
    handle = load_environment_handle("varied_reward_env:load_environment")
    items = handle.tasks("train")
    (stratum,) = strata(handle, "train", "letters")
    for step in range(6):
        drawn = draw_step_tasks([stratum], step, 3, seed=7)
        assert [i.task_id for i in drawn] == [i.task_id for i in select_train_tasks(items, step, 3, 7)]
        assert {i.env for i in drawn} == {"letters"}


def test_each_member_walks_its_own_epochs_and_a_resumed_step_draws_the_same() -> None:
    env = mixture_config(LETTERS, ASYNC)
    handle = load_environment_handle(env.name, env.kwargs)
    assert isinstance(handle, MixtureHandle)
    layers = handle.strata("train")
    steps = [draw_step_tasks(layers, step, 3, seed=0) for step in range(16)]
    letters = [i.task_id for step in steps for i in step if i.env == "letters"]
    # the letters member's tasks come epoch by epoch: every one of its 8 before any repeats
    assert len(set(letters[:8])) == 8 and all(t.startswith("letters/") for t in letters)
    assert sum(len(s) for s in steps) == 48 and len(letters) == 32  # 2 : 1 of 3 is exactly 2 and 1
    # a fresh process (no cached positions) draws step 11 the same
    from rollflow.tasks import schedule

    schedule._POSITIONS.clear()
    assert [i.task_id for i in draw_step_tasks(layers, 11, 3, seed=0)] == [i.task_id for i in steps[11]]
    fresh = backfill_step_tasks(layers, {i.task_id for i in steps[0]}, 4, seed=0, step=0, round_=1)
    assert len(fresh) == 4 and not {i.task_id for i in fresh} & {i.task_id for i in steps[0]}


def test_episodes_go_to_their_member_with_its_own_turn_and_token_caps() -> None:
    env = mixture_config(LETTERS, ASYNC)
    handle = load_environment_handle(env.name, env.kwargs)
    assert handle.style == "hook"  # the async member has its own max_turns: no run-wide cap needed
    seen_caps: list[int] = []

    class CapProbe(ScriptedPolicy):
        def open_session(self, tool_specs):  # noqa: ANN001, ANN202
            from rollflow.envs.agent import capped_completion

            seen_caps.append(capped_completion(256))
            return super().open_session(tool_specs)

    policy = CapProbe(lambda messages, turn: "letters only here")
    by_env = {item.env: item for item in handle.tasks("train")}
    letters = asyncio.run(handle.play(by_env["letters"], policy, EpisodeLimits(max_turns=5)))
    sums = asyncio.run(handle.play(by_env["sums"], policy, EpisodeLimits(max_turns=5)))
    assert letters.turns == 2 and sums.turns == 1  # the game's own 2; the member's cap of 1
    assert seen_caps == [256, 8]
    (score,) = asyncio.run(handle.score(by_env["letters"], [letters]))
    assert score.reward == pytest.approx(sum(c.isalpha() for c in "letters only here") / 17)
    async_only = mixture_config(LETTERS, {k: v for k, v in ASYNC.items() if k != "max_turns"})
    assert load_environment_handle(async_only.name, async_only.kwargs).style == "async"  # needs [rollout].max_turns


# ---------------------------------------------------------------- two steps on the tiny model


def crash_once(monkeypatch: pytest.MonkeyPatch, stage: str, step: int) -> None:
    import rollflow.flows.step as step_module
    from rollflow.storage.stage_outputs import locate_output

    real: Callable[..., Path] = getattr(step_module, stage)

    def crashing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        steps = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]  # rollout_stage's step
        steps += [locate_output(a).step for a in args if isinstance(a, Path) and "step=" in str(a)]
        if step in steps[:1]:
            raise RuntimeError(f"{stage} died at step {step}")
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, stage, crashing)


@pytest.mark.usefixtures("prefect_harness")
def test_two_steps_on_a_mixture_resumed_after_a_crash(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollflow.flows.train import train_flow
    from rollflow.storage.query import open_run_sql, run_query
    from rollflow.storage.runfolder import RunFolder

    config = load_config(REPO / "configs" / "tiny.toml")
    config = replace(
        config,
        model=replace(config.model, path=str(tiny_model_dir)),
        env=mixture_config(LETTERS, ASYNC),
        rollout=replace(config.rollout, batch_size=3, max_turns=None),
        validation=replace(config.validation, num_tasks=1),
        storage=replace(config.storage, runs_dir=str(tmp_path / "runs")),
        tracking=replace(config.tracking, enabled=False),
    )
    path = tmp_path / "mixture.toml"
    path.write_text(config_to_toml(config))
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        crash_once(patch, "rollout_stage", 1)
        with pytest.raises(RuntimeError, match="rollout_stage died at step 1"):
            train_flow(config_path=str(path), run_dir=str(run_dir))
    from rollflow.tasks import schedule

    schedule._POSITIONS.clear()  # the resume draws step 1 afresh, as a new process would
    train_flow(run_dir=str(run_dir))

    con = open_run_sql([run_dir])
    _, groups = run_query(con, """
        SELECT e.step, e.group_id, list(DISTINCT e.env), list(DISTINCT s.env), any_value(e.task_id),
               max(e.turns), max(len(e.actions[1].token_ids))
        FROM episodes e JOIN scores s USING (episode_id) WHERE e.split = 'train'
        GROUP BY e.step, e.group_id ORDER BY ALL""")
    _, views = run_query(con, "SELECT DISTINCT env FROM env_pass_at_k WHERE split = 'validation' ORDER BY env")
    _, samples = run_query(con, "SELECT count(*) FROM samples s JOIN episodes e USING (run_id, step, episode_id) "
                                "WHERE s.env IS DISTINCT FROM e.env")
    con.close()
    handle = load_environment_handle(config.env.name, config.env.kwargs)
    assert isinstance(handle, MixtureHandle)
    for step in (0, 1):
        rows = [g for g in groups if g[0] == step]
        expected = draw_step_tasks(handle.strata("train"), step, 3, config.train.seed)
        assert sorted(r[4] for r in rows) == sorted(i.task_id for i in expected)  # the resumed step too
        for _, _, episode_envs, score_envs, task_id, turns, tokens in rows:
            assert episode_envs == score_envs == [task_id.split("/")[0]]  # a group never mixes
            if episode_envs == ["sums"]:
                assert turns == 1 and tokens <= 8  # the member's overrides
    assert views == [("letters",), ("sums",)] and samples == [(0,)]
    metrics = json.loads((RunFolder(run_dir).step_dir(1) / "metrics.json").read_text())
    envs = {g[2][0] for g in groups if g[0] == 1}
    for label in envs:
        assert {f"env/{label}/{k}" for k in ("reward", "pass", "zero_variance", "episodes")} <= set(metrics)
    assert sum(metrics[f"env/{label}/episodes"] for label in envs) == metrics["episodes/count"]


def test_preflight_checks_every_member_and_refuses_a_cap_above_the_runs(tmp_path: Path) -> None:
    from rollflow.config.checks import check_run_config
    from rollflow.ops.preflight import check_environment, check_prompts_fit

    config = parse_config({"env": {"mixture": [LETTERS, ASYNC]}})
    handle = check_environment(config)
    check_prompts_fit(config, handle)  # both members' first prompts fit
    empty = dict(ASYNC, kwargs={"num_tasks": 1})  # its one task goes to training: none to validate
    with pytest.raises(ConfigError, match=r"^\[\[env.mixture\]\] member 'sums' has no validation tasks"):
        check_environment(parse_config({"env": {"mixture": [LETTERS, empty]}}), splits=("validation",))
    short = parse_config({"env": {"mixture": [LETTERS, ASYNC]}, "rollout": {"max_model_length": 120, "max_completion_tokens": 8}})
    with pytest.raises(ConfigError, match="cannot hold the prompt of train task 'sums/"):
        check_prompts_fit(short, check_environment(short))
    wide = parse_config({"env": {"mixture": [LETTERS, ASYNC]}, "rollout": {"max_completion_tokens": 4}})
    with pytest.raises(ConfigError, match=r"#2 \('sums'\): max_completion_tokens = 8 is above"):
        check_run_config(wide)


def test_chat_and_sft_refuse_a_mixture_naming_its_members() -> None:
    from rollflow.flows.chat import chat_environment
    from rollflow.tasks.sft_rows import SFTDataError, examples_from_environment

    env = mixture_config(LETTERS, ASYNC)
    with pytest.raises(ConfigError, match="is a mixture: .*--env varied_reward_env:load_environment"):
        chat_environment(env.name, env.kwargs)
    with pytest.raises(SFTDataError, match=r"mixture of letters \(varied_reward_env:load_environment\), sums"):
        examples_from_environment(env.name, env.kwargs)


def write_two_environments(folder: object, split: str, step: int) -> None:
    """A step of three groups of two: env a's [1, 0] and [1, 1], env b's [0, 0]; every
    episode made 3 agent calls, the second of each group reset once."""
    import dataclasses

    from rollflow.storage.schemas import episode_records_to_table, score_records_to_table
    from rollflow.storage.synthetic import synthetic_episode, synthetic_score

    plan = [("a", 0, [1.0, 0.0]), ("a", 1, [1.0, 1.0]), ("b", 2, [0.0, 0.0])]  # env, group, rewards
    episodes, scores = [], []
    for env, group, rewards in plan:
        for index, reward in enumerate(rewards):
            episode = dataclasses.replace(synthetic_episode(folder.run_id, step, group, index, split=split), env=env)
            ended = dataclasses.replace(episode.rollout, terminated=True, truncated=False, truncation_cause=None, error=None,
                                        env_metrics={"agent_calls": 3.0, "agent_resets": float(index)})  # fmt: skip
            episodes.append(dataclasses.replace(episode, rollout=ended))
            # the agent's own reward components, as the example's reward returns them: no call counts
            scores.append(dataclasses.replace(
                synthetic_score(episode, reward), passed=reward >= 1.0, scoring_error=None,
                components={"correct": reward}, env=env,
            ))  # fmt: skip
    folder.write_stage(episode_records_to_table(episodes), step, "episodes", split)
    folder.write_stage(score_records_to_table(scores), step, "scores", split)


def test_per_environment_and_agent_figures_are_counted_from_the_stored_scores(tmp_path: Path) -> None:
    """Two environments' groups in one step: each one's reward, pass rate, flat groups and
    episodes by hand; the agent's calls and resets summed from the episodes' env_metrics (where the endpoint
    records them; the scores' components are the user's reward's); and
    the step line and the eval report that show them."""
    from rollflow.flows.eval import EVAL_STEP, eval_report, format_report
    from rollflow.storage.runfolder import RunFolder
    from rollflow.tasks.metrics import rollout_metrics
    from rollflow.tasks.step_health import step_summary

    folder = RunFolder(tmp_path / "run")
    folder.write_config("[train]\nnum_steps = 1\n")
    write_two_environments(folder, "train", 0)
    metrics = rollout_metrics(folder.root, 0, "train")
    assert metrics["env/a/pass"] == 0.75 and metrics["env/a/reward"] == 0.75 and metrics["env/a/episodes"] == 4
    assert metrics["env/a/zero_variance"] == 0.5 and metrics["env/b/zero_variance"] == 1.0
    assert metrics["env/b/pass"] == 0.0 and metrics["env/b/episodes"] == 2
    assert metrics["agent/calls"] == 18 and metrics["agent/resets"] == 3
    line = step_summary(metrics)
    assert "agent resets 3/18 calls" in line and "[a pass 75% of 4, b pass 0% of 2]" in line
    evaluated = RunFolder(tmp_path / "eval")
    write_two_environments(evaluated, "validation", EVAL_STEP)
    text = format_report(eval_report(evaluated.root))
    assert "  env a: pass rate 0.750  reward 0.750  episodes 4  pass@k @1 0.750  @2 1.000" in text
    assert "  env b: pass rate 0.000  reward 0.000  episodes 2  pass@k @1 0.000  @2 0.000" in text


def test_the_curriculum_weighs_tasks_within_each_member_not_the_members_shares() -> None:
    env = mixture_config(LETTERS, ASYNC)
    layers = load_environment_handle(env.name, env.kwargs).strata("train")
    heavy = {"letters/say-3": 50.0, "sums/" + layers[1].items[0].task_id.split("/", 1)[1]: 50.0}
    from rollflow.tasks.schedule import derive_seed

    counts = Counter[str]()
    for step in range(200):
        drawn = draw_step_tasks(layers, step, 3, seed=0, curriculum=heavy)
        shares = stratum_counts([2.0, 1.0], 3, derive_seed(0, "mixture", step))
        assert [sum(i.env == label for i in drawn) for label in ("letters", "sums")] == shares
        counts.update(i.task_id for i in drawn)
    assert counts["letters/say-3"] > 150 and counts[next(iter(heavy.keys() - {"letters/say-3"}))] > 150


def test_score_and_sample_files_from_before_the_env_column_still_read(tmp_path: Path) -> None:
    import dataclasses

    import pyarrow.parquet as pq

    from rollflow.storage.parquet import read_table
    from rollflow.storage.query import open_run_sql, run_query
    from rollflow.storage.runfolder import RunFolder
    from rollflow.storage.schemas import (
        score_records_to_table, sample_records_to_table, table_to_sample_records, table_to_score_records,
    )
    from rollflow.storage.synthetic import synthetic_episode, synthetic_sample, synthetic_score

    folder = RunFolder(tmp_path / "run")
    episode = dataclasses.replace(synthetic_episode(folder.run_id, 0, 0, 0), env="a")
    for kind, table in (("scores", score_records_to_table([dataclasses.replace(synthetic_score(episode, 1.0), env="a")])),
                        ("samples", sample_records_to_table([dataclasses.replace(synthetic_sample(episode, 1.0), env="a")]))):
        old = table.drop_columns(["env"]).replace_schema_metadata(table.schema.metadata)
        path = folder.stage_path(0, kind, "train")
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(old, path)
        reader = table_to_score_records if kind == "scores" else table_to_sample_records
        assert [r.env for r in reader(read_table(path))] == [None]
    con = open_run_sql(folder.root)
    assert run_query(con, "SELECT env FROM scores UNION ALL SELECT env FROM samples")[1] == [(None,), (None,)]
