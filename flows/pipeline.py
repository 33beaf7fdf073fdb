"""The nightly pipeline: SFT (optional) -> GRPO -> evaluation -> gate -> model registry.

``pipeline_flow(config_path)`` runs one config through the chain, each stage a subflow or
task run with a readable name, each resuming from its files in the pipeline's folder::

    runs/pipeline-<flow run>/config.toml      the frozen config (with its [pipeline] section)
    runs/pipeline-<flow run>/sft/             the SFT run folder ([pipeline].sft = true)
    runs/pipeline-<flow run>/grpo.toml        the GRPO config as derived once (start policy fixed)
    runs/pipeline-<flow run>/grpo/            the GRPO run folder
    runs/pipeline-<flow run>/eval-champion/   the champion's evaluation on the same tasks
    runs/pipeline-<flow run>/gate.json        the decision and its numbers
    runs/pipeline-<flow run>/policy/          the exported policy that was registered
    runs/pipeline-<flow run>/pipeline.json    the registered version and whether it was promoted

**Retry is resume.** Without ``run_dir`` the folder is named after the Prefect flow run
id, which a retry keeps (``prefect flow-run retry``, the UI's Retry, the flow's own
``retries``), so a retried run continues the same folder: finished stages are skipped by
their files, GRPO resumes from its last checkpoint, nothing is registered twice.

**The gate** compares the trained policy's final validation with the champion's
evaluation on the same validation tasks, paired by task (``rollflow.tasks.gate``); with no
champion yet, with the validation of the policy GRPO started from (its step 0). Only a
passing gate moves the ``champion`` alias; every trained policy is registered, with its
gate numbers as tags, so a rejected one can still be promoted by hand.

**Where GRPO starts**: from the champion when ``[pipeline].start_from_champion`` and there
is one (SFT is then skipped: the champion already knows the task); else from the SFT
policy when ``[pipeline].sft``; else from ``[model]``.

**The champion's base**: a champion that is a LoRA adapter is evaluated (and trained
from) on tonight's ``[model]``, so it must be the base the adapter was made for: its
``rollflow.base_model`` tag (else its ``adapter_config.json``) is compared with
``[model]`` before anything runs, and a mismatch is refused naming both bases.

**One training at a time**: the whole chain holds the machine's training slot
(``rollflow.flows.concurrency``), and the pipeline folder's lock (``rollflow.storage.runlock``):
a second process on the same folder is refused at once.

Simplified, and why: the champion is re-evaluated every night rather than trusting its
old numbers, since the validation tasks, the seed or the code may have changed; the
GRPO config is derived once and frozen as ``grpo.toml``, so a retry started after the
champion moved still resumes the run it began.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollflow.config.run import RunConfig, config_to_toml, load_config
from rollflow.flows.concurrency import one_training_at_a_time
from rollflow.flows.runs import RunSetupError, freeze_config
from rollflow.storage.registry import PolicyRegistry, PolicyVersion
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.runlock import run_folder_lock
from rollflow.storage.runs import mark_run_kind
from rollflow.tasks.gate import GATE_FILE, GateDecision, gate_stage, read_decision
from rollflow.tasks.gate_rule import GateSettings

PIPELINE_FILE = "pipeline.json"
GRPO_CONFIG = "grpo.toml"
BUNDLED_BASE = "bundled SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class PipelineResult:
    run_dir: str
    version: int
    promoted: bool
    champion: int | None  # the champion version after this run
    summary: str


def pipeline_root(config: RunConfig, run_dir: str | None) -> Path:
    """``run_dir``, or a folder named after this flow run (a retry keeps the same id)."""
    if run_dir is not None:
        return Path(run_dir)
    from prefect.runtime import flow_run

    name, run_id = flow_run.name or "local", flow_run.id or "no-id"
    return Path(config.storage.runs_dir) / f"pipeline-{name}-{str(run_id)[:8]}"


def check_pipeline_config(config: RunConfig) -> None:
    if config.validation.validation_interval <= 0:
        raise RunSetupError(
            "[validation].validation_interval must be > 0 for the pipeline: its gate compares "
            "GRPO's first and last validation passes (or the last with the champion's)"
        )


@task(name="derive-grpo-config", task_run_name="derive GRPO config", cache_policy=NO_CACHE, persist_result=False)
def derive_grpo_config(config: RunConfig, root: Path, sft_policy: Path | None, champion: PolicyVersion | None) -> Path:
    """Write ``grpo.toml`` once: the config with its start policy (SFT, champion or base)."""
    path = root / GRPO_CONFIG
    if path.is_file():
        return path
    start = config
    if champion is not None and config.pipeline.start_from_champion:
        start = _starting_from(config, champion.source, champion.is_adapter)
    elif sft_policy is not None:
        start = _starting_from(config, sft_policy, config.train.use_lora)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(config_to_toml(start))
    partial.replace(path)
    return path


def _starting_from(config: RunConfig, policy: Path, is_adapter: bool) -> RunConfig:
    where = str(Path(policy).resolve())
    model = replace(config.model, adapter=where) if is_adapter else replace(config.model, path=where, gguf_file=None, adapter=None)
    return replace(config, model=model)


@task(name="gate", task_run_name="gate", cache_policy=NO_CACHE, persist_result=False)
def gate(candidate: list[Path], baseline: list[Path], settings: GateSettings, root: Path) -> Path:
    return gate_stage(candidate, baseline, settings, root)


@task(name="export-policy", task_run_name="export policy", cache_policy=NO_CACHE, persist_result=False)
def export_final_policy(grpo_dir: Path, out: Path) -> Path:
    """The newest checkpoint as a servable folder (tokenizer and template included), once."""
    from rollflow.flows.export import EXPORT_FILE, export_policy

    if not (out / EXPORT_FILE).is_file():  # the export is renamed into place whole
        export_policy(grpo_dir, out)
    return out


@task(name="register", task_run_name="register {model_name}", cache_policy=NO_CACHE, persist_result=False, retries=2,
      retry_delay_seconds=5)
def register(model_name: str, tracking_uri: str | None, policy: Path, root: Path, grpo_dir: Path,
             config: RunConfig, decision: GateDecision) -> PipelineResult:
    """Register the policy, move ``champion`` when the gate passed; ``pipeline.json`` last."""
    done = root / PIPELINE_FILE
    if done.is_file():
        return PipelineResult(**json.loads(done.read_text()))
    registry = PolicyRegistry(model_name, tracking_uri)
    change = decision.change
    version = registry.register(policy, root, mlflow_run_id=_mlflow_run_id(grpo_dir), tags={
        "rollflow.adapter": str(config.train.use_lora).lower(),
        "rollflow.base_model": _base_model(config),
        "rollflow.grpo_run": str(grpo_dir.resolve()),
        "gate.column": decision.settings.column,
        "gate.change": f"{change.mean:.6f}",
        "gate.se": f"{change.se:.6f}",
        "gate.p_value": f"{decision.p_value:.6g}",
        "gate.candidate": f"{decision.candidate_mean:.6f}",
        "gate.baseline": f"{decision.baseline_mean:.6f}",
        "gate.promote": str(decision.promote).lower(),
    })
    if decision.promote:
        registry.promote(version.version)
    champion = registry.champion()
    result = PipelineResult(
        run_dir=str(root), version=version.version, promoted=decision.promote,
        champion=None if champion is None else champion.version, summary=decision.summary(),
    )
    partial = done.with_name(f".{done.name}.partial")
    partial.write_text(json.dumps(result.__dict__, indent=2))
    partial.replace(done)
    return result


def _base_model(config: RunConfig) -> str:
    """``[model]``'s base as the ``rollflow.base_model`` tag records it: an absolute path."""
    model = config.model
    if model.path is None and model.gguf_file is None:
        return BUNDLED_BASE
    where = Path(model.path or "") / model.gguf_file if model.gguf_file else Path(str(model.path))
    return str(where.resolve())


