"""The untied serving copy of a tied model (``untied_serving_folder``) follows the model's
content: a model rewritten in place, or a copy made before copies carried a fingerprint, is
never served stale; a model in a read-only folder gets its copy under the cache. No vLLM."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import rollflow.policy.vllm_weights as vllm_weights
from rollflow.policy.models import build_tiny_model
from rollflow.policy.vllm_weights import LM_HEAD_SHARD, untied_serving_folder

EMBED = "model.embed_tokens.weight"


def _embedding(folder: Path) -> torch.Tensor:
    return load_file(str(folder / "model.safetensors"))[EMBED]


def _lm_head(folder: Path) -> torch.Tensor:
    return load_file(str(folder / LM_HEAD_SHARD))["lm_head.weight"]


def _rewrite_in_place(model_dir: Path) -> torch.Tensor:
    """A new SFT saved into the same folder: same files, same sizes, new weights."""
    weights = load_file(str(model_dir / "model.safetensors"))
    weights[EMBED] = weights[EMBED] + 1.0
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return weights[EMBED]


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return build_tiny_model(tmp_path / "models" / "tiny")


def test_the_copy_follows_a_model_rewritten_in_place(tiny: Path) -> None:
    first = untied_serving_folder(tiny)
    assert torch.equal(_lm_head(first), _embedding(tiny))
    assert untied_serving_folder(tiny) == first, "an unchanged model reuses its copy"

    new_embedding = _rewrite_in_place(tiny)
    served = untied_serving_folder(tiny)

    assert served != first
    assert torch.equal(_embedding(served), new_embedding), "the served copy has the new weights"
    assert torch.equal(_lm_head(served), new_embedding), "and the new output layer"
    assert not json.loads((served / "config.json").read_text())["tie_word_embeddings"]


def test_a_copy_made_without_a_fingerprint_is_not_served(tiny: Path) -> None:
    legacy = tiny.with_name("tiny-untied")  # what rollflow made before: the stale weights
    shutil.copytree(tiny, legacy)
    stale = torch.zeros_like(_embedding(tiny))
    save_file({EMBED: stale}, str(legacy / "model.safetensors"))
    save_file({"lm_head.weight": stale}, str(legacy / LM_HEAD_SHARD))

    served = untied_serving_folder(tiny)

    assert served != legacy and served.name.startswith("tiny-untied-")
    assert torch.equal(_lm_head(served), _embedding(tiny))


def test_a_read_only_model_folder_gets_its_copy_in_the_cache(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLFLOW_CACHE", str(tmp_path / "cache"))
    store = tiny.parent
    store.chmod(0o555)
    try:
        if os.access(store, os.W_OK):  # root: chmod does not stop its writes, so say it is read-only
            monkeypatch.setattr(vllm_weights, "_writable", lambda folder: Path(folder) != store, raising=False)
        served = untied_serving_folder(tiny)
        assert served.parent == tmp_path / "cache" / "untied"
        assert sorted(p.name for p in store.iterdir()) == ["tiny"], "no copy, no lock file beside the model"
        assert torch.equal(_lm_head(served), _embedding(tiny))
        assert untied_serving_folder(tiny) == served
    finally:
        store.chmod(0o755)
