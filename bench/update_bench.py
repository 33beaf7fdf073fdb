"""One GRPO update of the learning config's step, four ways, on one fixed batch (issue 43).

Legs (``LEGS``), each a ``UpdateSettings`` of the config's own (``UpdateSettings.from_config``):

- ``plain``: the path before issue 43: right-padded micro-batches with their attention mask;
- ``no-mask``: the same micro-batches without a mask (SDPA's causal kernel);
- ``shared-prefix``: each GRPO group's opening prompt computed once per micro-batch, the
  prefix pass still given its padding mask (``SharedPrefix.padding_mask``);
- ``exact``: both (shared prefixes, no padding mask anywhere): ``[train].shared_prefix``;
- ``bf16``: ``exact`` with its forwards under bfloat16 autocast (``[train].compute_dtype``)
  and the ``tis`` correction that comes with it: not exact, so its logprob difference from
  ``plain`` is the bfloat16 rounding the correction weighs (the mean |diff| is printed too).

Each leg runs in a fresh process (its own allocator and caches), the legs interleaved and
repeated, each repeat in another order; a leg loads the policy as the train stage does
(``load_policy_for_training``), times ``grpo_update`` (logprobs, loss, backward, optimizer
step) and records the action tokens' logprobs and the gradient the optimizer steps with,
against which the other legs' largest differences from ``plain`` (same repeat) are printed.

The batch: 8 tasks x 8 episodes of the bundled tool-use game (the config's ``[env]``), saved
once to ``$ROLLFLOW_CACHE/bench/`` and reused. Not sampled by the model (a vLLM run of the
learning config is a long job on 2 cores): each episode is **played through the real game**
(its real opening messages and tool results, rendered by the real tokenizer's chat codec as
a rollout renders them) by a scripted policy that sends the game's expert actions
(``sft_completion``), episode 0 of a task verbatim and the others varied the way a trained
policy's episodes differ: each digit redrawn with probability 1/2 (other calculator
expressions and answers) and each call of a several-call action dropped with probability
1/4 (fewer lookups), the structure kept, so a group's episodes share their opening prompt,
then differ in content and length while still playing the game to its end (random tokens
instead broke the first call and ended most episodes after one action). Advantages alternate +1/-1 within
a group (every episode trains: the update's worst case). The sampler logprobs are the
config's policy's own at the rollout temperature (one no-grad pass when the batch is built),
so the ratio starts at 1 as on-policy. The policy is the config's; a ``[model].adapter`` that
does not exist here (the SFT start of scripts/learn.sh) is replaced by a fresh LoRA whose B
matrices are drawn at random (an SFT-trained adapter is not 0), which costs the same.

    .venv/bin/python bench/update_bench.py [--config configs/learn_tool_use_game.toml]
        [--repeats 3] [--tasks 8] [--episodes 8] [--legs plain,no-mask,shared-prefix,exact,bf16]

``--tiny``: the 2-layer test model, 2 tasks x 4 episodes, to check the script in seconds.
Numbers taken while other work runs on the machine are not results: the load is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq
import torch

from rollflow.config.run import RunConfig, load_config
from rollflow.envs.agent import PolicyAction
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.runner import load_environment_handle
from rollflow.envs.types import Message, ToolSpec
from rollflow.generators.models import load_policy_for_training
from rollflow.policy.codec import ChatCodec, TokenState
from rollflow.policy.models import build_tiny_model, cache_root, generation_stop_ids
from rollflow.storage.records import SampleRecord
from rollflow.storage.schemas import sample_records_to_table, table_to_sample_records
from rollflow.tasks import grpo_update as update_module
from rollflow.tasks.grpo_update import UpdateSettings, grpo_update, make_optimizer, pack_microbatches
from rollflow.tasks.sft_rows import examples_from_environment

CONFIG = "configs/learn_tool_use_game.toml"
LEGS = {  # leg -> (padding_mask, shared_prefix, bfloat16 forwards)
    "plain": (True, False, False),
    "no-mask": (False, False, False),
    "shared-prefix": (True, True, False),
    "exact": (False, True, False),
    "bf16": (False, True, True),
}
BATCH_VERSION = 2  # in the saved batch's name: a batch made by another generator is not reused


# ---------------------------------------------------------------- the config and the policy


def bench_config(config_path: str, tiny_dir: Path | None) -> RunConfig:
    """The learning config; its adapter dropped where absent, the tiny model with ``--tiny``."""
    config = load_config(config_path)
    model = config.model
    if model.adapter is not None and not Path(model.adapter).exists():
        model = dataclasses.replace(model, adapter=None)
    if tiny_dir is not None:
        model = dataclasses.replace(model, path=str(tiny_dir), adapter=None, dtype="float32")
    return dataclasses.replace(config, model=model)


def load_policy(config: RunConfig) -> tuple[torch.nn.Module, object]:
    model, tokenizer = load_policy_for_training(config, None)
    if config.train.use_lora and config.model.adapter is None:
        generator = torch.Generator().manual_seed(config.train.seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:  # a trained adapter's B is not 0
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    return model, tokenizer


# ---------------------------------------------------------------- the fixed batch


def vary_action(text: str, rng: random.Random) -> str:
    """The expert's action with digits redrawn (p 1/2) and calls dropped (p 1/4, one kept)."""
    lines = text.split("\n")
    kept = [line for line in lines if rng.random() >= 0.25] or lines[:1]
    return re.sub(r"\d", lambda m: str(rng.randrange(10)) if rng.random() < 0.5 else m.group(), "\n".join(kept))


