"""Which model a run loads, in which dtype and on which device, and the policy it trains.

The generator's room, shared with the train stage:

- ``base_model_ref`` is ``[model]``'s model; ``policy_model_ref`` is what to load to act
  as a checkpoint's policy version (the base model with the checkpoint's adapter, or the
  checkpoint's own full weights);
- ``torch_dtype`` / ``torch_device`` resolve ``[model].dtype`` and ``[model].device`` in
  this process (``auto_dtype``: bfloat16 where the device runs it natively);
  ``training_dtype`` is the trainer's (float32 for full weights, always);
- ``load_policy_for_training`` builds the policy the train stage updates and
  ``fresh_lora_policy`` version 0 of a LoRA run, exactly as the trainer builds it.

The checkpoint format itself, saving, loading and pruning, is ``generators/checkpoints.py``.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollflow.config.run import RunConfig
from rollflow.generators.checkpoints import Checkpoint, CheckpointError
from rollflow.policy.models import ModelRef, load_causal_lm, resolve_device


def base_model_ref(config: RunConfig) -> ModelRef:
    model = config.model
    return ModelRef(path=model.path, gguf_file=model.gguf_file, adapter=model.adapter)


def policy_model_ref(config: RunConfig, checkpoint: Checkpoint | None) -> ModelRef:
    """What to load to act as ``checkpoint``'s policy version (the base model for None)."""
    if checkpoint is None:
        return base_model_ref(config)
    if checkpoint.use_lora:
        base = base_model_ref(config)
        return ModelRef(path=base.path, gguf_file=base.gguf_file, adapter=str(checkpoint.path))
    return ModelRef(path=str(checkpoint.path))


def torch_dtype(config: RunConfig) -> torch.dtype:
    """``[model].dtype`` as a torch dtype; ``"auto"`` resolved for this process's device."""
    if config.model.dtype == "auto":
        return auto_dtype(torch_device(config))
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        config.model.dtype
    ]


def torch_device(config: RunConfig) -> torch.device:
    """``[model].device`` resolved on this machine (``rollflow.policy.models.resolve_device``)."""
    return resolve_device(config.model.device)


def auto_dtype(device: torch.device | None = None) -> torch.dtype:
    """bfloat16 where the device runs it natively, else float32.

    A CUDA device: bfloat16 when it supports it (Ampere and later). The CPU: bfloat16 where
    oneDNN runs it natively (AVX-512 or AMX). Without that path PyTorch falls back to its
    single-threaded reference kernels, far slower than float32 (``bench/dtype_bench.py``
    measures a machine).
    """
    if device is not None and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a PyTorch build without oneDNN (or this probe)
        native = False
    return torch.bfloat16 if native else torch.float32


def training_dtype(config: RunConfig) -> torch.dtype:
    """The dtype the trainer holds the policy in: float32 for full weights, always.

    AdamW's step on a bfloat16 weight rounds away any update smaller than 1/512 to 1/256
    of the weight (8 significant bits): at lr 2e-5 most weights never move (92% of the
    tiny test model's after 5 steps). So full-weight
    training keeps float32 weights (and saves them: a checkpoint is the master copy,
    which resume reloads exactly), and ``[model].dtype`` applies when a policy is loaded
    to act (``policy_model_ref`` + ``torch_dtype``, a cast). With LoRA the frozen base
    stays in ``[model].dtype``: peft keeps the trained adapter weights in float32 anyway.
    """
    return torch_dtype(config) if config.train.use_lora else torch.float32


def load_policy_for_training(
    config: RunConfig, checkpoint: Checkpoint | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy to update: the checkpoint's weights, trainable; a fresh LoRA at version 0."""
    if checkpoint is not None and checkpoint.use_lora != config.train.use_lora:
        raise CheckpointError(
            f"{checkpoint.path} was saved with use_lora={checkpoint.use_lora} but the config "
            f"says [train].use_lora = {config.train.use_lora}"
        )
    ref = policy_model_ref(config, checkpoint)
    model, tokenizer = load_causal_lm(
        ref, training_dtype(config), adapter_trainable=True, device=torch_device(config)
    )
    if config.train.use_lora and checkpoint is None and ref.adapter is None:
        model = _fresh_lora(model, config)
    if not config.train.use_lora:
        if hasattr(model, "merge_and_unload"):  # a starting adapter, folded into the weights
            model = model.merge_and_unload()
        model.requires_grad_(True)
    if config.train.gradient_checkpointing:
        # transformers 5.2x renamed it; the other name still works but warns
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
        if config.train.use_lora:
            model.enable_input_require_grads()
    return model, tokenizer


def fresh_lora_policy(config: RunConfig) -> PreTrainedModel:
    """Version 0 of a LoRA run as the trainer builds it: the base model and a fresh adapter
    seeded by ``[train].seed`` (B = 0, so it acts exactly as the base model)."""
    model, _ = load_causal_lm(
        base_model_ref(config), training_dtype(config), adapter_trainable=True, device=torch_device(config)
    )
    return _fresh_lora(model, config)


def _fresh_lora(model: PreTrainedModel, config: RunConfig) -> PreTrainedModel:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.train.lora_rank,
        lora_alpha=config.train.lora_alpha,
        lora_dropout=config.train.lora_dropout,
        target_modules=list(config.train.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(config.train.seed)  # LoRA's A matrices are random: fix them
    return get_peft_model(model, lora)
