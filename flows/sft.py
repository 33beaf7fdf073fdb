"""The SFT flow: warm-start a policy on expert transcripts before GRPO (``rollflow sft``).

One stage (``tasks/sft.py``) in a run folder of its own: the config is frozen as
``config.toml``, the policy lands in ``<run_dir>/sft/policy/`` and MLflow gets ``sft/loss``
per epoch. Running the flow again on the same folder returns the finished policy.

``preview_sft`` is ``rollflow sft CONFIG --preview N``: the first N rows as the model reads
them, the trained tokens marked, and nothing trained (no model, no run folder, no Prefect).

What to put in the training config afterwards (``start_from``):
- LoRA (``[train].use_lora = true``, the default): ``[model].adapter = "<policy folder>"``,
  keeping the same ``[model].path``; GRPO then trains that adapter further.
- Full weights: ``[model].path = "<policy folder>"`` (a Hugging Face folder).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollflow.config.run import RunConfig, load_config
from rollflow.flows.concurrency import one_training_at_a_time
from rollflow.flows.runs import freeze_config
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.runs import mark_run_kind
from rollflow.tasks.sft import log_sft_metrics, policy_dir, read_sft_result, sft_examples, sft_rows, sft_stage
from rollflow.tasks.sft_rows import TRAINED_MARKS, bare_answer_note, render_row
from rollflow.tasks.tracking import finish_tracking, start_tracking


@task(name="sft", task_run_name="sft", cache_policy=NO_CACHE, persist_result=False)
def supervised_finetune(config: RunConfig, out_policy: Path) -> Path:
    return sft_stage(config, out_policy)


def start_from(config: RunConfig, policy: Path) -> str:
    """The TOML lines that make a training run start from ``policy``."""
    where = str(policy.resolve())
    if config.train.use_lora:
        return f'[model]\nadapter = "{where}"  # with the same [model].path as the SFT config'
    return f'[model]\npath = "{where}"'


@flow(name="rollflow-sft")
def sft_flow(config_path: str, run_dir: str | None = None) -> str:
    """Run SFT from ``config_path`` into ``run_dir`` (default: a new folder under
    ``[storage].runs_dir``); returns the policy folder."""
    config = load_config(config_path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(run_dir) if run_dir else Path(config.storage.runs_dir) / f"sft-{Path(config_path).stem}-{stamp}"
    folder = RunFolder(root)
    freeze_config(folder, config)
    mark_run_kind(root, "sft")
    start_tracking(config, root)
    succeeded = False
    try:
        with one_training_at_a_time(f"sft {root.name}"):
            policy = supervised_finetune(config, policy_dir(root))
        log_sft_metrics(config, root, read_sft_result(policy))
        succeeded = True
    finally:
        finish_tracking(config, root, succeeded)
    get_run_logger().info("SFT policy in %s; to train from it:\n%s", policy, start_from(config, policy))
    return str(policy)


def describe_sft(policy: Path) -> str:
    """What ``rollflow sft`` prints: the rows, the losses, and how to train from the policy."""
    result = read_sft_result(policy)
    losses = " -> ".join(f"{loss:.4f}" for loss in result.epoch_losses)
    config = load_config(policy.parent.parent / "config.toml")
    return (
        f"sft policy {policy}\n"
        f"  rows {result.rows} (skipped as too long: {result.skipped_too_long}), "
        f"trained tokens {result.trained_tokens} of {result.tokens}\n"
        f"  loss per epoch {losses}  ({result.optimizer_steps} steps, {result.seconds:.1f}s)\n"
        f"to start GRPO from it, put in the training config:\n{start_from(config, policy)}\n"
    )


def preview_sft(config_path: str, count: int) -> str:
    """The first ``count`` SFT rows of ``config_path`` as text, trained tokens marked."""
    from rollflow.generators.models import base_model_ref
    from rollflow.policy.codec import ChatCodec
    from rollflow.policy.models import ModelRef, hf_model_folder, load_tokenizer, stop_token_ids

    config = load_config(config_path)
    examples = sft_examples(config, count)
    base = base_model_ref(config)
    tokenizer = load_tokenizer(ModelRef(path=base.path, gguf_file=base.gguf_file))
    codec = ChatCodec(tokenizer, stop_token_ids=stop_token_ids(hf_model_folder(base)))  # as the trainer's
    rows, skipped = sft_rows(config, codec, examples)
    source = config.sft.transcripts or config.env.name
    lines = [f"sft rows of {source}: the first {len(examples)}; trained tokens are between "
             f"{TRAINED_MARKS[0]} and {TRAINED_MARKS[1]}"]
    for number, row in enumerate(rows, start=1):
        lines += [f"--- row {number} {row.row_id}: {len(row.input_ids)} tokens, {row.num_trained} trained",
                  render_row(codec, row)]
    if skipped:
        lines.append(f"({skipped} more longer than [rollout].max_model_length = "
                     f"{config.rollout.max_model_length} tokens: skipped, as training would)")
    note = bare_answer_note(config.env.name, examples)
    return "\n".join([*lines, *([note] if note else []), "preview only: nothing was trained"]) + "\n"