def check_champion_base(champion: PolicyVersion | None, config: RunConfig) -> None:
    """Refuse a champion adapter made for another base than ``config``'s ``[model]``.

    Its base is its ``rollflow.base_model`` tag, else its ``adapter_config.json``'s
    ``base_model_name_or_path``; a full-weight champion is its own base (nothing to check).
    """
    if champion is None or not champion.is_adapter:
        return
    if champion.base_model is not None:
        theirs, ours, recorded = champion.base_model, _base_model(config), "its rollflow.base_model tag"
    else:
        adapter_config = champion.source / "adapter_config.json"
        if not adapter_config.is_file():
            return  # nothing says which base: evaluating it will load it or fail loudly
        from rollflow.flows.export import base_model_folder

        theirs = str(json.loads(adapter_config.read_text()).get("base_model_name_or_path"))
        ours, recorded = str(base_model_folder(config)), str(adapter_config)
    if theirs == BUNDLED_BASE or ours == BUNDLED_BASE:
        same = theirs == ours
    else:
        same = Path(theirs).resolve() == Path(ours).resolve()
    if not same:
        raise RunSetupError(
            f"the champion of {champion.name!r} (version {champion.version}, {champion.source}) is a LoRA "
            f"adapter for the base {theirs} ({recorded}), but tonight's [model] base is {ours}: its "
            f"evaluation (the gate's baseline) and any training from it would run on a base it was not "
            f"trained for. Set [model].path (or gguf_file) to {theirs}, promote a version trained on "
            f"{ours} (rollflow registry promote VERSION), or use another [pipeline].model_name"
        )


