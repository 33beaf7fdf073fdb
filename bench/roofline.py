"""The training step against this machine's own peak: GEMM FLOP/s, memory bandwidth, and how
close the trainer and the generator get.

Measured here, with torch on the threads this process may use (``os.sched_getaffinity``):

- **GEMM peak**: the best FLOP/s of square ``torch.mm`` over sizes up to 4096, in float32 and,
  where the CPU has bfloat16 units (``avx512_bf16`` / ``amx_bf16`` in /proc/cpuinfo), in
  bfloat16; once on one thread and once on all of them.
- **the model's own GEMM shapes**: ``F.linear`` at one micro-batch's rows (the config's
  ``max_tokens_per_microbatch``) through each projection of the model, and the LoRA
  matrices (rank r): the ceiling the trainer's shapes allow, below the square peak.
- **memory bandwidth**: a 1 GiB ``copy_`` (read + write) and ``sum`` (read).
- **the trainer**: one real update of the config's trainer (``load_policy_for_training``,
  ``make_optimizer``, ``grpo_update`` from ``rollflow.tasks``) on synthetic samples of the
  game's shape (lengths around 600 tokens, 4 actions of ~37 tokens), after an untimed
  warm-up update; then a no-grad forward over the same micro-batches to split forward
  from backward + optimizer.
- **the generator**: decoding steps of B rows over a C-token KV cache in the rollout's dtype
  (the in-process engine's inner loop: one token for each row), with and without the
  LoRA adapter, against two bounds: bandwidth (bytes of weights + KV cache read per step /
  measured copy bandwidth) and compute (FLOPs per step / GEMM peak).

How a step's FLOPs are counted (P_body: the decoder layers' linear weights, P_first those of
them that read the embeddings (layer 0's q, k, v); P_head: the output projection, run only
at action tokens (``logits_to_keep``); P_lora: the adapter's A and B matrices, P_lora_first
the A matrices on P_first; d: hidden size; L: layers; n: a row's length, the padded width
when padding is counted):

- LoRA (frozen base), per token: forward 2 (P_body + P_lora); backward the input gradient
  through the frozen weights, 2 (P_body - P_first) (every layer: the adapter starts in
  layer 0; the embeddings need none), through the adapter 2 (P_lora - P_lora_first), and
  the adapter's weight gradient 2 P_lora. About 4 P_body + 6 P_lora, not the full-weight
  6 P: the base takes no weight gradient. Head: 4 P_head per action token.
- Full weights: 6 P_body per token, 6 P_head per action token.
- Attention (causal): 2 n^2 d per row and layer forward, twice that backward.

The linear-layer part is checked against ``torch.utils.flop_counter`` on a tiny model
(tests/test_roofline.py).

``padding included`` counts every (row x widest row) position of each micro-batch, as the
forward runs it; ``excluded`` only the samples' real tokens. The reference pass (``kl_coef``
> 0) would add a no-grad forward per micro-batch: the config's value is printed.

    .venv/bin/python bench/roofline.py [--config configs/learn_tool_use_game.toml]
        [--samples 24] [--profile] [--contention]

``--quick`` swaps in a 2-layer test model, small GEMMs and 4 samples, to check the script
itself. ``--profile``: torch's profiler over one micro-batch's forward + backward and over a
decode, the top operators by self time. ``--alternatives``: the widest micro-batch's
forward + backward under changes the trainer could make (another attention kernel,
bfloat16 autocast, a fused head log-softmax), with how far each moves the logprobs. ``--contention`` (instead of the above): a trainer process (forward +
backward of one micro-batch in a loop) and a generator process (decoding steps of the same
model, standing in for vLLM's worker) run at once under several thread settings
(``CONTENTION``), each figure beside the same process alone.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from rollflow.config.run import RunConfig, load_config
from rollflow.generators.models import load_policy_for_training, torch_dtype
from rollflow.policy.generation import forward_cache_keyword
from rollflow.policy.models import build_tiny_model
from rollflow.storage.records import SampleRecord
from rollflow.tasks.grpo_update import (
    UpdateSettings,
    _microbatch_tensors,
    _trained_batches,
    grpo_update,
    make_optimizer,
)
from rollflow.tasks.trainer_logprobs import token_logprobs

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "learn_tool_use_game.toml"
GIB = 1 << 30


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def native_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def best_rate(run: callable, work: float, min_s: float) -> float:  # type: ignore[valid-type]
    """``work`` per second of the fastest of repeated ``run()`` calls (at least 3, ``min_s`` in all)."""
    run()  # warm-up: oneDNN builds its kernel on the first call
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - started < min_s:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return work / min(times)


# ---------------------------------------------------------------- the machine


def gemm_peak(dtype: torch.dtype, sizes: list[int], min_s: float) -> tuple[float, int]:
    """(best FLOP/s, the size that reached it) of n x n @ n x n."""
    best = (0.0, 0)
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        best = max(best, (best_rate(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), 2.0 * n**3, min_s), n))
    return best


def shape_gemms(model: PreTrainedModel, rows: int, dtype: torch.dtype, min_s: float) -> list[tuple[str, float]]:
    """FLOP/s of ``F.linear`` at ``rows`` tokens through each distinct weight shape of the model."""
    shapes: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
            kind = name.split(".")[-2] if "lora_" in name else name.split(".")[-1]
            shapes.setdefault(tuple(module.weight.shape), kind)
    results = []
    for (out_f, in_f), kind in sorted(shapes.items(), key=lambda item: -item[0][0] * item[0][1]):
        lora = kind.startswith("lora_")
        w_dtype = torch.float32 if lora else dtype  # peft keeps the adapter in float32
        x, w = torch.randn(rows, in_f).to(w_dtype), torch.randn(out_f, in_f).to(w_dtype)
        rate = best_rate(lambda x=x, w=w: F.linear(x, w), 2.0 * rows * in_f * out_f, min_s)
        results.append((f"{kind} {rows}x{in_f} @ {in_f}x{out_f} {str(w_dtype).removeprefix('torch.')}", rate))
    return results


def bandwidth(size_bytes: int, min_s: float) -> tuple[float, float]:
    """(copy bytes/s counting read + write, sum bytes/s read) over ``size_bytes`` float32."""
    src = torch.ones(size_bytes // 4)
    dst = torch.empty_like(src)
    copy = best_rate(lambda: dst.copy_(src), 2.0 * size_bytes, min_s)
    read = best_rate(lambda: src.sum(), float(size_bytes), min_s)
    return copy, read


# ---------------------------------------------------------------- the model's FLOPs


@dataclasses.dataclass(frozen=True)
class ModelShape:
    body: int  # linear weights of the decoder layers (LoRA's base layers included)
    first: int  # of which those reading the embeddings (layer 0's q, k, v): no input gradient
    head: int  # the output projection
    lora: int  # adapter A and B
    lora_first: int  # of which the A matrices on ``first``
    hidden: int
    layers: int
    weight_bytes: int  # every parameter as stored (what a decoding step reads)
    kv_bytes_per_token: int  # K and V of one position, all layers

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelShape:
        counts = dict.fromkeys(("body", "first", "head", "lora", "lora_first"), 0)
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            count = module.weight.numel()
            reads_embeddings = re.search(r"layers\.0\.self_attn\.[qkv]_proj(\.base_layer)?$", name) is not None
            if "lora_" in name:
                counts["lora"] += count
                if re.search(r"layers\.0\.self_attn\.[qkv]_proj\.lora_A\.", name):
                    counts["lora_first"] += count
            elif "lm_head" in name:
                counts["head"] += count
            else:
                counts["body"] += count
                counts["first"] += count if reads_embeddings else 0
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        element = model.get_input_embeddings().weight.element_size()  # the cache's dtype is the model's
        weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        return cls(**counts, hidden=c.hidden_size, layers=c.num_hidden_layers, weight_bytes=weight_bytes,
                   kv_bytes_per_token=2 * c.num_hidden_layers * kv_heads * head_dim * element)  # fmt: skip

    def matmul_train_flops(self, tokens: int, action_tokens: int, lora: bool) -> float:
        """The linear layers' FLOPs of forward + backward (see the module docstring)."""
        if lora:  # forward, input gradients through the frozen base and the adapter, adapter weight gradients
            per_token = 2 * (self.body + self.lora) + 2 * (self.body - self.first) + 2 * (self.lora - self.lora_first)
            return per_token * tokens + 2 * self.lora * tokens + 4 * self.head * action_tokens
        return 6 * self.body * tokens + 6 * self.head * action_tokens  # the embeddings train: every input gradient

    def attention_flops(self, row_lengths: list[int], backward: bool) -> float:
        """Causal attention, QK^T and AV over the lower triangle: 2 n^2 d per layer forward, twice that backward."""
        forward = 2 * self.hidden * self.layers * sum(n * n for n in row_lengths)
        return 3 * forward if backward else forward

    def train_flops(self, row_lengths: list[int], action_tokens: int, lora: bool) -> float:
        return self.matmul_train_flops(sum(row_lengths), action_tokens, lora) + self.attention_flops(row_lengths, True)

    def forward_flops(self, row_lengths: list[int], action_tokens: int) -> float:
        matmul = 2 * (self.body + self.lora) * sum(row_lengths) + 2 * self.head * action_tokens
        return matmul + self.attention_flops(row_lengths, False)