class _ScriptedExpert:
    """Sends the expert's actions (varied unless ``vary`` is False) as tokens, keeping the
    context exactly as a rollout does (the chat codec)."""

    version = 0

    def __init__(self, codec: ChatCodec, actions: Sequence[str], vary: bool, rng: random.Random) -> None:
        self.codec, self.actions, self.vary, self.rng = codec, list(actions), vary, rng

    def open_session(self, tool_specs: Sequence[ToolSpec]) -> _ScriptedExpert._Session:
        return _ScriptedExpert._Session(self, list(tool_specs))

    class _Session:
        def __init__(self, policy: _ScriptedExpert, tools: list[ToolSpec]) -> None:
            self.policy, self.tools, self.turn = policy, tools, 0
            self.state: TokenState | None = None

        async def act(self, messages: Sequence[Message]) -> PolicyAction:
            p, codec = self.policy, self.policy.codec
            self.state, delta, reset = codec.next_prompt(self.state, messages, self.tools)
            text = p.actions[min(self.turn, len(p.actions) - 1)]
            self.turn += 1
            text = vary_action(text, p.rng) if p.vary else text
            ids = (*codec.encode(text), codec.tokenizer.eos_token_id)
            self.state = codec.record_action(self.state, ids)
            return PolicyAction(text, ids, (0.0,) * len(ids), delta, reset, "stop")

        async def close(self) -> None:
            pass


def play_batch(
    config: RunConfig, tokenizer: object, model: torch.nn.Module, tasks: int, episodes: int
) -> list[SampleRecord]:
    """``tasks`` x ``episodes`` episodes of the config's game, played by ``_ScriptedExpert``."""
    handle = load_environment_handle(config.env.name, config.env.kwargs)
    examples = {e.row_id: e for e in examples_from_environment(config.env.name, config.env.kwargs, tasks)}
    codec = ChatCodec(tokenizer, stop_token_ids=generation_stop_ids(model))
    limits = EpisodeLimits(max_turns=config.rollout.max_turns)
    samples = []
    for t, item in enumerate(handle.tasks("train")[:tasks]):
        actions = [m["content"] for m in examples[item.task_id].target if m["role"] == "assistant"]
        for k in range(episodes):
            policy = _ScriptedExpert(codec, actions, k > 0, random.Random(f"{t}/{k}"))
            rollout = asyncio.run(handle.play(item, policy, limits))
            ids = [i for a in rollout.actions for i in (*a.prompt_delta_ids, *a.token_ids)]
            mask = [m for a in rollout.actions for m in (*[0] * len(a.prompt_delta_ids), *[1] * len(a.token_ids))]
            ids, mask = ids[: config.rollout.max_model_length], mask[: config.rollout.max_model_length]
            advantage = 1.0 if k % 2 == 0 else -1.0
            samples.append(SampleRecord(
                run_id="bench", step=0, sample_id=f"{item.task_id}/{k}#0", episode_id=f"{item.task_id}/{k}",
                group_id=f"train/0/{t}", input_ids=tuple(ids), loss_mask=tuple(mask),
                advantages=tuple(advantage * m for m in mask), sampler_logprobs=(0.0,) * len(ids),
            ))
    return with_sampler_logprobs(model, samples, config)


