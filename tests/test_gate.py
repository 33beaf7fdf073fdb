"""The pipeline's gate (tasks/gate.py) and the model registry (storage/registry.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollflow.storage.registry import PolicyRegistry, RegistryError
from rollflow.tasks.gate import decide, gate_stage, read_decision
from rollflow.tasks.gate_rule import GateError, GateSettings


def write_scores(path: Path, passed: dict[str, list[bool | None]]) -> Path:
    """A validation pass's scores; ``None`` is an errored episode (as the scoring stage
    writes one: ``scoring_error`` set, ``passed`` false, reward 0)."""
    rows = [(task, ok) for task, outcomes in passed.items() for ok in outcomes]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "task_id": [t for t, _ in rows],
        "split": ["validation"] * len(rows),
        "passed": [bool(ok) for _, ok in rows],
        "final_reward": [float(bool(ok)) for _, ok in rows],
        "reward": [float(bool(ok)) for _, ok in rows],
        "scoring_error": pa.array([None if ok is not None else "generator server stopped answering"
                                   for _, ok in rows], pa.string()),
    }), path)
    return path


TASKS = [f"t{i}" for i in range(10)]


def test_a_clear_gain_is_promoted_and_the_numbers_are_the_paired_change(tmp_path: Path) -> None:
    before = write_scores(tmp_path / "b.parquet", {t: [False, i < 3] for i, t in enumerate(TASKS)})
    after = write_scores(tmp_path / "a.parquet", {t: [True, i < 8] for i, t in enumerate(TASKS)})
    decision = decide([after], [before], GateSettings())
    diffs = [(1 + (i < 8)) / 2 - (i < 3) / 2 for i in range(10)]
    mean = sum(diffs) / 10
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 9) / math.sqrt(10)
    assert decision.change.mean == pytest.approx(mean) and decision.change.se == pytest.approx(se)
    assert decision.baseline_mean == pytest.approx(0.15) and decision.candidate_mean == pytest.approx(0.9)
    assert decision.promote and "promote" in decision.summary()


def test_a_gain_on_a_few_tasks_keeps_the_champion_and_each_setting_acts(tmp_path: Path) -> None:
    # two tasks of ten gain an episode, one loses one: change +0.05, SE about 0.09, and a
    # one-sided p of 1/2 (of the 8 sign flips of the 3 changed tasks, 4 sum to >= +1)
    before = write_scores(tmp_path / "b.parquet", {t: [t == "t1", False] for t in TASKS})
    after = write_scores(tmp_path / "a.parquet", {t: [t in ("t0", "t2"), False] for t in TASKS})
    decision = decide([after], [before], GateSettings())
    assert decision.change.mean == pytest.approx(0.05) and decision.change.se == pytest.approx(0.0898, abs=1e-4)
    assert decision.p_value == pytest.approx(0.5) and not decision.promote
    assert not decide([after], [before], GateSettings(alpha=0.5)).promote  # 3 changed tasks < min_discordant 5
    assert decide([after], [before], GateSettings(alpha=0.5, min_discordant=3)).promote
    assert not decide([after], [before], GateSettings(alpha=0.5, min_discordant=3, min_gain=0.1)).promote


@pytest.mark.parametrize("tasks", [2, 3, 10, 50, 200])
def test_two_tasks_up_and_none_down_never_promote_whatever_the_task_count(tmp_path: Path, tasks: int) -> None:
    names = [f"t{i}" for i in range(tasks)]
    before = write_scores(tmp_path / "b.parquet", {t: [False] for t in names})
    after = write_scores(tmp_path / "a.parquet", {t: [t in ("t0", "t1")] for t in names})
    decision = decide([after], [before], GateSettings())
    assert not decision.promote, decision.summary()
    assert decision.p_value == pytest.approx(0.25)  # the two changed tasks both up: 1 of 4 sign flips


@pytest.mark.parametrize(("tasks", "promote"), [(2, False), (3, False), (4, False), (5, True), (8, True)])
def test_equal_differences_with_zero_se_pass_only_on_enough_tasks(tmp_path: Path, tasks: int, promote: bool) -> None:
    # every task gains one episode of four: SE 0; the exact p is 2^-tasks (0.05 needs 5)
    names = [f"t{i}" for i in range(tasks)]
    before = write_scores(tmp_path / "b.parquet", {t: [False] * 4 for t in names})
    after = write_scores(tmp_path / "a.parquet", {t: [True, False, False, False] for t in names})
    decision = decide([after], [before], GateSettings())
    assert decision.change.se == 0.0 and decision.change.mean == pytest.approx(0.25)
    assert decision.promote is promote, decision.summary()
    assert decision.p_value == pytest.approx(0.5**tasks)


def test_errored_episodes_refuse_the_gate_naming_each_side(tmp_path: Path) -> None:
    # the champion's evaluation lost its server on three episodes: counted as failures,
    # they would hand the candidate a gain of 3 tasks it never earned
    before = write_scores(tmp_path / "b.parquet", {t: [None if i < 3 else False] for i, t in enumerate(TASKS)})
    after = write_scores(tmp_path / "a.parquet", {t: [i < 1 or i >= 9] for i, t in enumerate(TASKS)})
    with pytest.raises(GateError, match=r"baseline: 3 of 10 .*errored.*generator server stopped answering") as caught:
        decide([after], [before], GateSettings())
    assert "candidate: 0 of 10" in str(caught.value) and str(before) in str(caught.value)
    # a retry reads the sealed pass again: the error says which folder to remove, and only
    # the errored side's
    assert f"remove {tmp_path} first" in str(caught.value), str(caught.value)
    after_errors = write_scores(tmp_path / "a2.parquet", {t: [None if i == 4 else True] for i, t in enumerate(TASKS)})
    with pytest.raises(GateError, match=r"candidate: 1 of 10 .*baseline: 3 of 10"):
        decide([after_errors], [before], GateSettings())


def test_the_two_sides_need_the_same_episodes_per_task(tmp_path: Path) -> None:
    before = write_scores(tmp_path / "b.parquet", {t: [False, False] for t in TASKS})
    after = write_scores(tmp_path / "a.parquet", {t: [True] for t in TASKS})
    with pytest.raises(GateError, match=r"task t0: 1 candidate episodes, 2 baseline"):
        decide([after], [before], GateSettings())


def test_a_negative_min_gain_is_warned_and_other_bad_settings_refused() -> None:
    from rollflow.config.parsing import ConfigError
    from rollflow.config.pipeline import PipelineConfig

    with pytest.warns(UserWarning, match=r"gate_min_gain = -0.1 .*worse"):
        GateSettings(min_gain=-0.1)
    with pytest.warns(UserWarning, match=r"\[pipeline\].gate_min_gain = -0.1 .*worse"):
        PipelineConfig(gate_min_gain=-0.1)
    for bad in ({"alpha": 0.0}, {"alpha": 1.5}, {"min_discordant": -1}, {"min_gain": math.inf}):
        with pytest.raises(GateError, match=r"\[pipeline\].gate_"):
            GateSettings(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"gate_alpha"):
        PipelineConfig(gate_alpha=0.0)


def test_a_stale_gate_z_key_says_what_to_set_instead() -> None:
    from rollflow.config.parsing import ConfigError
    from rollflow.config.run import parse_config

    with pytest.raises(ConfigError, match=r"\[pipeline\].gate_z .*gate_alpha"):
        parse_config({"pipeline": {"gate_z": 1.0}})


def test_every_shipped_config_still_loads() -> None:
    from rollflow.config.run import load_config

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
    assert configs
    for path in configs:
        load_config(path)


def test_the_two_sides_must_have_validated_the_same_tasks(tmp_path: Path) -> None:
    before = write_scores(tmp_path / "b.parquet", {"a": [True], "b": [False]})
    after = write_scores(tmp_path / "a.parquet", {"a": [True], "c": [False]})
    with pytest.raises(GateError, match="different tasks"):
        decide([after], [before], GateSettings())
    with pytest.raises(GateError, match="no such scores file"):
        decide([tmp_path / "missing.parquet"], [before], GateSettings())
    with pytest.raises(GateError, match=r"\[pipeline\].gate_column"):
        GateSettings(column="accuracy")


def test_the_gate_stage_writes_its_decision_once(tmp_path: Path) -> None:
    before = write_scores(tmp_path / "b.parquet", {t: [False] for t in TASKS})
    after = write_scores(tmp_path / "a.parquet", {t: [True] for t in TASKS})
    out = gate_stage([after], [before], GateSettings(), tmp_path / "pipe")
    decision = read_decision(out)
    assert decision.promote and decision.change.mean == pytest.approx(1.0)
    write_scores(after, {t: [False] for t in TASKS})  # the inputs change after the decision
    assert gate_stage([after], [before], GateSettings(), tmp_path / "pipe") == out
    assert json.loads(out.read_text())["promote"] is True  # the finished decision is kept
    assert not list((tmp_path / "pipe").glob(".*partial"))


def test_registry_versions_the_champion_alias_and_rollback(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    registry = PolicyRegistry("game-policy", uri)
    assert registry.champion() is None and registry.versions() == []
    policy = tmp_path / "policy"
    policy.mkdir()
    first = registry.register(policy, tmp_path / "night-1", tags={"rollflow.adapter": "true"})
    again = registry.register(policy, tmp_path / "night-1", tags={"rollflow.adapter": "true"})
    assert again.version == first.version == 1  # a retried pipeline registers nothing new
    second = registry.register(policy, tmp_path / "night-2", tags={"rollflow.adapter": "false"})
    assert second.version == 2 and [v.version for v in registry.versions()] == [1, 2]
    assert first.is_adapter and not second.is_adapter and first.source == policy.resolve()
    assert registry.champion() is None  # registering never moves the alias
    registry.promote(2)
    assert registry.champion().version == 2
    registry.rollback(1)
    assert registry.champion().version == 1
    with pytest.raises(RegistryError, match="no version 7"):
        registry.promote(7)


def test_rollflow_registry_lists_versions_and_promote_moves_the_champion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollflow.flows.cli import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    registry = PolicyRegistry("game-policy", uri)
    for night in ("night-1", "night-2"):
        registry.register(tmp_path, tmp_path / night, tags={"gate.change": "0.1", "gate.promote": "true"})
    registry.promote(2)
    assert main(["registry", "game-policy", "--tracking-uri", uri, "--promote", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["1", "champion"] and lines[1].split()[1] == "gate"  # 2 is no longer marked
    assert registry.champion().version == 1
    assert main(["registry", "game-policy", "--tracking-uri", uri, "--promote", "9"]) == 1
    assert "no version 9" in capsys.readouterr().err
    assert main(["registry", "unknown-policy", "--tracking-uri", uri]) == 1
    assert "no registered versions of 'unknown-policy'" in capsys.readouterr().err
    assert main(["registry", "game-polcy", "--tracking-uri", uri]) == 1  # a typo: the name it may have meant
    assert "did you mean 'game-policy'?" in capsys.readouterr().err


def test_differences_on_no_lattice_get_random_flips_close_to_the_exact_p() -> None:
    import itertools
    import random

    from rollflow.tasks.gate_rule import gain_p_value

    rng = random.Random(3)
    diffs = [rng.uniform(-0.4, 0.9) for _ in range(12)]  # a continuous final_reward
    exact = sum(sum(s * abs(d) for s, d in zip(signs, diffs, strict=True)) >= sum(diffs) - 1e-12
                for signs in itertools.product([-1, 1], repeat=12)) / 2**12
    drawn = gain_p_value(diffs)
    assert drawn != exact and abs(drawn - exact) < 4 * math.sqrt(exact * (1 - exact) / 20000)
    assert gain_p_value(diffs) == drawn  # seeded
    assert gain_p_value([0.0, 0.0, 0.0]) == 1.0


def test_alpha_one_no_floor_and_a_negative_margin_promote_whatever_was_measured(tmp_path: Path) -> None:
    # what an end-to-end test sets to make a night promote on a tiny random model
    before = write_scores(tmp_path / "b.parquet", {"a": [True], "b": [False]})
    after = write_scores(tmp_path / "a.parquet", {"a": [False], "b": [False]})
    with pytest.warns(UserWarning, match="non-inferiority"):
        settings = GateSettings(alpha=1.0, min_discordant=0, min_gain=-10.0)
    decision = decide([after], [before], settings)
    assert decision.change.mean == pytest.approx(-0.5) and decision.p_value == 1.0 and decision.promote
    assert not decide([after], [before], GateSettings()).promote
