"""SFT stage: a supervised warm-start on expert transcripts, with completion-only loss.

``sft_stage(config, out_policy)`` reads the rows (``tasks/sft_rows.py``: ``start_episode`` +
``sft_completion`` of the ``[env]`` environment, an agent environment's expert transcripts,
or the ``[sft].transcripts`` file),
tokenises them with the policy's chat codec, trains ``[sft].epochs`` passes, and writes
the policy to ``out_policy`` (the flow's is ``<run_dir>/sft/policy/``, ``policy_dir``), as
the other stages write the paths they are given. Rows from an environment without its own
``sft_completion`` train on the bare answer; the stage says so in one line first.

- with ``[train].use_lora`` (the default) a peft adapter folder: start GRPO from it with
  ``[model].adapter = "<out_policy>"`` (and the same ``[model].path``);
- with full weights a Hugging Face model folder (weights and tokenizer): start GRPO from
  it with ``[model].path = "<out_policy>"``.

``sft.json`` inside that folder records the rows, tokens, per-epoch losses and timings.
The folder is written under a temporary name and renamed into place whole, so one that
exists is finished: running the stage again returns it.

The loss is the mean negative log-likelihood over every trained token of the batch
(``loss_mask == 1``: the whole target transcript, never the prompt). Like the GRPO
trainer it divides by whole-batch totals, so micro-batches (packed under
``[train].max_tokens_per_microbatch`` padded tokens) sum to the batch's loss.

Simplified on purpose: AdamW at a constant learning rate without weight decay or warm-up;
rows longer than ``[rollout].max_model_length`` are skipped (and counted), since GRPO
could never play them; no validation loss (the evaluation flow measures the policy).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollflow.config.run import RunConfig
from rollflow.generators.checkpoints import seed_everything
from rollflow.generators.models import load_policy_for_training
from rollflow.policy.codec import ChatCodec
from rollflow.policy.models import generation_stop_ids
from rollflow.policy.stopping import raise_if_stop_requested, stop_points_in_backward
from rollflow.storage.filemodes import give_ordinary_modes
from rollflow.storage.parquet import is_temporary, remove_temporaries, temporary_path
from rollflow.tasks.sft_rows import (
    SFTDataError,
    SFTExample,
    SFTRow,
    bare_answer_note,
    examples_from_environment,
    examples_from_file,
    tokenize_example,
)
from rollflow.tasks.shared_prefix import first_trained, gradient_checkpointed, pack_by_prefix, plan_prefixes
from rollflow.tasks.trainer_logprobs import token_logprobs

SFT_DIR = "sft"
POLICY_DIR = "policy"
RESULT_FILE = "sft.json"


@dataclass(frozen=True)
class SFTResult:
    rows: int
    skipped_too_long: int
    tokens: int
    trained_tokens: int
    epoch_losses: tuple[float, ...]
    optimizer_steps: int
    use_lora: bool
    seconds: float


PROGRESS_EVERY_S = 30.0  # a line within an epoch at most this often


def policy_dir(run_dir: Path) -> Path:
    return Path(run_dir) / SFT_DIR / POLICY_DIR


def read_sft_result(path: Path) -> SFTResult:
    data = json.loads((Path(path) / RESULT_FILE).read_text())
    return SFTResult(**{**data, "epoch_losses": tuple(data["epoch_losses"])})


# ---------------------------------------------------------------- rows


def sft_examples(config: RunConfig, limit: int | None = None) -> list[SFTExample]:
    """The configured transcripts (the first ``limit`` of at most ``[sft].max_rows``)."""
    limits = [n for n in (config.sft.max_rows, limit) if n is not None]
    first = min(limits) if limits else None
    if config.sft.transcripts is not None:
        examples = examples_from_file(config.sft.transcripts, first)
    else:
        examples = examples_from_environment(config.env.name, config.env.kwargs, first,
                                             tokenizer=lambda: policy_tokenizer(config),
                                             max_turns=config.rollout.max_turns)  # fmt: skip
    if config.sft.assistant_only is None:
        return examples
    return [replace(example, assistant_only=config.sft.assistant_only) for example in examples]


def policy_tokenizer(config: RunConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of the policy SFT trains: an agent environment's expert transcripts are
    written in the tool-call format its chat template asks for (``examples_from_agent``)."""
    from rollflow.generators.models import base_model_ref
    from rollflow.policy.models import ModelRef, load_tokenizer

    base = base_model_ref(config)
    return load_tokenizer(ModelRef(path=base.path, gguf_file=base.gguf_file))


def sft_rows(
    config: RunConfig, codec: ChatCodec, examples: Sequence[SFTExample] | None = None
) -> tuple[list[SFTRow], int]:
    """The configured rows (or ``examples``) as tokens, and how many were skipped for being too long."""
    if examples is None:
        examples = sft_examples(config)
    rows = [tokenize_example(codec, example) for example in examples]
    kept = [row for row in rows if len(row.input_ids) <= config.rollout.max_model_length]
    if not kept:
        raise SFTDataError(
            f"all {len(rows)} SFT rows are longer than [rollout].max_model_length "
            f"({config.rollout.max_model_length} tokens)"
        )
    return kept, len(rows) - len(kept)