# ---------------------------------------------------------------- the trainer


def synthetic_samples(count: int, quick: bool, vocab: int, seed: int = 0) -> list[SampleRecord]:
    """Samples of the game's shape: ~600 tokens (sd 60, 400-1000), 4 actions of ~37 tokens
    spread over the second half, advantages of both signs (every sample trains)."""
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        length = 48 if quick else min(1000, max(400, int(rng.gauss(600, 60))))
        action = 6 if quick else 37
        mask = [0] * length
        for k in range(4):
            start = length // 2 + k * (length // 8)
            for t in range(start, min(length, start + action)):
                mask[t] = 1
        advantage = 1.0 if i % 2 == 0 else -1.0
        samples.append(SampleRecord(
            run_id="roofline", step=0, sample_id=f"e{i}#0", episode_id=f"e{i}", group_id=f"g{i // 8}",
            input_ids=tuple(rng.randrange(3, vocab) for _ in range(length)), loss_mask=tuple(mask),
            advantages=tuple(advantage * m for m in mask), sampler_logprobs=tuple(-1.0 * m for m in mask),
        ))  # fmt: skip
    return samples


@dataclasses.dataclass(frozen=True)
class TrainFigures:
    update_s: float
    forward_s: float
    microbatches: list[tuple[int, int]]  # (rows, width)
    real_lengths: list[int]
    action_tokens: int


