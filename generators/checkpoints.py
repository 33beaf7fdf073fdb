"""Policy checkpoints: what a policy version is on disk, its RNG state, and pruning.

The generator's room, shared with the stages: the train stage writes a checkpoint after each
update; the generator serves the newest one to act with (``generators/models.py`` says what
to load for it). The train stage that finishes step ``s`` commits ``checkpoints/step=s/``
holding policy version ``v + 1`` (version 0 is the base model)::

    adapter_model.safetensors, adapter_config.json   with LoRA (peft's save_pretrained)
    model.safetensors, config.json, tokenizer files  with full weights (a loadable HF folder)
    optimizer.pt       the optimizer's state_dict (torch.save; loaded with weights_only=True)
    rng.json           torch, Python ``random`` and numpy generator states
    version.json       {"policy_version", "step", "use_lora", "format"}
    train_result.json  the step's TrainResult, so train.json can be rewritten after a crash

A checkpoint is saved into a hidden temporary folder and renamed into place whole
(``RunFolder.commit_checkpoint``), so a checkpoint folder that exists is complete.

Simplified: RNG state is stored as JSON lists (no pickle); the optimizer state uses
``torch.save`` since its nested dict has no safetensors layout, and is read back with
``weights_only=True`` so loading it runs no code.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollflow.policy.procs import fault_point
from rollflow.policy.vllm_weights import write_lm_head_shard
from rollflow.storage.parquet import temporary_path
from rollflow.storage.records import TrainResult
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import train_result_from_json, train_result_to_json

# peft calls a transformers method deprecated in 5.x on every LoRA load; not ours to fix.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

VERSION_FILE = "version.json"
RNG_FILE = "rng.json"
OPTIMIZER_FILE = "optimizer.pt"
RESULT_FILE = "train_result.json"
# peft's name for the adapter a peft model loads or creates first: the trained one.
TRAINED_ADAPTER = "default"
# A frozen copy of the starting adapter, the KL reference of a warm start (tasks/train.py).
REFERENCE_ADAPTER = "kl_reference"


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing a file or does not match the config."""


@dataclass(frozen=True)
class Checkpoint:
    step: int  # the training step that wrote it
    policy_version: int
    path: Path
    use_lora: bool


def read_checkpoint(path: Path) -> Checkpoint:
    try:
        info = json.loads((path / VERSION_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable {VERSION_FILE}: {error}") from error
    return Checkpoint(int(info["step"]), int(info["policy_version"]), path, bool(info["use_lora"]))


def latest_checkpoint(folder: RunFolder, before_step: int | None = None) -> Checkpoint | None:
    """The newest committed checkpoint (written by a step < ``before_step`` when given)."""
    found = [(s, p) for s, p in folder.checkpoints() if before_step is None or s < before_step]
    return read_checkpoint(found[-1][1]) if found else None


def save_checkpoint(
    folder: RunFolder,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    result: TrainResult,
    use_lora: bool,
) -> Checkpoint:
    """Write and commit ``checkpoints/step=<result.step>/`` (all or nothing)."""
    tmp = folder.new_checkpoint_tmp(result.step)
    try:
        # peft: the trained adapter only (not a frozen reference); else the whole model
        adapters = {"selected_adapters": [TRAINED_ADAPTER]} if use_lora else {}
        model.save_pretrained(str(tmp), **adapters)
        fault_point("checkpoint_write")  # tests: a kill with the checkpoint half written
        if not use_lora:
            tokenizer.save_pretrained(str(tmp))  # a full-weight checkpoint is a whole HF folder
            if getattr(model.config, "tie_word_embeddings", False):  # for vLLM's in-place reload
                write_lm_head_shard(tmp, model.get_input_embeddings().weight)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        (tmp / RNG_FILE).write_text(json.dumps(capture_rng_state()))
        (tmp / RESULT_FILE).write_text(json.dumps(train_result_to_json(result)))
        version = {"policy_version": result.policy_version, "step": result.step,
                   "use_lora": use_lora, "format": "adapter" if use_lora else "weights"}
        (tmp / VERSION_FILE).write_text(json.dumps(version))
        final = folder.commit_checkpoint(tmp, result.step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Checkpoint(result.step, result.policy_version, final, use_lora)


def load_optimizer_state(optimizer: torch.optim.Optimizer, checkpoint: Checkpoint) -> None:
    # on the CPU first: load_state_dict moves each state to its parameter's device
    state = torch.load(checkpoint.path / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
    optimizer.load_state_dict(state)


def checkpoint_train_result(checkpoint: Checkpoint) -> TrainResult:
    return train_result_from_json(json.loads((checkpoint.path / RESULT_FILE).read_text()))


# ---------------------------------------------------------------- retention

# The policy versions this process still reads from a run's checkpoints, by run folder:
# an async generator registers what it serves and publishes (``reading_versions``).
_VERSIONS_READ: dict[Path, list[Callable[[], set[int]]]] = {}


@contextmanager
def reading_versions(folder: RunFolder, versions: Callable[[], set[int]]) -> Iterator[None]:
    """While open, ``checkpoints_to_keep`` spares the checkpoints of ``versions()``."""
    readers = _VERSIONS_READ.setdefault(folder.root.resolve(), [])
    readers.append(versions)
    try:
        yield
    finally:
        readers.remove(versions)


def checkpoints_to_keep(folder: RunFolder, keep: int) -> set[int]:
    """The steps whose checkpoints the run still needs; every other one may go.

    - The newest ``keep`` (``[train].keep_checkpoints``): training continues from the
      newest, and a lockstep resume needs nothing else (a step's rollout is on disk
      before its training).
    - An async resume: it starts at the first step without ``metrics.json``, and when that
      step already admitted its groups (its train stage may be done, its checkpoint
      committed) its generator serves that step's version, the checkpoint before it.
    - What this process still reads: an async generator's loaded LoRA adapters (a running
      group samples them, and vLLM re-reads an evicted adapter's folder) and a
      publication in flight (``reading_versions``).
    """
    from rollflow.storage.async_groups import admission_path

    found = folder.checkpoints()
    needed = {step for step, _ in found[-keep:]}  # keep >= 1 ([train] checks it)
    first = folder.next_step()
    if first > 0 and admission_path(folder, first).exists():
        needed.add(first - 1)
    read = {v for versions in _VERSIONS_READ.get(folder.root.resolve(), []) for v in versions()}
    if read:
        needed |= {step for step, path in found if read_checkpoint(path).policy_version in read}
    return needed


def prune_checkpoints(folder: RunFolder, keep: int) -> list[Path]:
    """Delete the checkpoints the run no longer needs (``checkpoints_to_keep``); renamed
    away first, then removed, so a crash mid-delete leaves a temporary (discarded on
    resume), never a torn checkpoint."""
    removed: list[Path] = []
    needed = checkpoints_to_keep(folder, keep)
    for step, path in folder.checkpoints():
        if step in needed:
            continue
        doomed = temporary_path(path)
        path.rename(doomed)
        shutil.rmtree(doomed)
        removed.append(path)
    return removed


# ---------------------------------------------------------------- RNG state


def capture_rng_state() -> dict[str, Any]:
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state().tolist(),
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np.asarray(np_keys).tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


def load_rng_state(checkpoint: Checkpoint) -> None:
    restore_rng_state(json.loads((checkpoint.path / RNG_FILE).read_text()))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
