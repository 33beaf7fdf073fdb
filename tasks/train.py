"""Training stage: one GRPO update on the step's samples, then a new policy version on disk.

``train_stage`` is given the step's samples, its teacher scores (OPD; None otherwise), the
checkpoint to continue from (None: the run's start) and the two paths it writes. It loads
that checkpoint (LoRA adapter or full weights) with its optimizer and RNG state, or starts
version 0 from the base model with a fresh LoRA seeded by ``[train].seed``; applies
``[train].objective``'s advantages (``rollflow.tasks.objectives``; the loss and the update do
not know which objective ran); runs ``grpo_update`` (``tasks/grpo_update.py``, the
algorithm); commits the checkpoint folder and then ``train.json``. A stop (Ctrl-C, SIGTERM)
before the commit abandons the update whole: no checkpoint, and a resume redoes the step's
update (``rollflow.policy.stopping``).

The KL reference is always policy version 0, where the run started: with a fresh LoRA the
same model with the adapter switched off; from a starting adapter (``[model].adapter``, an
SFT warm start) a frozen second copy of that adapter in the same peft model; with full
weights a second, frozen copy of the starting model. It is loaded or built only when
``kl_coef > 0``.

Full weights are trained (and checkpointed) in float32 whatever ``[model].dtype`` says,
which only sets how a policy is loaded to act (``training_dtype``): AdamW on bfloat16
weights rounds most small updates away. With LoRA the frozen base stays in
``[model].dtype``: ``"auto"`` on a CPU with native bfloat16 trains in bfloat16 against a
managed vLLM sampler that always runs float32 (``policy/vllm_spec.py``), a logprob gap of
about 0.1 that the ratio's clip absorbs in lockstep (no off-policy correction there).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel

from rollflow.config.checks import check_training_sampling
from rollflow.config.run import RunConfig
from rollflow.generators.checkpoints import (
    REFERENCE_ADAPTER,
    Checkpoint,
    checkpoint_train_result,
    load_optimizer_state,
    load_rng_state,
    prune_checkpoints,
    read_checkpoint,
    save_checkpoint,
    seed_everything,
)
from rollflow.generators.models import base_model_ref, load_policy_for_training, torch_device, training_dtype
from rollflow.policy.procs import fault_point
from rollflow.policy.stopping import raise_if_stop_requested
from rollflow.storage.records import TrainResult
from rollflow.storage.schemas import table_to_sample_records
from rollflow.storage.stage_outputs import locate_output, read_output
from rollflow.tasks.grpo_update import RefLogprobsFn, UpdateSettings, UpdateStats, grpo_update, make_optimizer
from rollflow.tasks.objectives import objective_samples
from rollflow.tasks.shared_prefix import SharedPrefix
from rollflow.tasks.trainer_logprobs import token_logprobs


def adapter_off_reference(model: PreTrainedModel, temperature: float) -> RefLogprobsFn:
    """The KL reference with LoRA: the same model, adapter disabled (no second copy)."""

    def reference(
        input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | SharedPrefix | None, wanted_BT: torch.Tensor
    ) -> torch.Tensor:
        with torch.no_grad(), model.disable_adapter():
            return token_logprobs(model, input_ids_BT, attention_mask_BT, temperature, wanted_BT)

    return reference


def start_adapter_reference(model: PreTrainedModel, adapter: Path, temperature: float) -> RefLogprobsFn:
    """The KL reference when LoRA training started from an adapter (an SFT warm start).

    Version 0 is then base + that adapter, not the base: switching the trained adapter
    off would measure KL to a model the run never was. The starting adapter is loaded a
    second time into the same peft model, frozen, as ``REFERENCE_ADAPTER`` (a second set
    of LoRA matrices, not a second model), and the reference pass switches to it. Merging
    it into the base instead would make a checkpoint a delta on a merged model that the
    rollout stage (base + checkpoint adapter) could not load as it is.
    """
    if REFERENCE_ADAPTER not in model.peft_config:
        model.load_adapter(str(adapter), adapter_name=REFERENCE_ADAPTER, is_trainable=False)
    trained = model.active_adapter

    def reference(
        input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | SharedPrefix | None, wanted_BT: torch.Tensor
    ) -> torch.Tensor:
        model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)  # freezes every adapter
        try:
            with torch.no_grad():
                return token_logprobs(model, input_ids_BT, attention_mask_BT, temperature, wanted_BT)
        finally:
            model.set_adapter(trained)  # trainable again, the reference frozen

    return reference


def frozen_model_reference(reference_model: PreTrainedModel, temperature: float) -> RefLogprobsFn:
    """The KL reference with full weights: a separate copy of the base model, frozen."""
    reference_model.requires_grad_(False)
    reference_model.eval()

    def reference(
        input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | SharedPrefix | None, wanted_BT: torch.Tensor
    ) -> torch.Tensor:
        with torch.no_grad():
            return token_logprobs(reference_model, input_ids_BT, attention_mask_BT, temperature, wanted_BT)

    return reference


# ---------------------------------------------------------------- the stage


def train_stage(
    config: RunConfig, samples: Path, teacher: Path | None, previous: Path | None,
    out_checkpoint: Path, out_result: Path, *, node: str | None = None, prune: bool = True,
) -> Path:
    """Train on ``samples`` from checkpoint ``previous``; commits ``out_checkpoint``, then
    writes ``out_result`` (``train.json``), and returns the checkpoint: the next version. ``node``: the Ray node this
    runs on (``cluster/ray_trainer.py``), recorded in the result. ``prune``: delete the
    checkpoints the run no longer needs afterwards; a stage run in another process than the
    run's generator passes False and leaves it to the driver, the only process that knows
    which versions its async generator still reads (``checkpoints_to_keep``).

    A checkpoint committed before a crash kept ``train.json`` from being written is not
    trained again: ``train.json`` is rewritten from it. Every step makes a new policy
    version, even one with nothing to train (its weights are then the previous version's),
    so step ``s`` always acts with version ``s``.
    """
    check_training_sampling(config)  # a run started through the API, not `rollflow train`
    where = locate_output(out_result)
    folder, step = where.folder, where.step
    if Path(out_checkpoint).absolute() != folder.checkpoint_dir(step):
        raise ValueError(f"step {step} commits its checkpoint at {folder.checkpoint_dir(step)}, not {out_checkpoint}")
    if out_checkpoint.is_dir():  # committed whole (renamed into place), train.json not yet written
        folder.write_train_result(checkpoint_train_result(read_checkpoint(out_checkpoint)))
        if prune:
            prune_checkpoints(folder, config.train.keep_checkpoints)
        return out_checkpoint
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    start = read_checkpoint(previous) if previous is not None else None
    model, tokenizer = load_policy_for_training(config, start)
    optimizer = make_optimizer(model, config.train.learning_rate)
    _restore_or_seed(config, start, optimizer)
    reference = kl_reference(config, model)
    timings["load_s"] = _lap(clock)
    clock = time.perf_counter()
    records = objective_samples(config, table_to_sample_records(read_output(samples)), teacher)
    timings["read_s"] = _lap(clock)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    fault_point("train_update")  # tests: a kill in the train stage, the policy loaded, nothing written
    version = (start.policy_version if start else 0) + 1
    print(f"  train step {step}: update on {len(records)} samples into policy version {version}",
          file=sys.stderr, flush=True)  # minutes on a slow day: the log says where the run is
    stats = grpo_update(model, reference, optimizer, records, UpdateSettings.from_config(config, pad_id))
    timings["update_s"] = stats.seconds
    result = _train_result(folder.run_id, step, version, config, stats, timings, node)
    raise_if_stop_requested()  # a stop that came as the update ended: commit nothing, resume redoes it
    save_checkpoint(folder, model, tokenizer, optimizer, result, config.train.use_lora)
    folder.write_train_result(result)
    if prune:
        prune_checkpoints(folder, config.train.keep_checkpoints)
    return out_checkpoint


def _restore_or_seed(
    config: RunConfig, previous: Checkpoint | None, optimizer: torch.optim.Optimizer
) -> None:
    if previous is None:
        seed_everything(config.train.seed)
        return
    load_optimizer_state(optimizer, previous)
    load_rng_state(previous)


def kl_reference(config: RunConfig, model: PreTrainedModel) -> RefLogprobsFn | None:
    """The KL reference, policy version 0, for ``model`` (None without a KL term)."""
    if config.train.kl_coef == 0:
        return None
    if config.train.use_lora and config.model.adapter is not None:
        return start_adapter_reference(model, Path(config.model.adapter), config.rollout.temperature)
    if config.train.use_lora:  # version 0 is the base model with a fresh adapter (B = 0)
        return adapter_off_reference(model, config.rollout.temperature)
    from rollflow.policy.models import load_causal_lm

    reference_model, _ = load_causal_lm(base_model_ref(config), training_dtype(config), device=torch_device(config))
    return frozen_model_reference(reference_model, config.rollout.temperature)


def _lap(since: float) -> float:
    return time.perf_counter() - since


def _train_result(
    run_id: str, step: int, version: int, config: RunConfig, stats: UpdateStats,
    timings: dict[str, float], node: str | None = None,
) -> TrainResult:
    return TrainResult(
        run_id=run_id, step=step, policy_version=version, loss=stats.loss, kl=stats.kl,
        clip_fraction=stats.clip_fraction, grad_norm=stats.grad_norm,
        num_samples=stats.num_samples, num_tokens=stats.num_tokens,
        num_action_tokens=stats.num_action_tokens,
        learning_rate=config.train.learning_rate if stats.learning_rate is None else stats.learning_rate,
        tokens_per_s=stats.tokens_per_s, timings=dict(timings), mismatch_kl=stats.mismatch_kl,
        is_weight_mean=stats.is_weight_mean, corrected_fraction=stats.corrected_fraction, node=node,
    )