# ---------------------------------------------------------------- the loss


def pack_rows(rows: Sequence[SFTRow], max_tokens: int, shared_prefix: bool = False) -> list[list[SFTRow]]:
    """Longest first, greedily, while rows x longest row stays within ``max_tokens``; with
    ``shared_prefix`` while the positions the shared-prefix forward runs do
    (``pack_by_prefix``, every row one group: they share the system prompt)."""
    if shared_prefix:
        return pack_by_prefix(rows, lambda r: r.input_ids, lambda r: r.loss_mask, lambda r: None, max_tokens)
    batches: list[list[SFTRow]] = []
    for row in sorted(rows, key=lambda r: len(r.input_ids), reverse=True):
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0].input_ids) <= max_tokens:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches


def completion_nll(
    model: PreTrainedModel, rows: Sequence[SFTRow], pad_token_id: int, padding_mask: bool = False,
    shared_prefix: bool = False,
) -> torch.Tensor:
    """Summed negative log-likelihood of the rows' trained tokens (right-padded batch).

    Logits are computed only from the first position that predicts a trained token on
    (``logits_to_keep``): over a long masked prompt, the vocabulary projection is most of
    the cost. The model runs without an attention mask unless ``padding_mask`` (the path
    before issue 43): the rows are right-padded, so causal attention alone keeps every real
    token from the pads after it, and the pads' own (finite) outputs are multiplied by
    their 0 in the loss mask. ``shared_prefix``: the rows' common opening (the system prompt,
    up to the first trained token) runs once (``_shared_prefix_nll``).
    """
    if shared_prefix:
        return _shared_prefix_nll(model, rows, pad_token_id)
    width = max(len(r.input_ids) for r in rows)
    device = model.device
    input_ids_BT = torch.tensor(
        [list(r.input_ids) + [pad_token_id] * (width - len(r.input_ids)) for r in rows], device=device
    )
    attention_BT = torch.tensor([[1] * len(r.input_ids) + [0] * (width - len(r.input_ids)) for r in rows], device=device)
    mask_BT = torch.tensor(
        [list(r.loss_mask) + [0] * (width - len(r.loss_mask)) for r in rows], dtype=torch.float32, device=device
    )
    start = min(r.loss_mask.index(1) for r in rows) - 1  # position start predicts token start + 1
    assert start >= 0, "token 0 has nothing to predict it: a row's prompt must not be empty"
    attention = attention_BT if padding_mask else None
    logits_BKV = model(
        input_ids=input_ids_BT, attention_mask=attention, logits_to_keep=width - start, use_cache=False
    ).logits
    logits_BKV = logits_BKV[:, :-1].float()  # positions start .. T-2 predict tokens start+1 .. T-1
    nll_BK = torch.nn.functional.cross_entropy(
        logits_BKV.transpose(1, 2), input_ids_BT[:, start + 1 :], reduction="none"
    )
    return (nll_BK * mask_BT[:, start + 1 :]).sum()  # mask 0 = prompt or padding, never trained


def _shared_prefix_nll(model: PreTrainedModel, rows: Sequence[SFTRow], pad_token_id: int) -> torch.Tensor:
    """``completion_nll`` through the shared-prefix forward: the same sum within float32
    rounding (``chosen_logprobs`` at temperature 1 in place of ``cross_entropy``)."""
    width = max(len(r.input_ids) for r in rows)
    input_ids_BT = torch.tensor(
        [list(r.input_ids) + [pad_token_id] * (width - len(r.input_ids)) for r in rows], device=model.device
    )
    wanted_BT = torch.tensor(
        [list(r.loss_mask[1:]) + [0] * (width - len(r.loss_mask)) for r in rows], device=model.device
    ) > 0  # (B, T-1): token t is trained where loss_mask[t] is 1
    plan = plan_prefixes([r.input_ids for r in rows], [first_trained(r.loss_mask) for r in rows], [None] * len(rows))
    return -token_logprobs(model, input_ids_BT, plan, 1.0, wanted_BT).sum()


def mean_completion_loss(
    model: PreTrainedModel, rows: Sequence[SFTRow], pad_token_id: int, max_tokens: int = 4096
) -> float:
    """The mean NLL per trained token over ``rows``, without gradients (for checks)."""
    total, count = 0.0, sum(r.num_trained for r in rows)
    with torch.no_grad():
        for batch in pack_rows(rows, max_tokens):
            total += completion_nll(model, batch, pad_token_id).item()
    return total / count


