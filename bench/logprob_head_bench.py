"""The trainer's logprob head (issue 23): forward + backward of the chosen tokens' log-softmax,
the head the trainer had before against the one it has, alone and inside a forward + backward.

``before``: ``x = logits.float() / temperature; x.gather(target) - logsumexp(x)`` over the
(N, V) logits of the wanted positions (what ``token_logprobs`` did until issue 23: a float32
copy of the bfloat16 logits, kept for the backward, and each backward op over all of it).
``cross_entropy``: ``-F.cross_entropy(logits.float() / temperature, targets, reduction="none")``,
the fused log-softmax + gather the issue proposed. ``chunked``: ``rollflow.tasks.trainer_logprobs.
chosen_logprobs``, the same float32 arithmetic a few rows at a time.

Two timings each, best of ``--repeats`` after a warm-up, on one thread by default (CPU seconds
of this process, which a busy machine moves less than wall seconds; both are printed):

- **head**: (N, hidden) states -> the tied output projection -> logprobs -> ``sum().backward()``,
  N = rows x wanted tokens per row.
- **model**: ``--layers`` decoder layers of the bundled SmolLM2-135M's shape (hidden 576, 9
  heads, 3 KV heads, MLP 1536, vocabulary 49152; random weights, LoRA rank 16 on q/k/v/o in
  float32 as the trainer has it) over ``--rows`` x ``--width`` tokens; ``--layers 30`` is the
  real depth. The per-layer cost (model minus head, over layers) extrapolates the share of the
  head at 30 layers.

Each figure comes with the load average (the machine may be shared). The gap to ``before``
in values and gradients is printed: 0 or a float32 rounding is what ``chunked`` must show.

    nice -n 19 .venv/bin/python bench/logprob_head_bench.py [--dtype bfloat16 float32]
        [--layers 2] [--rows 4] [--width 600] [--wanted 150] [--threads 1] [--repeats 3]
        [--heads cross_entropy chunked] [--head-only]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from rollflow.tasks.trainer_logprobs import chosen_logprobs

HeadFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def before(logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature: float) -> torch.Tensor:
    x_NV = logits_NV.float() / temperature
    return x_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x_NV, dim=-1)


def cross_entropy(logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature: float) -> torch.Tensor:
    return -F.cross_entropy(logits_NV.float() / temperature, targets_N, reduction="none")


HEADS: dict[str, HeadFn] = {"before": before, "cross_entropy": cross_entropy, "chunked": chosen_logprobs}


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def smollm_shape(layers: int, dtype: torch.dtype) -> LlamaForCausalLM:
    from peft import LoraConfig, get_peft_model

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    lora = LoraConfig(r=16, lora_alpha=32.0, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)  # the adapter in float32, as peft keeps it
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)  # a trained-looking adapter, not B = 0
    return model.eval()


def best(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of the fastest of ``repeats`` runs after one warm-up."""
    run()
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        run()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return min(cpu), min(wall)


def wanted_mask(rows: int, width: int, wanted: int) -> torch.Tensor:
    """(rows, width - 1): four action spans per row, ``wanted`` tokens in all, the rest context."""
    mask = torch.zeros(rows, width - 1, dtype=torch.bool)
    span = wanted // 4
    for b in range(rows):
        for k in range(4):
            start = (k + 1) * (width - 1) // 5 - span // 2 + b
            mask[b, start : start + span] = True
    return mask


def head_bench(model: LlamaForCausalLM, n: int, repeats: int) -> dict[str, tuple[float, float]]:
    head = model.get_output_embeddings()
    dtype = head.weight.dtype
    torch.manual_seed(1)
    hidden = (torch.randn(n, head.weight.shape[1]) * 2).to(dtype).requires_grad_(True)
    targets = torch.randint(0, head.weight.shape[0], (n,))
    weights = torch.randn(n)  # a loss that weighs tokens differently, as the GRPO one does
    figures, reference = {}, None
    for name, fn in HEADS.items():
        def run(fn: HeadFn = fn) -> None:
            hidden.grad = None
            (fn(head(hidden), targets, 0.7) * weights).sum().backward()

        figures[name] = best(run, repeats)
        values = fn(head(hidden), targets, 0.7).detach()
        grads = hidden.grad.detach().float().clone()
        if reference is None:
            reference = (values, grads)
        gap_v = (values - reference[0]).abs().max().item()
        gap_g = (grads - reference[1]).abs().max().item()
        print(f"  head  {name:14s} {figures[name][0]:7.3f} CPU s {figures[name][1]:7.3f} wall s; "
              f"max |logprob - before's| {gap_v:.1e}, |grad - before's| {gap_g:.1e}; {load()}", flush=True)
    return figures


def model_bench(model: LlamaForCausalLM, rows: int, width: int, wanted: int, repeats: int
                ) -> dict[str, tuple[float, float]]:
    torch.manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (rows, width))
    attention = torch.ones_like(ids)
    wanted_BT = wanted_mask(rows, width, wanted)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, :-1] = wanted_BT
    targets = ids[:, 1:][wanted_BT]
    figures = {}
    for name, fn in HEADS.items():
        def run(fn: HeadFn = fn) -> None:
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=keep, use_cache=False).logits
            fn(logits, targets, 0.7).sum().backward()

        figures[name] = best(run, repeats)
        print(f"  model {name:14s} {figures[name][0]:7.3f} CPU s {figures[name][1]:7.3f} wall s; {load()}", flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--width", type=int, default=600)
    parser.add_argument("--wanted", type=int, default=150, help="wanted (action) tokens per row")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--head-only", action="store_true")
    parser.add_argument("--heads", nargs="+", choices=list(HEADS), default=list(HEADS), help="'before' always runs")
    args = parser.parse_args(argv)
    for name in [h for h in HEADS if h != "before" and h not in args.heads]:
        del HEADS[name]
    torch.set_num_threads(args.threads)
    n = args.rows * (args.wanted // 4 * 4)
    print(f"{args.rows} rows x {args.width} tokens, {n} wanted; {args.layers} layers; "
          f"{args.threads} thread(s); {load()}")
    for dtype_name in args.dtype:
        model = smollm_shape(args.layers, getattr(torch, dtype_name))
        print(f"\n{dtype_name}:")
        head = head_bench(model, n, args.repeats)
        if args.head_only:
            continue
        full = model_bench(model, args.rows, args.width, args.wanted, args.repeats)
        per_layer = (full["before"][0] - head["before"][0]) / args.layers
        at_30 = full["before"][0] + (30 - args.layers) * per_layer
        for name in [h for h in HEADS if h != "before"]:
            saved = full["before"][0] - full[name][0]
            print(f"  {name}: saves {saved:+.3f} CPU s of {full['before'][0]:.3f} here ({saved / full['before'][0]:+.1%}); "
                  f"of ~{at_30:.2f} at 30 layers ({saved / at_30:+.1%}, extrapolated at {per_layer:.3f} s a layer)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
