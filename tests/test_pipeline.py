"""The nightly pipeline (flows/pipeline.py) end to end on a tiny model, under Prefect's engine.

GRPO, evaluation of the champion, the gate and the registry all run for real (MLflow on a
SQLite file in the test's folder); the gate's margin is set so that one night must
promote and the next must not, whatever the tiny random model scores.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rollflow.config.pipeline import PipelineConfig
from rollflow.config.run import config_to_toml, load_config
from rollflow.flows.runs import RunSetupError
from rollflow.storage.registry import PolicyRegistry
from rollflow.storage.runs import run_status

pytestmark = pytest.mark.slow


def pipeline_config(tmp_path: Path, model_dir: Path, name: str, **pipeline: object) -> Path:
    from tiny_run import tiny_config_at

    base = load_config(tiny_config_at(tmp_path, model_dir))
    config = replace(
        base,
        train=replace(base.train, num_steps=1),
        validation=replace(base.validation, validation_interval=1),
        tracking=replace(base.tracking, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"),
        pipeline=PipelineConfig(model_name="tiny-policy", **pipeline),  # type: ignore[arg-type]
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(config_to_toml(config))
    return path


def files_with_mtimes(root: Path) -> dict[str, float]:
    """Every file but the curves, which each finish redraws from MLflow's points."""
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*") if p.is_file() and p.suffix != ".png"}


def test_every_night_registers_and_only_the_gate_moves_the_champion(
    prefect_harness: object, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rollflow.flows.pipeline import pipeline_flow

    registry = PolicyRegistry("tiny-policy", f"sqlite:///{tmp_path / 'mlflow.db'}")
    night1 = tmp_path / "night1"
    first = pipeline_flow(config_path=str(pipeline_config(tmp_path, tiny_model_dir, "n1", gate_min_gain=-10.0,
                                                     gate_alpha=1.0, gate_min_discordant=0)),
                          run_dir=str(night1))
    assert first["version"] == 1 and first["promoted"] is True and first["champion"] == 1
    assert not (night1 / "eval-champion").exists()  # no champion yet: gated against GRPO's step 0
    assert (night1 / "policy" / "adapter_config.json").is_file() and (night1 / "policy" / "tokenizer_config.json").is_file()
    assert registry.champion().source == (night1 / "policy").resolve()
    gate = json.loads((night1 / "gate.json").read_text())
    assert float(registry.champion().tags["gate.p_value"]) == pytest.approx(gate["p_value"], rel=1e-5)
    assert run_status(night1).complete
    ref = json.loads((night1 / "grpo" / "tracking.json").read_text())
    traces = MlflowClient(ref["tracking_uri"]).search_traces(locations=[ref["experiment_id"]], run_id=ref["mlflow_run_id"])
    episodes = {t.data.spans[0].name for t in traces}  # both validation passes, every episode (2 tasks x 1)
    assert episodes == {f"episode validation/{step}/{task}/0" for step in (0, 1) for task in (0, 1)}

    night2 = tmp_path / "night2"
    config2 = pipeline_config(tmp_path, tiny_model_dir, "n2", gate_min_gain=10.0, start_from_champion=True)
    second = pipeline_flow(config_path=str(config2), run_dir=str(night2))
    assert second["version"] == 2 and second["promoted"] is False and second["champion"] == 1
    assert load_config(night2 / "grpo.toml").model.adapter == str((night1 / "policy").resolve())
    assert (night2 / "eval-champion" / "validation" / "step=000000" / "scores.parquet").is_file()
    assert registry.version(2).tags["gate.promote"] == "false"
    assert registry.champion().version == 1

    before = files_with_mtimes(night2)
    again = pipeline_flow(config_path=str(config2), run_dir=str(night2))  # a retry of a finished night
    assert again == second
    assert files_with_mtimes(night2) == before  # nothing redone, nothing rewritten
    assert [v.version for v in registry.versions()] == [1, 2]


@pytest.mark.parametrize("recorded_by", ["registry tag", "adapter config"])
def test_a_champion_adapter_for_another_base_is_refused_naming_both_bases(
    recorded_by: str, prefect_harness: object, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The champion is a LoRA adapter trained on another base (tonight's [model] moved): the
    pipeline refuses before it evaluates or trains anything, and leaves no folder behind."""
    from peft import LoraConfig, get_peft_model

    from rollflow.flows.pipeline import pipeline_flow
    from rollflow.policy.models import ModelRef, build_tiny_model, load_causal_lm

    other_base = build_tiny_model(tmp_path / "other-base", seed=1).resolve()
    model, _ = load_causal_lm(ModelRef(path=str(other_base)))
    adapter = tmp_path / "champion"
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(str(adapter))
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(other_base)
    tags = {"rollflow.adapter": "true"}
    if recorded_by == "registry tag":
        tags["rollflow.base_model"] = str(other_base)
    registry = PolicyRegistry("tiny-policy", f"sqlite:///{tmp_path / 'mlflow.db'}")
    registry.promote(registry.register(adapter, tmp_path / "night0", tags=tags).version)

    night = tmp_path / "night1"
    config = pipeline_config(tmp_path, tiny_model_dir, "n1", start_from_champion=True)
    with pytest.raises(RunSetupError, match="champion") as raised:
        pipeline_flow(config_path=str(config), run_dir=str(night))
    message = str(raised.value)
    assert str(other_base) in message and str(tiny_model_dir.resolve()) in message, message
    assert "[model].path" in message and not night.exists()


def test_the_pipeline_needs_validation_for_its_gate(prefect_harness: object, tiny_model_dir: Path, tmp_path: Path) -> None:
    from rollflow.flows.pipeline import pipeline_flow

    config = load_config(pipeline_config(tmp_path, tiny_model_dir, "noval"))
    path = tmp_path / "noval.toml"
    path.write_text(config_to_toml(replace(config, validation=replace(config.validation, validation_interval=0))))
    with pytest.raises(RunSetupError, match="validation_interval"):
        pipeline_flow(config_path=str(path), run_dir=str(tmp_path / "x"))