def sft_update(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, rows: Sequence[SFTRow],
    pad_token_id: int, max_tokens: int, max_grad_norm: float, shared_prefix: bool = False,
) -> float:
    """One optimizer step on ``rows``; returns their mean loss per trained token.

    ``shared_prefix``: the rows of a micro-batch compute their common opening once (not
    under gradient checkpointing, whose layers would drop the prefix's cache).
    """
    trained = sum(r.num_trained for r in rows)
    assert trained > 0, "an SFT batch with no trained token"
    model.train()
    shared_prefix = shared_prefix and not gradient_checkpointed(model)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    with stop_points_in_backward(model):  # a stop lands within a layer's backward, not after the pass
        for batch in pack_rows(rows, max_tokens, shared_prefix):
            raise_if_stop_requested()  # SIGTERM: abandon the step; nothing of it is written
            # its share of the batch mean
            loss = completion_nll(model, batch, pad_token_id, shared_prefix=shared_prefix) / trained
            loss.backward()
            total += loss.item()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return total


# ---------------------------------------------------------------- the stage


def sft_stage(config: RunConfig, out_policy: Path) -> Path:
    """Train on the SFT rows and write the policy folder ``out_policy``; returns it."""
    final = Path(out_policy)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_temporaries([p for p in final.parent.glob(f".{final.name}*") if is_temporary(p)])  # a crash's
    started = time.perf_counter()
    examples = sft_examples(config)  # a bad environment or file fails before the model loads
    note = bare_answer_note(config.env.name, examples)
    if note:
        print(note, file=sys.stderr, flush=True)
    seed_everything(config.train.seed)
    model, tokenizer = load_policy_for_training(config, None)
    rows, skipped = sft_rows(config, ChatCodec(tokenizer, stop_token_ids=generation_stop_ids(model)), examples)
    losses, steps = train_epochs(config, model, rows, tokenizer.pad_token_id or 0, started)
    result = SFTResult(
        rows=len(rows), skipped_too_long=skipped, tokens=sum(len(r.input_ids) for r in rows),
        trained_tokens=sum(r.num_trained for r in rows), epoch_losses=tuple(losses),
        optimizer_steps=steps, use_lora=config.train.use_lora, seconds=time.perf_counter() - started,
    )
    return _commit_policy(final, model, tokenizer, result)


def train_epochs(
    config: RunConfig, model: PreTrainedModel, rows: Sequence[SFTRow], pad_token_id: int, started: float
) -> tuple[list[float], int]:
    """``[sft].epochs`` shuffled passes; returns each epoch's mean loss per trained token and
    the number of optimizer steps taken."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.sft.learning_rate, weight_decay=0.0)
    sft, train = config.sft, config.train
    losses: list[float] = []
    steps = 0
    for epoch in range(sft.epochs):
        order = list(rows)
        random.Random(f"{train.seed}/sft/{epoch}").shuffle(order)
        loss_sum, tokens = 0.0, 0
        said = time.perf_counter()
        for start in range(0, len(order), sft.batch_size):
            batch = order[start : start + sft.batch_size]
            loss = sft_update(model, optimizer, batch, pad_token_id, train.max_tokens_per_microbatch,
                              train.max_grad_norm, train.shared_prefix)
            batch_tokens = sum(r.num_trained for r in batch)
            loss_sum, tokens, steps = loss_sum + loss * batch_tokens, tokens + batch_tokens, steps + 1
            if time.perf_counter() - said >= PROGRESS_EVERY_S and start + sft.batch_size < len(order):
                said = time.perf_counter()  # an epoch of minutes is not silent
                print(f"  sft epoch {epoch + 1}/{sft.epochs}: {start + len(batch)}/{len(order)} rows, "
                      f"loss so far {loss_sum / tokens:.4f} ({said - started:.1f}s)", file=sys.stderr, flush=True)
        losses.append(loss_sum / tokens)
        print(f"  sft epoch {epoch + 1}/{sft.epochs}: loss {losses[-1]:.4f} "
              f"({time.perf_counter() - started:.1f}s)", file=sys.stderr, flush=True)
    return losses, steps


def log_sft_metrics(config: RunConfig, run_dir: Path, result: SFTResult) -> None:
    """Each epoch's loss as ``sft/loss`` at step = epoch, plus the totals at the last epoch."""
    if not config.tracking.enabled:
        return
    from rollflow.storage.tracking import RunTracker

    tracker = RunTracker.open(run_dir, experiment=config.tracking.experiment,
                              tracking_uri=config.tracking.tracking_uri)
    for epoch, loss in enumerate(result.epoch_losses):
        tracker.log_step(epoch, {"sft/loss": loss})
    tracker.log_step(len(result.epoch_losses) - 1, {
        "sft/rows": float(result.rows), "sft/trained_tokens": float(result.trained_tokens),
        "sft/skipped_too_long": float(result.skipped_too_long), "time/sft": result.seconds,
    })


def _commit_policy(
    final: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, result: SFTResult
) -> Path:
    """Save into a hidden temporary folder, then rename it into place whole."""
    tmp = temporary_path(final)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(str(tmp))  # peft: the adapter only; else the whole model
        if not result.use_lora:
            tokenizer.save_pretrained(str(tmp))  # a loadable HF folder for [model].path
        (tmp / RESULT_FILE).write_text(json.dumps(asdict(result), indent=2))
        give_ordinary_modes(tmp)  # safetensors writes 0600
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
