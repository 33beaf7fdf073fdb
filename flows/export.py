"""``rollflow export``: a trained policy as a folder a server (vLLM) or transformers loads.

``export_policy(run_dir, out, step=None, merged=False)`` reads one checkpoint of a run
(the newest by default; ``checkpoints/step=N`` holds the policy *after* training step N)
and writes ``out``:

- LoRA run, default: a peft adapter folder (``adapter_model.safetensors``,
  ``adapter_config.json``) whose ``base_model_name_or_path`` is the absolute path of the
  base model folder (for a GGUF base, its dequantized safetensors copy in the rollflow
  cache). vLLM serves it on its base (``--model BASE --enable-lora --lora-modules
  policy=OUT --max-lora-rank R``); peft loads it with
  ``AutoPeftModelForCausalLM.from_pretrained(OUT)``.
- LoRA run, ``merged=True``: the base with the adapter folded in (peft's
  ``merge_and_unload``), a plain Hugging Face folder in safetensors, in the run's dtype:
  vLLM serves it with ``--model OUT``.
- Full-weight run: the checkpoint already is a whole model folder, so its weights are
  copied (``merged`` is implied) without the training state (optimizer, RNG, results).

Every export carries the tokenizer files and the chat template (``tokenizer.save_pretrained``
of the run's tokenizer), ``export.json`` saying which run, step and policy version it
holds and the line that starts a vLLM server on it (``ExportResult.serve``: vLLM for CPU,
the trained policy served as ``policy``), and, for an environment with tools, what
serving needs to match training: the system text with the tool descriptions, the tool
specs and ``SERVING.md`` (``flows/export_serving.py``: the policy read its tools in its
system message, never through the template's ``tools=``). An agent environment's export
has ``SERVING.md`` alone: its tools are the agent's own ``tools=``, and the guide names the
tool-call format the capture endpoint used (a family's is vLLM's ``--tool-call-parser``,
added to the server line).

The folder is written under a hidden temporary name next to ``out`` and renamed into place
whole; an ``out`` that exists and is not empty is refused, never overwritten.

Simplified, and why: one checkpoint per export (no averaging); the merged weights are
saved in the run's ``[model].dtype``, since that is what the policy was trained and
sampled in.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rollflow.config.run import RunConfig, load_config
from rollflow.flows.export_serving import (
    SERVED_POLICY,
    ServeCommand,
    serve_command,
    serving_plan,
    write_serving_files,
)
from rollflow.generators.checkpoints import (
    OPTIMIZER_FILE,
    RESULT_FILE,
    RNG_FILE,
    VERSION_FILE,
    Checkpoint,
    latest_checkpoint,
    read_checkpoint,
)
from rollflow.generators.models import base_model_ref, policy_model_ref, torch_dtype
from rollflow.policy.models import load_causal_lm, load_tokenizer
from rollflow.policy.vllm_spec import VLLMServerError
from rollflow.storage.filemodes import give_ordinary_modes
from rollflow.storage.parquet import temporary_path
from rollflow.storage.runfolder import RunFolder

EXPORT_FILE = "export.json"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
TRAINING_STATE = frozenset({OPTIMIZER_FILE, RNG_FILE, RESULT_FILE, VERSION_FILE})


class ExportError(ValueError):
    """The run, the step or the output folder cannot give an export; the message says which."""


@dataclass(frozen=True)
class ExportResult:
    out: str
    run_dir: str
    step: int
    policy_version: int
    format: str  # "adapter" | "merged" | "weights" (a full-weight run's copy)
    base_model: str | None  # the folder an adapter goes on top of; None for whole models
    lora_rank: int | None
    serve: str = ""  # the shell line that starts a vLLM server on it (export_serving.serve_command)
    served_model: str = SERVED_POLICY  # the model name a client of that server asks for

    @property
    def is_adapter(self) -> bool:
        return self.format == "adapter"


def export_policy(run_dir: str | Path, out: str | Path, step: int | None = None, merged: bool = False) -> ExportResult:
    """Write checkpoint ``step`` (default: the newest) of ``run_dir`` to ``out``."""
    folder = RunFolder(run_dir)
    config = _run_config(folder)
    checkpoint = find_checkpoint(folder, step)
    final = _checked_out(Path(out))
    tmp = temporary_path(final)
    tmp.mkdir(parents=True)
    try:
        result = _write_export(config, folder, checkpoint, tmp, final, merged)
        plan = serving_plan(config, tmp)  # read from the exported tokenizer's chat template
        served = served_by(config, result, tool_parser=plan.tool_parser)
        result = replace(result, serve=served.text(), served_model=served.model)
        (tmp / EXPORT_FILE).write_text(json.dumps(asdict(result), indent=1) + "\n")
        write_serving_files(config, tmp, served, result.run_dir, plan)
        give_ordinary_modes(tmp)  # safetensors writes 0600, and copy2 keeps a mode
        if final.exists():
            final.rmdir()  # empty, checked above
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def served_by(config: RunConfig, result: ExportResult, tool_parser: str | None = None) -> ServeCommand:
    """The vLLM server that serves ``result``: a whole model, or the adapter on its base;
    with ``tool_parser``, reading tool calls as an agent environment's endpoint did."""
    if not result.is_adapter:
        return serve_command(config, result.out, tool_parser=tool_parser)
    assert result.base_model is not None, "an adapter export names its base"
    try:
        return serve_command(config, result.base_model, adapter_dir=result.out, lora_rank=result.lora_rank,
                             tool_parser=tool_parser)  # fmt: skip
    except VLLMServerError as error:  # a rank above vLLM's largest --max-lora-rank
        raise ExportError(f"{error}: vLLM cannot serve this adapter; export it with --merged") from None


