"""What slicing the prefill costs, and how long a stop request waits: per slice size.

The rollout prefills every context of a batch before decoding it (policy/generation.py),
in forward passes of at most ``PREFILL_TOKENS_PER_PASS`` tokens (slices of rows). A stop request (SIGTERM)
is seen between passes, so the longest pass is how long a stop can wait; the sum is the
prefill's cost. This prints both for a batch like a GRPO step's later turns (64 distinct
contexts of ~500 tokens) on the bundled SmolLM2-135M with a rank-16 LoRA adapter, as the
pipeline runs it, at several slice sizes ("whole" = one pass over everything).

    .venv/bin/python bench/prefill_bench.py [--tiny] [--rows 64] [--context 500] [--dtype bfloat16]

``--tiny`` swaps in a 2-layer test model to check the script itself in seconds.

Measured 2026-11-29 on the 2-core machine (idle), bfloat16, 64 rows x 500 tokens, 2.2 min:

    tokens/pass  whole:   1 passes, prefill  35.57 s, longest pass (a stop's wait)  35.52 s
    tokens/pass  16384:   2 passes, prefill  30.03 s, longest pass (a stop's wait)  14.89 s
    tokens/pass   8192:   4 passes, prefill  23.85 s, longest pass (a stop's wait)   6.01 s
    tokens/pass   4096:   8 passes, prefill  17.26 s, longest pass (a stop's wait)   2.25 s
    tokens/pass   2048:  16 passes, prefill  15.61 s, longest pass (a stop's wait)   1.02 s

Slices of rows cost less in all, not more: one pass's attention over every row at once
works on far more memory than smaller passes do. The default, 4096, stops within ~2 s
and is within 10% of the fastest here.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from rollflow.generators.models import load_policy_for_training
import rollflow.policy.generation as generation
import rollflow.policy.prefill as prefill
from rollflow.config.run import ModelConfig, RunConfig
from rollflow.policy.generation import GenerationRequest
from rollflow.policy.models import build_tiny_model

SLICES = (None, 16384, 8192, 4096, 2048)  # None: the whole batch in one pass


def prefill_seconds(model: torch.nn.Module, requests: list[GenerationRequest], tokens_per_pass: int) -> tuple[float, float, int]:
    """(total seconds, longest pass in seconds, passes) of one prefill at this slice size."""
    starts: list[float] = []
    pass_seconds: list[float] = []
    before = model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
    after = model.register_forward_hook(lambda *_: pass_seconds.append(time.perf_counter() - starts[-1]))
    previous = prefill.PREFILL_TOKENS_PER_PASS
    prefill.PREFILL_TOKENS_PER_PASS = tokens_per_pass
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            prefill.prefill(model, requests, 0, DynamicCache(), generation.forward_cache_keyword(model))
            total = time.perf_counter() - start
    finally:
        prefill.PREFILL_TOKENS_PER_PASS = previous
        before.remove()
        after.remove()
    return total, max(pass_seconds), len(pass_seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer test model instead of the bundled one")
    parser.add_argument("--rows", type=int, default=64, help="distinct contexts in the batch")
    parser.add_argument("--context", type=int, default=500, help="tokens per context")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(Path(tmp) / "tiny")) if args.tiny else None
        # as the training stage loads it: a fresh LoRA of the default [train] settings
        model: Any = load_policy_for_training(RunConfig(model=ModelConfig(path=path, dtype=args.dtype)), None)[0]
        model.eval()
        generator = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        requests = [GenerationRequest(tuple(torch.randint(3, vocab, (args.context,), generator=generator).tolist()), 1, row)
                    for row in range(args.rows)]
        prefill_seconds(model, requests[:2], 4096)  # warm-up: first-call allocations
        whole = args.rows * args.context
        for tokens in SLICES:
            total, longest, passes = prefill_seconds(model, requests, tokens or whole)
            label = "whole" if tokens is None else str(tokens)
            print(f"tokens/pass {label:>6s}: {passes:3d} passes, prefill {total:6.2f} s, "
                  f"longest pass (a stop's wait) {longest:6.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