def _mlflow_run_id(run_dir: Path) -> str | None:
    ref = run_dir / "tracking.json"
    return json.loads(ref.read_text()).get("mlflow_run_id") if ref.is_file() else None


@flow(name="rollflow-pipeline")
def pipeline_flow(config_path: str | None = None, run_dir: str | None = None) -> dict[str, object]:
    """Run (or, on the same folder, resume) the pipeline; returns what it registered."""
    if config_path is None and run_dir is None:
        raise RunSetupError("give a config to start a pipeline, or its folder to resume it")
    config = (load_config(config_path) if config_path is not None
              else load_config(Path(str(run_dir)) / "config.toml", frozen=True))
    check_pipeline_config(config)
    root = pipeline_root(config, run_dir)
    registry = PolicyRegistry(config.pipeline.model_name, config.tracking.tracking_uri)
    if not (root / GATE_FILE).is_file():  # the champion is still to be evaluated (and maybe trained)
        check_champion_base(registry.champion(), config)
    with run_folder_lock(root):
        freeze_config(RunFolder(root), config)  # before the slot: a waiting night is visible
        mark_run_kind(root, "pipeline")
        with one_training_at_a_time(f"pipeline {root.name}"):
            return _run_pipeline(config, root, registry)


def _run_pipeline(config: RunConfig, root: Path, registry: PolicyRegistry) -> dict[str, object]:
    """The pipeline's stages, with its folder's lock and the training slot held."""
    from rollflow.flows.sft import sft_flow
    from rollflow.flows.train import train_flow

    log = get_run_logger()
    log.info("pipeline folder %s", root)
    settings = config.pipeline
    champion = registry.champion()
    from_champion = champion is not None and settings.start_from_champion
    sft_policy = None
    if settings.sft and not from_champion and not (root / GRPO_CONFIG).is_file():
        sft_policy = Path(sft_flow(str(root / "config.toml"), run_dir=str(root / "sft")))
    grpo_config = derive_grpo_config(config, root, sft_policy, champion)
    grpo_dir = Path(train_flow(config_path=str(grpo_config), run_dir=str(root / "grpo")))
    grpo = load_config(grpo_config)
    if not (root / GATE_FILE).is_file():
        candidate = [_validation_scores(grpo_dir, grpo.train.num_steps)]
        baseline = _baseline_passes(registry.champion(), grpo_dir, grpo_config, root)
        gate_settings = GateSettings(column=settings.gate_column, alpha=settings.gate_alpha,
                                     min_discordant=settings.gate_min_discordant, min_gain=settings.gate_min_gain)
        gate(candidate, baseline, gate_settings, root)
    decision = read_decision(root / GATE_FILE)
    log.info("gate: %s", decision.summary())
    policy = export_final_policy(grpo_dir, root / "policy")
    result = register(settings.model_name, config.tracking.tracking_uri, policy, root, grpo_dir, grpo, decision)
    kept = registry.champion()
    log.info("registered %s version %d%s", settings.model_name, result.version,
             " and made it the champion" if result.promoted
             else f"; the champion stays (version {kept.version})" if kept is not None
             else "; not made the champion (there is none yet: the gate saw no gain over GRPO's start)")
    return dict(result.__dict__)


def _baseline_passes(champion: PolicyVersion | None, grpo_dir: Path, grpo_config: Path, root: Path) -> list[Path]:
    """The champion's evaluation on the same tasks; with none, GRPO's start (its step 0)."""
    from rollflow.flows.eval import eval_flow

    if champion is None:
        return [_validation_scores(grpo_dir, 0)]
    check_champion_base(champion, load_config(grpo_config))  # it may have moved since the night began
    evaluated = eval_flow(config_path=str(grpo_config), run_dir=str(root / "eval-champion"), **_eval_policy(champion))
    return [_validation_scores(Path(evaluated), 0)]


def _validation_scores(run_dir: Path, step: int) -> Path:
    path = RunFolder(run_dir).root / "validation" / f"step={step:06d}" / "scores.parquet"
    if not path.is_file():
        raise RunSetupError(f"{run_dir}: no validation pass at step {step} ({path} is missing)")
    return path


def _eval_policy(champion: PolicyVersion) -> dict[str, str]:
    return {"adapter": str(champion.source)} if champion.is_adapter else {"model": str(champion.source)}
