"""Full-weight checkpoints as vLLM and transformers read them (generators/checkpoints.py)."""

from __future__ import annotations

import json
import subprocess
from functools import partialmethod
from pathlib import Path

import pytest
import torch

from rollflow.generators.checkpoints import save_checkpoint
from rollflow.policy.models import ModelRef, load_causal_lm
from rollflow.policy.vllm_spec import DEFAULT_PYTHON
from rollflow.policy.vllm_weights import LM_HEAD_SHARD
from rollflow.storage.records import TrainResult
from rollflow.storage.runfolder import RunFolder


def _vllm_loads(folder: Path) -> list[str]:
    """The weight files vLLM's own loader keeps for ``folder`` (run in the vLLM Python)."""
    script = (
        "import glob, json, os, sys\n"
        "from vllm.model_executor.model_loader.weight_utils import filter_duplicate_safetensors_files\n"
        "files = sorted(glob.glob(os.path.join(sys.argv[1], '*.safetensors')))\n"
        "kept = filter_duplicate_safetensors_files(files, sys.argv[1], 'model.safetensors.index.json')\n"
        "print(json.dumps(sorted(os.path.basename(f) for f in kept)))\n"
    )
    done = subprocess.run([str(DEFAULT_PYTHON), "-c", script, str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not DEFAULT_PYTHON.is_file(), reason="needs the vLLM Python (make vllm-setup)")
@pytest.mark.slow  # 10 s in a loaded suite run (docs/testing.md)
def test_a_sharded_full_weight_checkpoint_of_a_tied_model_indexes_its_lm_head_shard(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B9: save_checkpoint's lm_head shard was outside the index, so vLLM's loader dropped it
    (a checkpoint shards above transformers' max_shard_size; 4 MB here, 50 GB by default)."""
    model, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    monkeypatch.setattr(type(model), "save_pretrained", partialmethod(type(model).save_pretrained, max_shard_size="4MB"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = TrainResult(
        run_id="r", step=0, policy_version=1, loss=0.0, kl=None, clip_fraction=0.0, grad_norm=0.0,
        num_samples=1, num_tokens=1, num_action_tokens=1, learning_rate=1e-3, tokens_per_s=1.0,
    )  # fmt: skip
    checkpoint = save_checkpoint(RunFolder(tmp_path / "run"), model, tokenizer, optimizer, result, use_lora=False)
    index = json.loads((checkpoint.path / "model.safetensors.index.json").read_text())
    assert len(list(checkpoint.path.glob("model-*.safetensors"))) > 1, "the checkpoint was not sharded"
    assert index["weight_map"]["lm_head.weight"] == LM_HEAD_SHARD
    assert LM_HEAD_SHARD in _vllm_loads(checkpoint.path)
    reloaded, _ = load_causal_lm(ModelRef(path=str(checkpoint.path)))  # transformers reads it too
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
