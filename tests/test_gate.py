"""The pipeline's gate (tasks/gate.py) and the model registry (storage/registry.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollflow.storage.registry import PolicyRegistry, RegistryError
from rollflow.tasks.gate import GateError, GateSettings, decide, gate_stage, read_decision


def write_scores(path: Path, passed: dict[str, list[bool]]) -> Path:
    rows = [(task, ok) for task, outcomes in passed.items() for ok in outcomes]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "task_id": [t for t, _ in rows],
        "split": ["validation"] * len(rows),
        "passed": [ok for _, ok in rows],
        "final_reward": [float(ok) for _, ok in rows],
        "reward": [float(ok) for _, ok in rows],
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


def test_a_gain_within_one_standard_error_keeps_the_champion(tmp_path: Path) -> None:
    # two tasks of ten gain an episode, one loses one: change +0.05, SE about 0.09
    before = write_scores(tmp_path / "b.parquet", {t: [t == "t1", False] for t in TASKS})
    after = write_scores(tmp_path / "a.parquet", {t: [t in ("t0", "t2"), False] for t in TASKS})
    decision = decide([after], [before], GateSettings())
    assert decision.change.mean == pytest.approx(0.05) and decision.change.se == pytest.approx(0.0898, abs=1e-4)
    assert not decision.promote
    assert decide([after], [before], GateSettings(z=0.5)).promote  # a looser gate lets it through
    assert not decide([after], [before], GateSettings(z=0.0, min_gain=0.1)).promote


def test_the_two_sides_must_have_validated_the_same_tasks(tmp_path: Path) -> None:
    before = write_scores(tmp_path / "b.parquet", {"a": [True], "b": [False]})
    after = write_scores(tmp_path / "a.parquet", {"a": [True], "c": [False]})
    with pytest.raises(GateError, match="different tasks"):
        decide([after], [before], GateSettings())
    with pytest.raises(GateError, match="no such scores file"):
        decide([tmp_path / "missing.parquet"], [before], GateSettings())
    with pytest.raises(GateError, match=r"\[gate\].column"):
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