def find_checkpoint(folder: RunFolder, step: int | None) -> Checkpoint:
    """Checkpoint ``step`` of the run, or its newest; an ``ExportError`` when there is none."""
    found = folder.checkpoints()
    if not found:
        raise ExportError(
            f"{folder.root} has no checkpoint: no training step has finished yet "
            "(an SFT run's policy is its sft/policy folder, already loadable)"
        )
    if step is None:
        checkpoint = latest_checkpoint(folder)
        assert checkpoint is not None
        return checkpoint
    paths = dict(found)
    if step not in paths:
        steps = ", ".join(str(s) for s, _ in found)
        raise ExportError(f"{folder.root} has no checkpoint for step {step}; it has steps {steps}")
    return read_checkpoint(paths[step])


def base_model_folder(config: RunConfig) -> Path:
    """The Hugging Face folder of the run's base model (a GGUF base's cached copy)."""
    # The private resolvers are the loader's own: the exact folder training loaded.
    from rollflow.policy.models import _cached_gguf_model, _gguf_path, _hf_folder

    ref = base_model_ref(config)
    gguf = _gguf_path(ref)
    return (_cached_gguf_model(gguf) if gguf is not None else _hf_folder(ref)).resolve()


def _run_config(folder: RunFolder) -> RunConfig:
    if not folder.config_path.is_file():
        raise ExportError(f"{folder.root} is not a run folder (no config.toml)")
    return load_config(folder.config_path, frozen=True)


def _checked_out(out: Path) -> Path:
    out = out.absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not an empty folder; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _write_export(
    config: RunConfig, folder: RunFolder, checkpoint: Checkpoint, tmp: Path, final: Path, merged: bool
) -> ExportResult:
    fields = {"out": str(final), "run_dir": str(folder.root), "step": checkpoint.step,
              "policy_version": checkpoint.policy_version}
    if not checkpoint.use_lora:
        _copy_weights(checkpoint.path, tmp)
        return ExportResult(**fields, format="weights", base_model=None, lora_rank=None)
    rank = int(json.loads((checkpoint.path / "adapter_config.json").read_text())["r"])
    if merged:
        _write_merged(config, checkpoint, tmp)
        return ExportResult(**fields, format="merged", base_model=None, lora_rank=rank)
    base = base_model_folder(config)
    _write_adapter(checkpoint.path, tmp, base)
    load_tokenizer(base_model_ref(config)).save_pretrained(str(tmp))
    return ExportResult(**fields, format="adapter", base_model=str(base), lora_rank=rank)


def _copy_weights(checkpoint_dir: Path, dest: Path) -> None:
    """A full-weight checkpoint is a model folder with its tokenizer: all but the training state."""
    for item in checkpoint_dir.iterdir():
        if item.name in TRAINING_STATE:
            continue
        if item.is_dir():
            shutil.copytree(item, dest / item.name)
        else:
            shutil.copy2(item, dest / item.name)


def _write_adapter(checkpoint_dir: Path, dest: Path, base: Path) -> None:
    for name in ADAPTER_FILES:
        if not (checkpoint_dir / name).is_file():
            raise ExportError(f"{checkpoint_dir} has no {name}: not a LoRA checkpoint")
    shutil.copy2(checkpoint_dir / "adapter_model.safetensors", dest / "adapter_model.safetensors")
    adapter_config = json.loads((checkpoint_dir / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(base)  # absolute: loadable from anywhere
    (dest / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")


def _write_merged(config: RunConfig, checkpoint: Checkpoint, dest: Path) -> None:
    model, tokenizer = load_causal_lm(policy_model_ref(config, checkpoint), torch_dtype(config))
    merged = model.merge_and_unload()  # (peft) the LoRA deltas added into the base weights
    merged.save_pretrained(str(dest), safe_serialization=True)
    tokenizer.save_pretrained(str(dest))
