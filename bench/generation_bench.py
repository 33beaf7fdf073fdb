"""Generated tokens per second: 16 concurrent episodes batched vs one episode at a time.

Both runs use the same model, the same settings and the same prompts (a system prompt
with one tool, as the tool-use environments render it, and a different question per
episode), and two policy objects over the one loaded model, so their sessions draw with
the same seeds: the two runs sample the same tokens and differ only in how they batch.

    .venv/bin/python bench/generation_bench.py [--episodes 16] [--tokens 48] [--tiny]

Default model: the bundled SmolLM2-135M-Instruct (cached safetensors copy). ``--tiny``
swaps in a 2-layer test model to check the script itself in a few seconds.

Measured 2026-11-29 on the 2-core machine while other jobs kept the load average at 5-10
(absolute speeds are therefore low; the ratio is the point), 16 episodes, 48 tokens each:

    --threads 1:  batched 29.6 tokens/s, one at a time 6.7 tokens/s: 4.4x
    torch's 2:    batched  3.9 tokens/s, one at a time 0.8 tokens/s: 4.8x

Under such contention two torch threads were 5-8x slower than one at every batch size
(OpenMP threads waiting on descheduled siblings); on an idle machine use the default.
The prefill of each ~200-token prompt is not batched away (its cost is per token), which
is most of what keeps the batched run from a larger lead.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rollflow.envs.agent import PolicyAction
from rollflow.envs.types import Message, ToolSpec
from rollflow.policy.models import ModelRef, build_tiny_model, load_causal_lm
from rollflow.policy.sampling import SamplingSettings
from rollflow.policy.transformers_backend import TransformersPolicy

CALCULATOR: ToolSpec = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


@dataclass(frozen=True)
class RunResult:
    mode: str
    tokens: int
    wall_s: float
    batch_sizes: tuple[int, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def question(index: int) -> list[Message]:
    a, b = 17 + 3 * index, 5 + index
    content = f"A depot holds {a} crates and receives {b} more. How many now?"
    return [{"role": "user", "content": content}]


async def one_action(policy: TransformersPolicy, index: int) -> PolicyAction:
    session = policy.open_session([CALCULATOR])
    try:
        return await session.act(question(index))
    finally:
        await session.close()


async def concurrently(policy: TransformersPolicy, episodes: int) -> list[PolicyAction]:
    return list(await asyncio.gather(*(one_action(policy, i) for i in range(episodes))))


async def one_at_a_time(policy: TransformersPolicy, episodes: int) -> list[PolicyAction]:
    return [await one_action(policy, i) for i in range(episodes)]


def measure(
    mode: str, policy: TransformersPolicy, episodes: int
) -> tuple[RunResult, list[PolicyAction]]:
    runner = concurrently if mode == "batched" else one_at_a_time
    started = time.perf_counter()
    actions = asyncio.run(runner(policy, episodes))
    wall_s = time.perf_counter() - started
    tokens = sum(len(action.token_ids) for action in actions)
    return RunResult(mode, tokens, wall_s, tuple(policy.stats.batch_sizes)), actions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48, help="max_completion_tokens")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer test model instead")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.tiny:
        ref = ModelRef(path=str(build_tiny_model(Path(tempfile.mkdtemp(prefix="bench-tiny-")))))
    else:
        ref = ModelRef()
    started = time.perf_counter()
    model, tokenizer = load_causal_lm(ref)
    name = "tiny" if args.tiny else "SmolLM2-135M-Instruct"
    load_s = time.perf_counter() - started
    print(f"model: {name}, loaded in {load_s:.1f} s; torch threads: {torch.get_num_threads()}")
    settings = SamplingSettings(temperature=1.0, max_completion_tokens=args.tokens, seed=0)

    # warm-up: the first forward passes allocate and are slower than the rest
    asyncio.run(concurrently(TransformersPolicy(model, tokenizer, settings), 2))

    def fresh_policy() -> TransformersPolicy:  # same session ids, so the same seeds
        return TransformersPolicy(model, tokenizer, settings)

    batched, batched_actions = measure("batched", fresh_policy(), args.episodes)
    single, single_actions = measure("one at a time", fresh_policy(), args.episodes)
    pairs = zip(batched_actions, single_actions, strict=True)
    same = sum(a.token_ids == b.token_ids for a, b in pairs)

    print(f"{args.episodes} episodes, one action each, max_completion_tokens={args.tokens}")
    for result in (batched, single):
        print(
            f"  {result.mode:>13}: {result.tokens:5d} tokens in {result.wall_s:6.1f} s = "
            f"{result.tokens_per_s:6.1f} tokens/s   (batches: {list(result.batch_sizes)[:8]}"
            f"{' ...' if len(result.batch_sizes) > 8 else ''})"
        )
    print(f"  speed-up of batching: {batched.tokens_per_s / single.tokens_per_s:.1f}x")
    print(f"  identical samples in both runs: {same} of {args.episodes} episodes")


if __name__ == "__main__":
    main()