def train_step(config: RunConfig, samples: list[SampleRecord]) -> tuple[TrainFigures, PreTrainedModel]:
    """One timed ``grpo_update`` (after an untimed one on two samples), then a no-grad forward
    over the same micro-batches."""
    model, tokenizer = load_policy_for_training(config, None)
    optimizer = make_optimizer(model, config.train.learning_rate)
    settings = UpdateSettings.from_config(config, tokenizer.pad_token_id or 0)
    grpo_update(model, None, optimizer, samples[:2], settings)  # warm-up
    stats = grpo_update(model, None, optimizer, samples, settings)
    batches = _trained_batches(samples, config.train.kl_coef > 0, settings)
    started = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            t = _microbatch_tensors(batch, settings.pad_token_id, model.device)
            token_logprobs(model, t["input_ids"], t["attention_mask"], settings.temperature, t["loss_mask"][:, 1:] > 0)
    forward_s = time.perf_counter() - started
    return TrainFigures(
        update_s=stats.seconds, forward_s=forward_s,
        microbatches=[(len(b), max(len(s.input_ids) for s in b)) for b in batches],
        real_lengths=[len(s.input_ids) for s in samples], action_tokens=stats.num_action_tokens,
    ), model  # fmt: skip


def profile_microbatch(model: PreTrainedModel, samples: list[SampleRecord], config: RunConfig, top: int) -> None:
    """torch's profiler over one micro-batch's forward + backward: the top operators by self time."""
    from torch.profiler import ProfilerActivity, profile

    settings = UpdateSettings.from_config(config, 0)
    batch = _trained_batches(samples, False, settings)[0]
    t = _microbatch_tensors(batch, 0, model.device)
    model.train()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logprobs = token_logprobs(model, t["input_ids"], t["attention_mask"], 1.0, t["loss_mask"][:, 1:] > 0)
        logprobs.sum().backward()
    model.eval()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\nprofile of one micro-batch ({len(batch)} rows x {t['input_ids'].shape[1]}), self CPU time:")
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        share = event.self_cpu_time_total / total
        print(f"  {event.key:45s} {event.self_cpu_time_total / 1e6:7.2f} s {share:6.1%}  x{event.count}")


