"""Models and batches for the update's exactness tests (issue 43): a faster path must give the
plain path's logprobs and gradients within float32 rounding.

- ``tiny_policy``: the session's tiny model (2 layers, 64 wide, the real tokenizer's vocabulary).
- ``bundled_shape_policy``: the bundled SmolLM2-135M's own config (hidden 576, 9 heads, 3 KV
  heads, head 64, vocabulary 49152, tied embeddings) with random weights and 2 layers
  of its 30, to stay fast; grouped-query attention is what the tiny model lacks.

Either comes as full weights (every parameter trained) or with a LoRA r16 on q, k, v, o
whose B matrices are random, so the adapter changes every key and value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from rollflow.policy.models import ModelRef, hf_model_folder, load_causal_lm
from rollflow.storage.records import SampleRecord

# of the bundled model's 30: two keep what the checks need (a layer's prefix keys and values
# computed from the layer below), at the same widths. One forward and backward, in CPU seconds
# on the loaded 2 cores: 4 layers 4.4-5.6 with LoRA, 4.7-4.9 full; 2 layers 3.4-3.5 and 0.6-1.1
BUNDLED_SHAPE_LAYERS = 2


def with_lora(model: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    lora = LoraConfig(r=16, lora_alpha=32.0, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)  # B = 0 would make the adapter (and its gradient path) trivial
    return model.eval()


def tiny_policy(model_dir: Path, use_lora: bool) -> PreTrainedModel:
    model, _ = load_causal_lm(ModelRef(path=str(model_dir)), torch.float32)
    if use_lora:
        return with_lora(model)
    return model.requires_grad_(True).eval()


def bundled_shape_config(num_layers: int = BUNDLED_SHAPE_LAYERS) -> LlamaConfig:
    data = json.loads((hf_model_folder(ModelRef()) / "config.json").read_text())
    data["num_hidden_layers"] = num_layers
    return LlamaConfig(**{k: v for k, v in data.items() if not k.startswith("_")})


def bundled_shape_policy(use_lora: bool, num_layers: int = BUNDLED_SHAPE_LAYERS, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(bundled_shape_config(num_layers)).eval()
    if use_lora:
        return with_lora(model, seed)
    return model.requires_grad_(True)


# float32 rounding through a few layers (the differences seen are ~1e-6), scaled by the
# largest gradient where gradients are compared (scaled_max_diff)
TOLERANCE = 2e-5


def policy_of_kind(kind: str, use_lora: bool, tiny_model_dir: Path) -> PreTrainedModel:
    """The tiny test model (``kind == "tiny"``) or the bundled model's shape, random weights."""
    return tiny_policy(tiny_model_dir, use_lora) if kind == "tiny" else bundled_shape_policy(use_lora)


def trainable(model: PreTrainedModel) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def grads_of(loss: torch.Tensor, model: PreTrainedModel) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, trainable(model)))


def max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def scaled_max_diff(reference: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> float:
    """``max_diff`` over the reference's largest entry (at least 1): float32 rounding grows
    with the size of the numbers summed, and full-weight gradients reach tens."""
    return max_diff(reference, other) / max(1.0, max(float(x.abs().max()) for x in reference))


def grouped_samples(
    vocab: int, groups: int = 2, per_group: int = 3, prompt: int = 30, seed: int = 0,
    shared_system: int = 0,
) -> list[SampleRecord]:
    """GRPO-like samples: each group's rows share a ``prompt``-token opening (and every row
    the first ``shared_system`` tokens), then differ: 1-3 actions (trained, advantage +-1)
    separated by environment tokens (context), rows of different lengths. The sampler's
    logprobs are a uniform policy's, near a random model's own."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(shared_system)]
    samples = []
    for g in range(groups):  # group g's opening is 3 g tokens longer than group 0's
        opening = system + [rng.randrange(3, vocab) for _ in range(prompt + 3 * g - shared_system)]
        for r in range(per_group):
            ids, mask = list(opening), [0] * len(opening)
            for _ in range(rng.randint(1, 3)):
                action = rng.randint(3, 12)
                ids += [rng.randrange(3, vocab) for _ in range(action)]
                mask += [1] * action
                env = rng.randint(2, 8)
                ids += [rng.randrange(3, vocab) for _ in range(env)]
                mask += [0] * env
            advantage = 1.0 if r % 2 == 0 else -1.0
            samples.append(SampleRecord(
                run_id="run", step=0, sample_id=f"g{g}e{r}#0", episode_id=f"g{g}e{r}", group_id=f"train/0/{g}",
                input_ids=tuple(ids), loss_mask=tuple(mask), advantages=tuple(advantage * m for m in mask),
                sampler_logprobs=tuple(-math.log(vocab) * m for m in mask),  # a random model's
            ))
    return samples


def on_sampler(samples: Sequence[SampleRecord], logprobs: dict[str, Sequence[float]]) -> list[SampleRecord]:
    """``samples`` with their sampler logprobs replaced (by sample id, one per token)."""
    return [dataclasses.replace(s, sampler_logprobs=tuple(logprobs[s.sample_id])) for s in samples]