def with_sampler_logprobs(model: torch.nn.Module, samples: list[SampleRecord], config: RunConfig) -> list[SampleRecord]:
    """The policy's own logprobs of the action tokens at the rollout temperature (no grad)."""
    settings = UpdateSettings.from_config(config, 0)
    out = {}
    with torch.no_grad():
        for batch in pack_microbatches(samples, settings.max_tokens_per_microbatch):
            t = update_module._microbatch_tensors(batch, 0, model.device)
            wanted_BT = t["loss_mask"][:, 1:] > 0
            logprobs_BT = update_module.token_logprobs(model, t["input_ids"], None, settings.temperature, wanted_BT)
            for s, row_T in zip(batch, logprobs_BT, strict=True):
                out[s.sample_id] = (0.0, *row_T[: len(s.input_ids) - 1].tolist())
    return [dataclasses.replace(s, sampler_logprobs=out[s.sample_id]) for s in samples]


def fixed_batch(path: Path, config: RunConfig, tasks: int, episodes: int) -> list[SampleRecord]:
    """The batch at ``path``, played and saved there first if missing."""
    if not path.is_file():
        model, tokenizer = load_policy(config)
        samples = play_batch(config, tokenizer, model, tasks, episodes)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(sample_records_to_table(samples), str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
    return table_to_sample_records(pq.read_table(path))


# ---------------------------------------------------------------- one leg (a child process)


def run_leg(leg: str, config: RunConfig, batch: list[SampleRecord], out: Path) -> None:
    """One timed update; writes seconds, tokens/s, peak RSS, logprobs and gradient to ``out``."""
    padding_mask, shared_prefix, bfloat16 = LEGS[leg]
    # Each leg sets the forwards' dtype itself, whatever the config says (the learning
    # config's is bfloat16 since run 5): the float32 legs are the exact paths.
    compute_dtype = "bfloat16" if bfloat16 else "float32"
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, compute_dtype=compute_dtype))
    model, tokenizer = load_policy(config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    settings = dataclasses.replace(UpdateSettings.from_config(config, pad), padding_mask=padding_mask,
                                   shared_prefix=shared_prefix)
    optimizer = make_optimizer(model, config.train.learning_rate)
    logprobs: dict[tuple[int, ...], torch.Tensor] = {}
    grads: list[torch.Tensor] = []
    plain_token_logprobs = update_module.token_logprobs

    def recording(model_: object, input_ids_BT: torch.Tensor, attention: object, temperature: float,
                  wanted_BT: torch.Tensor) -> torch.Tensor:
        logprobs_BT = plain_token_logprobs(model_, input_ids_BT, attention, temperature, wanted_BT)
        for ids_T, row_T, wanted_T in zip(input_ids_BT, logprobs_BT.detach(), wanted_BT, strict=True):
            last = int(wanted_T.nonzero().max()) + 2 if wanted_T.any() else 1  # through the last action token
            logprobs[tuple(ids_T[:last].tolist())] = row_T[wanted_T].clone()
        return logprobs_BT

    step = optimizer.step

    def recording_step(*args: object, **kwargs: object) -> object:
        grads.extend(p.grad.detach().clone() for group in optimizer.param_groups for p in group["params"])
        return step(*args, **kwargs)

    update_module.token_logprobs = recording
    optimizer.step = recording_step
    stats = grpo_update(model, None, optimizer, batch, settings)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.save({"seconds": stats.seconds, "tokens_per_s": stats.tokens_per_s, "peak_rss_mb": peak_mb,
                "mismatch_kl": stats.mismatch_kl,
                "microbatches": stats.num_microbatches, "logprobs": logprobs, "grads": grads}, out)


# ---------------------------------------------------------------- the table


def compare(result: dict, plain: dict) -> tuple[float, float, float]:
    """|difference| from ``plain``: largest and mean over the action tokens' logprobs, largest
    over the gradient."""
    assert result["logprobs"].keys() == plain["logprobs"].keys(), "the legs trained different rows"
    diffs = torch.cat([(result["logprobs"][k] - v).abs() for k, v in plain["logprobs"].items()])
    grad = max(float((a - b).abs().max()) for a, b in zip(result["grads"], plain["grads"], strict=True))
    return float(diffs.max()), float(diffs.mean()), grad


def print_tables(results: dict[tuple[str, int], dict], legs: Sequence[str], repeats: int) -> None:
    print("| leg | repeat | update s | tokens/s | max / mean logprob diff vs plain | max grad diff vs plain "
          "| mismatch k3 | micro-batches | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in range(repeats):
        for leg in legs:
            res = results[(leg, r)]
            plain = results.get(("plain", r))
            diffs = compare(res, plain) if plain is not None else (float("nan"),) * 3
            mismatch = res.get("mismatch_kl")
            print(f"| {leg} | {r} | {res['seconds']:.2f} | {res['tokens_per_s']:.0f} | {diffs[0]:.2e} / {diffs[1]:.2e} | "
                  f"{diffs[2]:.2e} | {'-' if mismatch is None else f'{mismatch:.2e}'} | {res['microbatches']} | "
                  f"{res['peak_rss_mb']:.0f} |")
    print()
    print("| leg | median update s | min-max s | median tokens/s | speed-up vs plain (medians) |")
    print("|---|---|---|---|---|")
    medians = {leg: statistics.median(results[(leg, r)]["seconds"] for r in range(repeats)) for leg in legs}
    for leg in legs:
        seconds = [results[(leg, r)]["seconds"] for r in range(repeats)]
        speed = statistics.median(results[(leg, r)]["tokens_per_s"] for r in range(repeats))
        ratio = medians["plain"] / medians[leg] if "plain" in medians else float("nan")
        print(f"| {leg} | {medians[leg]:.2f} | {min(seconds):.2f}-{max(seconds):.2f} | {speed:.0f} | {ratio:.2f}x |")


def _load() -> str:
    figures = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return f"load average (1, 5, 15 min): {figures} on {os.cpu_count()} CPUs"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--legs", default=",".join(LEGS))
    parser.add_argument("--batch", type=Path, default=None, help="the fixed batch (.parquet); made if missing")
    parser.add_argument("--tiny", action="store_true", help="the 2-layer test model, 2 tasks x 4 episodes")
    parser.add_argument("--run-leg", choices=list(LEGS), help=argparse.SUPPRESS)  # a child's one leg
    parser.add_argument("--tiny-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_leg:
        config = bench_config(args.config, args.tiny_dir)
        run_leg(args.run_leg, config, table_to_sample_records(pq.read_table(args.batch)), args.out)
        return 0
    legs = args.legs.split(",")
    assert set(legs) <= set(LEGS) and "plain" in legs, f"legs from {list(LEGS)}, plain among them"
    with tempfile.TemporaryDirectory(prefix="update-bench-") as tmp:
        tiny_dir = build_tiny_model(Path(tmp) / "tiny") if args.tiny else None
        tasks, episodes = (2, 4) if args.tiny else (args.tasks, args.episodes)
        config = bench_config(args.config, tiny_dir)
        saved = cache_root() / "bench" / f"update_batch-v{BATCH_VERSION}-t{tasks}-e{episodes}.parquet"
        batch_path = args.batch or (Path(tmp) / "batch.parquet" if args.tiny else saved)
        batch = fixed_batch(batch_path, config, tasks, episodes)
        lengths = [len(s.input_ids) for s in batch]
        print(f"batch {batch_path}: {len(batch)} episodes, {sum(lengths)} tokens "
              f"({min(lengths)}-{max(lengths)} a row), {sum(sum(s.loss_mask) for s in batch)} action tokens")
        print(_load())
        results = {}
        for r in range(args.repeats):
            for leg in legs[r % len(legs):] + legs[: r % len(legs)]:  # another order each repeat
                out = Path(tmp) / f"{leg}-{r}.pt"
                command = [sys.executable, __file__, "--run-leg", leg, "--config", args.config,
                           "--batch", str(batch_path), "--out", str(out)]
                if tiny_dir is not None:
                    command += ["--tiny-dir", str(tiny_dir)]
                started = time.perf_counter()
                subprocess.run(command, check=True)
                results[(leg, r)] = torch.load(out, weights_only=False)
                print(f"  {leg} repeat {r}: {results[(leg, r)]['seconds']:.2f} s update, "
                      f"{time.perf_counter() - started:.0f} s process; {_load()}", file=sys.stderr, flush=True)
        print(_load())
        print_tables(results, legs, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