def cross_entropy_logprobs(
    model: PreTrainedModel, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
    temperature: float, wanted_BT: torch.Tensor,
) -> torch.Tensor:
    """``token_logprobs`` with the head's log-softmax as one fused ``F.cross_entropy``."""
    keep_BT = torch.zeros_like(input_ids_BT, dtype=torch.bool)
    keep_BT[:, :-1] = wanted_BT
    logits_NV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, logits_to_keep=keep_BT, use_cache=False).logits
    targets_N = input_ids_BT[:, 1:][wanted_BT]
    picked_N = -F.cross_entropy(logits_NV.float() / temperature, targets_N, reduction="none")
    return torch.zeros(wanted_BT.shape, dtype=picked_N.dtype).masked_scatter(wanted_BT, picked_N)


@contextlib.contextmanager
def eager_attention(model: PreTrainedModel) -> Iterator[None]:
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")


def alternatives(model: PreTrainedModel, samples: list[SampleRecord], config: RunConfig, repeats: int) -> None:
    """Forward + backward seconds of the widest micro-batch under changes the trainer could
    make, and how far each moves the logprobs from the trainer's own."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    settings = UpdateSettings.from_config(config, 0)
    batch = _trained_batches(samples, False, settings)[0]
    t = _microbatch_tensors(batch, 0, model.device)
    args = (t["input_ids"], t["attention_mask"], settings.temperature, t["loss_mask"][:, 1:] > 0)
    variants = [
        ("as the trainer runs it", contextlib.nullcontext, token_logprobs),
        ("SDPA math backend", lambda: sdpa_kernel(SDPBackend.MATH), token_logprobs),
        ("eager attention", lambda: eager_attention(model), token_logprobs),
        ("autocast bfloat16 (the LoRA matmuls too)", lambda: torch.autocast("cpu", dtype=torch.bfloat16), token_logprobs),
        ("head's log-softmax as F.cross_entropy", contextlib.nullcontext, cross_entropy_logprobs),
    ]
    print(f"\nalternatives, one micro-batch ({len(batch)} rows x {t['input_ids'].shape[1]}) forward + backward, best of {repeats}:")
    reference = None
    for name, context, logprobs_fn in variants:
        times = []
        try:
            for _ in range(repeats + 1):  # the first: warm-up
                started = time.perf_counter()
                with context():
                    logprobs = logprobs_fn(model, *args)
                    logprobs.sum().backward()
                times.append(time.perf_counter() - started)
                model.zero_grad(set_to_none=True)
        except (RuntimeError, ValueError, NotImplementedError) as error:  # one this torch / transformers lacks
            print(f"  {name:42s} unavailable: {type(error).__name__}: {error}")
            continue
        reference = logprobs.detach() if reference is None else reference
        gap = (logprobs.detach() - reference).abs().max().item()
        print(f"  {name:42s} {min(times[1:]):6.2f} s; max |logprob - trainer's| {gap:.1e}; {load()}", flush=True)


def profile_decode(model: PreTrainedModel, batch: int, context: int, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_step_s(model, batch, context, 4)
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\nprofile of a decode (prefill + 5 steps, {batch} rows), self CPU time:")
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {event.key:45s} {event.self_cpu_time_total / 1e6:7.2f} s {event.self_cpu_time_total / total:6.1%}  x{event.count}")


# ---------------------------------------------------------------- the generator


def decode_step_s(model: PreTrainedModel, batch: int, context: int, steps: int) -> float:
    """Seconds per decoding step of ``batch`` rows over a ``context``-token cache (after one warm-up)."""
    vocab, keyword = model.config.vocab_size, forward_cache_keyword(model)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (batch, context)), use_cache=True, logits_to_keep=1, **{keyword: cache})
        token = torch.randint(0, vocab, (batch, 1))
        model(input_ids=token, use_cache=True, logits_to_keep=1, **{keyword: cache})
        started = time.perf_counter()
        for _ in range(steps):
            model(input_ids=token, use_cache=True, logits_to_keep=1, **{keyword: cache})
    return (time.perf_counter() - started) / steps


# ---------------------------------------------------------------- contention


def worker(role: str, config: RunConfig, seconds: float, quick: bool) -> None:
    """A trainer (forward + backward of one micro-batch) or generator (decoding steps) loop:
    prints "ready", waits for a line on stdin, runs ``seconds``, prints tokens/s."""
    model, _ = load_policy_for_training(config, None)
    if role == "train":
        samples = synthetic_samples(2 if quick else 6, quick, model.config.vocab_size)
        t = _microbatch_tensors(samples, 0, model.device)
        wanted = t["loss_mask"][:, 1:] > 0

        def unit() -> int:
            token_logprobs(model, t["input_ids"], t["attention_mask"], 1.0, wanted).sum().backward()
            return int(t["input_ids"].numel())
    else:
        batch, context = (4, 16) if quick else (64, 400)
        keyword, vocab = forward_cache_keyword(model), model.config.vocab_size
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=torch.randint(0, vocab, (batch, context)), use_cache=True, logits_to_keep=1, **{keyword: cache})
        token = torch.randint(0, vocab, (batch, 1))

        def unit() -> int:
            with torch.no_grad():
                model(input_ids=token, use_cache=True, logits_to_keep=1, **{keyword: cache})
            return batch

    unit()
    print("ready", flush=True)
    sys.stdin.readline()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        done += unit()
    print(f"{done / (time.perf_counter() - started):.1f}", flush=True)


BOUND_0_1 = {"OMP_NUM_THREADS": "2", "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}  # vLLM's worker today
CONTENTION: dict[str, tuple[tuple[dict[str, str], set[int] | None], tuple[dict[str, str], set[int] | None]]] = {
    # name: ((trainer env, trainer CPUs), (generator env, generator CPUs)); None: every CPU
    "today: 2 threads + 2 bound to 0-1": (({}, None), (BOUND_0_1, None)),
    "both 2 threads, passive wait": (({"OMP_WAIT_POLICY": "PASSIVE"}, None), ({**BOUND_0_1, "OMP_WAIT_POLICY": "PASSIVE"}, None)),
    "1 thread on CPU 1 + 1 on CPU 0": (
        ({"OMP_NUM_THREADS": "1"}, {1}),
        ({"OMP_NUM_THREADS": "1", "OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}, {0}),
    ),
}


def contention(args: argparse.Namespace) -> None:
    def start(role: str, env: dict[str, str], cpus: set[int] | None) -> subprocess.Popen[str]:
        command = [sys.executable, __file__, "--worker", role, "--seconds", str(args.seconds), "--config", str(args.config)]
        command += ["--quick"] if args.quick else []
        command += ["--cpus", ",".join(map(str, sorted(cpus)))] if cpus else []
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})

    def measure(runs: list[tuple[str, tuple[dict[str, str], set[int] | None]]]) -> list[float]:
        procs = [start(role, *setting) for role, setting in runs]
        try:
            for proc in procs:
                assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            for proc in procs:  # both start at once
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            return [float(proc.stdout.readline()) for proc in procs if proc.stdout is not None]
        finally:
            for proc in procs:
                proc.wait(timeout=120)

    print(f"\ncontention: trainer (forward + backward, tokens/s) / generator (decoding, tokens/s), {args.seconds:.0f} s each")
    for name, (trainer, generator) in CONTENTION.items():
        before = load()
        alone = [measure([("train", trainer)])[0], measure([("decode", generator)])[0]]
        together = measure([("train", trainer), ("decode", generator)])
        print(f"  {name:36s} alone {alone[0]:7.1f} / {alone[1]:7.1f}; together {together[0]:7.1f} / "
              f"{together[1]:7.1f} ({together[0] / alone[0]:.0%} / {together[1] / alone[1]:.0%}); "
              f"{before} -> {load()}", flush=True)  # fmt: skip


# ---------------------------------------------------------------- main


def run_config(args: argparse.Namespace, workdir: Path) -> RunConfig:
    """The config's model, rollout and train settings; a fresh adapter (the same compute as
    the config's starting adapter, which may not exist yet)."""
    config = load_config(args.config)
    model = dataclasses.replace(config.model, adapter=None)
    if args.quick:
        model = dataclasses.replace(model, path=str(build_tiny_model(workdir / "tiny", hidden_size=64, num_heads=2)))
    return dataclasses.replace(config, model=model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--samples", type=int, default=24, help="samples in the timed update")
    parser.add_argument("--quick", action="store_true", help="a 2-layer test model, small sizes: check the script")
    parser.add_argument("--profile", action="store_true", help="profile a training micro-batch and a decode")
    parser.add_argument("--alternatives", action="store_true", help="time changes the trainer could make")
    parser.add_argument("--contention", action="store_true")
    parser.add_argument("--seconds", type=float, default=20.0, help="--contention: seconds per measurement")
    parser.add_argument("--worker", choices=("train", "decode"), help=argparse.SUPPRESS)
    parser.add_argument("--cpus", help=argparse.SUPPRESS)  # --worker: the CPUs it may use ("0,1")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        config = run_config(args, Path(tmp))
        if args.worker:
            if args.cpus:  # before torch starts its threads
                os.sched_setaffinity(0, {int(cpu) for cpu in args.cpus.split(",")})
            worker(args.worker, config, args.seconds, args.quick)
            return 0
        if args.contention:
            contention(args)
        else:
            report(args, config)
    return 0


def report(args: argparse.Namespace, config: RunConfig) -> None:
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    min_s = 0.2 if args.quick else 1.5
    sizes = [256] if args.quick else [1024, 2048, 4096]
    dtype = torch_dtype(config)
    dtypes = [torch.float32] + ([torch.bfloat16] if native_bf16() else [])
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, {threads} threads, native bfloat16: {native_bf16()}; "
          f"config {args.config.name}: dtype {str(dtype).removeprefix('torch.')}, {load()}")  # fmt: skip
    peaks: dict[torch.dtype, float] = {}
    for d in dtypes:
        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            rate, n = gemm_peak(d, sizes, min_s)
            peaks[d] = rate  # the last: all threads
            print(f"GEMM peak {str(d).removeprefix('torch.'):8s} {n_threads} thread(s): {rate / 1e9:8.1f} GFLOP/s (n={n}); {load()}")
    torch.set_num_threads(threads)
    copy, read = bandwidth(64 << 20 if args.quick else GIB, min_s)
    print(f"memory bandwidth: copy {copy / 1e9:.1f} GB/s (read + write), sum {read / 1e9:.1f} GB/s (read); {load()}")

    samples = synthetic_samples(4 if args.quick else args.samples, args.quick, 49152 if not args.quick else 1000)
    figures, model = train_step(config, samples)
    shape = ModelShape.of(model)
    lora = config.train.use_lora
    padded = [w for rows, w in figures.microbatches for _ in range(rows)]
    peak = peaks.get(dtype, peaks[torch.float32])
    print(f"\nmodel: P_body {shape.body / 1e6:.1f}M, P_head {shape.head / 1e6:.1f}M, P_lora {shape.lora / 1e6:.2f}M, "
          f"{shape.layers} layers, hidden {shape.hidden}")  # fmt: skip
    print(f"trainer: {len(samples)} samples, micro-batches (rows x width) {figures.microbatches}, "
          f"{sum(figures.real_lengths)} real / {sum(padded)} padded tokens, {figures.action_tokens} action tokens, "
          f"kl_coef {config.train.kl_coef} (reference pass: {'yes' if config.train.kl_coef > 0 else 'none'})")  # fmt: skip
    print(f"  update {figures.update_s:.2f} s ({sum(figures.real_lengths) / figures.update_s:.0f} tokens/s), "
          f"of which forward ~{figures.forward_s:.2f} s (a no-grad forward of the same micro-batches); {load()}")  # fmt: skip
    print("| counted | GFLOP | GFLOP/s | % of GEMM peak (" + str(dtype).removeprefix("torch.") + ") | % of float32 peak |")
    print("|---|---|---|---|---|")
    for name, lengths in (("padding included", padded), ("padding excluded", figures.real_lengths)):
        flops = shape.train_flops(lengths, figures.action_tokens, lora)
        rate = flops / figures.update_s
        print(f"| update, {name} | {flops / 1e9:.4g} | {rate / 1e9:.1f} | {rate / peak:.1%} | {rate / peaks[torch.float32]:.1%} |")
    forward = shape.forward_flops(padded, figures.action_tokens)
    rate = forward / figures.forward_s
    print(f"| forward only, padding included | {forward / 1e9:.4g} | {rate / 1e9:.1f} | {rate / peak:.1%} | {rate / peaks[torch.float32]:.1%} |")

    rows = 256 if args.quick else config.train.max_tokens_per_microbatch
    print(f"\nGEMM at the trainer's shapes ({rows} rows = one micro-batch's tokens); {load()}")
    for name, rate in shape_gemms(model, rows, dtype, min_s):
        print(f"  {name:45s} {rate / 1e9:8.1f} GFLOP/s")
    if args.profile:
        profile_microbatch(model, samples, config, top=15)
    if args.alternatives:
        alternatives(model, samples, config, repeats=1 if args.quick else 2)

    batch, context = (4, 16) if args.quick else (min(64, config.rollout.concurrency), 400)
    print(f"\ngenerator: decoding steps of {batch} rows over a {context}-token cache, {str(dtype).removeprefix('torch.')}")
    kv_bytes = shape.kv_bytes_per_token * context * batch
    for name in ("base", "with LoRA") if hasattr(model, "disable_adapter") else ("base",):
        steps = 3 if args.quick else 8
        if name == "base" and hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                step_s = decode_step_s(model, batch, context, steps)
        else:
            step_s = decode_step_s(model, batch, context, steps)
        read_bytes = shape.weight_bytes + kv_bytes
        step_flops = 2 * (shape.body + shape.head + (shape.lora if name != "base" else 0)) * batch
        step_flops += 4 * shape.hidden * shape.layers * context * batch  # attention over the cache
        bound_bw, bound_compute = read_bytes / read, step_flops / peak
        print(f"  {name:10s} {step_s * 1000:7.1f} ms/step = {batch / step_s:7.1f} tokens/s; bandwidth bound "
              f"{bound_bw * 1000:.1f} ms ({read_bytes / 1e6:.0f} MB read: {bound_bw / step_s:.0%} of the step), "
              f"compute bound {bound_compute * 1000:.1f} ms ({bound_compute / step_s:.0%}); {load()}")  # fmt: skip
    if args.profile:
        profile_decode(model, batch, context, top=10)

if __name__ == "__main__":
    raise SystemExit(main())
