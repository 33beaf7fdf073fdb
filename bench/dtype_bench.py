"""float32 against bfloat16 for the two costs of a CPU run: a decoding step and a LoRA update.

The bundled SmolLM2-135M-Instruct is loaded as the pipeline loads it (``load_causal_lm``),
once per dtype, with the LoRA adapter the training stage puts on it (rank 16 on q, k, v, o;
peft keeps those weights in float32 whatever the base's dtype). Two figures per dtype:

- **decoding step**: one new token for each of B sequences over a ~400-token KV cache, as
  the rollout decodes a batch of episodes (B = 32 and 64);
- **LoRA forward+backward**: one micro-batch of 6 sequences x 600 tokens (the size of the
  tool-use game's episodes), as the training stage runs it, in tokens per second.

    .venv/bin/python bench/dtype_bench.py [--tiny] [--repeats 3]

``--tiny`` swaps in a 2-layer test model to check the script itself in seconds.

Measured 2026-11-29 on the 2-core machine (idle; its CPU has AMX bfloat16 units), 3.6 min:

    float32   decoding step B=32   244 ms, B=64   482 ms; LoRA forward+backward    220 tokens/s
    bfloat16  decoding step B=32   193 ms, B=64   355 ms; LoRA forward+backward    385 tokens/s

bfloat16 decodes 1.3x faster and trains 1.75x faster. The LoRA layers, in float32 on the
bfloat16 base, take part of the gain back: a first draft of this script without them (the
plain model; a full-weight backward) measured 2.6x at B=64 and 2.5x for the update.

A CPU without bfloat16 units (no ``amx_bf16`` or ``avx512_bf16`` in /proc/cpuinfo) runs
bfloat16 in emulation, slower than float32: measure before switching a config over.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from rollflow.config.run import ModelConfig, RunConfig
from rollflow.generators.models import load_policy_for_training
from rollflow.policy.generation import forward_cache_keyword
from rollflow.policy.models import build_tiny_model

DTYPES = ("float32", "bfloat16")


def decode_step_ms(model: torch.nn.Module, batch: int, context: int, repeats: int) -> float:
    """Milliseconds per decoding step of ``batch`` rows over a ``context``-token cache."""
    vocab, keyword = model.config.vocab_size, forward_cache_keyword(model)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (batch, context)), use_cache=True, logits_to_keep=1,
              **{keyword: cache})
        token = torch.randint(0, vocab, (batch, 1))
        steps = 10 * repeats
        start = time.perf_counter()
        for _ in range(steps):  # the cache grows in place, as in the rollout's decoding loop
            model(input_ids=token, use_cache=True, logits_to_keep=1, **{keyword: cache})
    return (time.perf_counter() - start) / steps * 1000


def lora_update_tokens_per_s(model: torch.nn.Module, rows: int, length: int, repeats: int) -> float:
    """Tokens per second of forward+backward through LoRA weights over ``rows`` x ``length``."""
    ids = torch.randint(0, model.config.vocab_size, (rows, length))
    model.train()
    start = time.perf_counter()
    for _ in range(repeats):
        logprobs = model(input_ids=ids).logits.float().log_softmax(-1)
        logprobs[:, :-1].gather(-1, ids[:, 1:, None]).mean().backward()
    model.eval()
    return rows * length * repeats / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer test model instead of the bundled one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=400, help="tokens in the KV cache when decoding")
    parser.add_argument("--length", type=int, default=600, help="tokens per sequence in the update")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(Path(tmp) / "tiny")) if args.tiny else None
        for name in DTYPES:
            # as the training stage loads it: a fresh LoRA of the default [train] settings
            model, _ = load_policy_for_training(RunConfig(model=ModelConfig(path=path, dtype=name)), None)
            steps = {b: decode_step_ms(model, b, args.context, args.repeats) for b in (32, 64)}
            rate = lora_update_tokens_per_s(model, 6, args.length, args.repeats)
            print(f"{name:9s} decoding step B=32 {steps[32]:5.0f} ms, B=64 {steps[64]:5.0f} ms; "
                  f"LoRA forward+backward {rate:6.0f} tokens/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
