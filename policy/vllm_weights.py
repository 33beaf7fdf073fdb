"""Model folders a vLLM server reloads in place: untied output layers, merged adapters.

vLLM 0.32's in-place reload (``reload_weights``) keeps the old output layer of a model
whose output layer is tied to its input embedding: the reload writes the embedding into
new storage and puts the old tensor back under ``lm_head`` (the served logprobs were
new-embedding / old-head's within 1e-6). So a server whose weights are swapped in place
loads an untied copy of the base model (``untied_serving_folder``), and every folder
reloaded into it carries the tied matrix as a shard of its own (``write_lm_head_shard``):
full-weight checkpoints, a merged start, a LoRA version merged into the base
(``save_serving_folder``, ``merge_adapter``).

Merging is done in float32 whatever the run's dtype: the served weights are then the
peft model's own sums, and the server runs float32 (``rollflow.policy.vllm_spec``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rollflow.policy.models import ModelRef

LM_HEAD_SHARD = "lm_head.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
UNTIED_FORMAT = 2  # bump when the untied copy's layout changes: every older copy is rebuilt


class ServingFolderError(RuntimeError):
    """A model folder cannot be made into one a vLLM server reloads in place."""


def is_tied(model_dir: Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def write_lm_head_shard(folder: Path, embedding: torch.Tensor) -> Path:
    """``lm_head.weight`` as a shard of its own. Without an index vLLM's loader reads every
    ``*.safetensors`` of the folder (and HF only ``model.safetensors``); a sharded folder's
    ``model.safetensors.index.json`` gets the shard in its ``weight_map``, since vLLM
    (``filter_duplicate_safetensors_files``) and HF read only the files it lists."""
    from safetensors.torch import save_file

    path = Path(folder) / LM_HEAD_SHARD
    weight = embedding.detach().to("cpu").contiguous().clone()
    save_file({"lm_head.weight": weight}, str(path))
    index_path = Path(folder) / SHARD_INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        index["weight_map"]["lm_head.weight"] = LM_HEAD_SHARD
        metadata = index.setdefault("metadata", {})
        if "total_size" in metadata:
            metadata["total_size"] = int(metadata["total_size"]) + weight.numel() * weight.element_size()
        index_path.write_text(json.dumps(index, indent=2))
    return path


def model_fingerprint(model_dir: Path) -> str:
    """A hash of what ``model_dir`` holds now: ``config.json``'s bytes and each file's name,
    size and modification time (ns), with ``UNTIED_FORMAT``. A folder whose weights are
    rewritten or replaced in place gets a new one; no weight is read (a stat per file)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256(f"untied-v{UNTIED_FORMAT}\n".encode())
    digest.update((model_dir / "config.json").read_bytes())
    for item in sorted(model_dir.iterdir()):
        if item.is_file():  # follows links: a Hugging Face snapshot's files point at blobs
            stat = item.stat()
            digest.update(f"\n{item.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def untied_copy_homes(model_dir: Path) -> tuple[Path, ...]:
    """Where untied copies of ``model_dir`` may live: beside it (a path every node that reads
    the model sees), then ``<cache>/untied`` (``$ROLLFLOW_CACHE``, for a read-only model store)."""
    from rollflow.policy.models import cache_root

    return (Path(model_dir).parent, cache_root() / "untied")


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def untied_serving_folder(model_dir: Path) -> Path:
    """``model_dir`` itself, or for a tied model a copy with ``tie_word_embeddings`` off and
    the output layer as its own shard: what a server reloaded in place loads.

    The copy is named by ``model_fingerprint`` (``<model>-untied-<16 hex>``), so a model
    changed in place, or a copy made by an older rollflow (``<model>-untied``, no
    fingerprint), is never served: a new copy is built, atomically and once however many
    processes ask (``build_atomically``). It goes beside the model when that folder is
    writable, else under the cache. Older copies are left alone (a running server may still
    read one); delete them when no run uses them.
    """
    model_dir = Path(model_dir)
    if not is_tied(model_dir):
        return model_dir
    from safetensors import safe_open

    from rollflow.policy.models import build_atomically

    fingerprint = model_fingerprint(model_dir)
    name = f"{model_dir.name}-untied-{fingerprint[:16]}"
    homes = untied_copy_homes(model_dir)
    for home in homes:
        if (home / name).is_dir():
            return home / name

    def build(tmp: Path) -> None:
        for item in model_dir.iterdir():
            if item.is_file():
                shutil.copy2(item, tmp / item.name)
        config = json.loads((model_dir / "config.json").read_text())
        config["tie_word_embeddings"] = False
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for shard in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as handle:
                if "model.embed_tokens.weight" in handle.keys():
                    write_lm_head_shard(tmp, handle.get_tensor("model.embed_tokens.weight"))
                    break
        else:
            raise ServingFolderError(f"{model_dir}: a tied model without model.embed_tokens.weight")
        if model_fingerprint(model_dir) != fingerprint:
            raise ServingFolderError(f"{model_dir} changed while its untied copy was made; run again")

    home = homes[0] if _writable(homes[0]) else homes[1]
    return build_atomically(home / name, build)


def save_serving_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> Path:
    """``model`` saved as a folder to reload in place, renamed into place whole; a folder
    already there is kept (a version's weights never change)."""
    from rollflow.policy.models import build_atomically

    def build(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if getattr(model.config, "tie_word_embeddings", False):
            write_lm_head_shard(tmp, model.get_input_embeddings().weight)

    return build_atomically(Path(target), build)


def merge_adapter(base: ModelRef, adapter: Path, target: Path) -> Path:
    """The base model of ``base`` with the LoRA ``adapter`` merged in, in float32, as a
    serving folder at ``target`` (``save_serving_folder``)."""
    import torch

    from rollflow.policy.models import ModelRef, load_causal_lm

    if Path(target).is_dir():
        return Path(target)
    ref = ModelRef(path=base.path, gguf_file=base.gguf_file, adapter=str(adapter))
    model, tokenizer = load_causal_lm(ref, torch.float32)
    return save_serving_folder(model.merge_and_unload(), tokenizer, target)
