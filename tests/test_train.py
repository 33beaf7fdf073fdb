"""The GRPO update on tiny real models, and the train stage with checkpoints and resume."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollflow.config.run import RunConfig, parse_config
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.hooks import EnvironmentMultiTurn
from rollflow.envs.runner import handle_from_hook, play_groups
from rollflow.envs.types import EnvironmentEpisode, EnvironmentStepResult, Message, RewardResult, TaskExample
from rollflow.generators.checkpoints import latest_checkpoint, seed_everything
from rollflow.generators.models import load_policy_for_training, policy_model_ref
from rollflow.policy.loss import LossSettings
from rollflow.policy.sampling import SamplingSettings
from rollflow.policy.transformers_backend import TransformersPolicy
from rollflow.storage.records import EpisodeRecord, SampleRecord, ScoreRecord
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import sample_records_to_table
from rollflow.tasks.flatten import flatten_episode_to_samples
from rollflow.tasks.grpo_update import (
    UpdateSettings,
    grpo_update,
    make_optimizer,
    pack_microbatches,
    split_minibatches,
)
from rollflow.tasks.grpo_update import warmup_learning_rate
from rollflow.tasks.train import adapter_off_reference, train_stage
from rollflow.tasks.trainer_logprobs import chosen_logprobs
from rollflow.tasks.trainer_logprobs import token_logprobs

VOCAB = 40


def micro_model(seed: int = 0, attention_dropout: float = 0.0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=attention_dropout,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def sample(sample_id: str, ids: list[int], mask: list[int], advantage: float,
           logprobs: list[float] | None = None) -> SampleRecord:
    return SampleRecord(
        run_id="run", step=0, sample_id=sample_id, episode_id=sample_id.split("#")[0],
        group_id="train/0/0", input_ids=tuple(ids), loss_mask=tuple(mask),
        advantages=tuple(advantage * m for m in mask),
        sampler_logprobs=tuple(logprobs or [0.0] * len(ids)),
    )


def on_policy(model: LlamaForCausalLM, s: SampleRecord, temperature: float = 1.0) -> SampleRecord:
    """The sample with the sampler logprobs the current model gives its action tokens."""
    ids = torch.tensor([s.input_ids])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids), temperature)[0].tolist()
    aligned = [0.0] + [v if m else 0.0 for v, m in zip(lp, s.loss_mask[1:], strict=True)]
    return dataclasses.replace(s, sampler_logprobs=tuple(aligned))


def action_logprob(model: LlamaForCausalLM, s: SampleRecord) -> float:
    ids = torch.tensor([s.input_ids])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0]
    return float((lp * torch.tensor(s.loss_mask[1:], dtype=torch.float32)).sum())


def batch(model: LlamaForCausalLM) -> list[SampleRecord]:
    raw = [
        sample("e0#0", [1, 5, 6, 7, 8, 9], [0, 0, 1, 1, 0, 1], +1.0),
        sample("e1#0", [1, 5, 10, 11, 12], [0, 0, 1, 1, 1], -1.0),
        sample("e2#0", [1, 3, 4, 20, 21, 22, 23, 24, 25], [0, 0, 0, 1, 1, 1, 0, 1, 1], +0.5),
        sample("e3#0", [1, 30, 31], [0, 1, 1], -0.5),
    ]
    return [on_policy(model, s) for s in raw]


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_update_raises_positive_and_lowers_negative_actions(loss: str) -> None:
    model = micro_model()
    samples = batch(model)
    before = [action_logprob(model, s) for s in samples]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    settings = UpdateSettings(loss=LossSettings(name=loss), normaliser=16.0)
    stats = grpo_update(model, None, optimizer, samples, settings)
    after = [action_logprob(model, s) for s in samples]
    assert after[0] > before[0] and after[2] > before[2]  # positive advantage
    assert after[1] < before[1] and after[3] < before[3]  # negative advantage
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)  # on-policy: ratio 1
    assert stats.num_action_tokens == 13 and stats.num_samples == 4 and stats.grad_norm > 0


def test_micro_batch_split_does_not_change_the_update() -> None:
    base = micro_model()
    samples = batch(base)
    weights = []
    for budget in (10_000, 9):  # everything at once, then one sample per micro-batch
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        settings = UpdateSettings(max_tokens_per_microbatch=budget, max_grad_norm=1e9)
        stats = grpo_update(model, None, optimizer, samples, settings)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        assert stats.num_microbatches == (1 if budget > 100 else 4)
    assert torch.allclose(weights[0], weights[1], atol=1e-6)
    assert not torch.equal(weights[0], torch.cat([p.flatten() for p in base.parameters()]))


def test_minibatches_take_one_step_each_on_a_share_of_every_group() -> None:
    samples = batch(micro_model())
    assert [[s.sample_id for s in m] for m in split_minibatches(samples, 2)] == [
        ["e0#0", "e2#0"], ["e1#0", "e3#0"]]
    assert len(split_minibatches(samples, 9)) == 4  # never an empty minibatch

    base = micro_model()
    samples = batch(base)
    results = {}
    for count in (1, 2):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        stats = grpo_update(model, None, optimizer, samples, UpdateSettings(minibatches=count))
        steps = {int(state["step"]) for state in optimizer.state.values()}
        results[count] = (stats, steps, torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert results[1][1] == {1} and results[2][1] == {2}  # Adam's step count
    assert results[2][0].num_action_tokens == results[1][0].num_action_tokens == 13
    assert not torch.equal(results[1][2], results[2][2])
    # The second step scores actions the first one moved: the ratio is no longer exactly 1.
    assert results[2][0].ratio_mean != pytest.approx(1.0, abs=1e-7)


def test_learning_rate_warms_up_linearly_over_the_runs_optimizer_steps() -> None:
    assert [warmup_learning_rate(0.3, 3, k) for k in range(5)] == pytest.approx([0.1, 0.2, 0.3, 0.3, 0.3])
    assert warmup_learning_rate(0.3, 0, 0) == 0.3  # no warm-up: the rate from the first step

    base = micro_model()
    samples = batch(base)
    settings = UpdateSettings(minibatches=2, learning_rate=1e-2, lr_warmup_steps=4)
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    moves = {}
    for warmup in (0, 4):
        model = copy.deepcopy(base)
        optimizer = make_optimizer(model, 1e-2)
        one = grpo_update(model, None, optimizer, samples[:1], dataclasses.replace(settings, minibatches=1,
                                                                                  lr_warmup_steps=warmup))
        moves[warmup] = (flat(model) - flat(base)).abs().max().item()
        if warmup:
            assert one.learning_rate == pytest.approx(2.5e-3)
            # Two more optimizer steps (steps 1 and 2 of the run); then a fresh optimizer
            # restored from this one's state (as the next train stage restores its
            # checkpoint's) takes steps 3 and 4 at the full rate.
            assert grpo_update(model, None, optimizer, samples, settings).learning_rate == pytest.approx(7.5e-3)
            restored = make_optimizer(model, 1e-2)
            restored.load_state_dict(optimizer.state_dict())
            last = grpo_update(model, None, restored, samples, settings)
            assert last.learning_rate == pytest.approx(1e-2)
            assert {int(state["step"]) for state in restored.state.values()} == {5}
    # Adam's first step moves a parameter by about the rate whatever its gradient: a quarter.
    assert moves[0] == pytest.approx(1e-2, rel=0.05)
    assert moves[4] == pytest.approx(2.5e-3, rel=0.05)


def test_minibatches_still_raise_positive_and_lower_negative_actions() -> None:
    model = micro_model()
    samples = batch(model)
    before = [action_logprob(model, s) for s in samples]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    grpo_update(model, None, optimizer, samples, UpdateSettings(normaliser=16.0, minibatches=2))
    after = [action_logprob(model, s) for s in samples]
    assert after[0] > before[0] and after[2] > before[2]
    assert after[1] < before[1] and after[3] < before[3]


def test_values_at_masked_positions_do_not_matter() -> None:
    base = micro_model()
    samples = batch(base)
    noisy = [dataclasses.replace(
        s,
        advantages=tuple(a if m else 99.0 for a, m in zip(s.advantages, s.loss_mask, strict=True)),
        sampler_logprobs=tuple(v if m else -500.0 for v, m in zip(s.sampler_logprobs, s.loss_mask, strict=True)),
    ) for s in samples]
    results = []
    for data in (samples, noisy):
        model = copy.deepcopy(base)
        grpo_update(model, None, torch.optim.SGD(model.parameters(), lr=0.1), data, UpdateSettings())
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(results[0], results[1])


def test_sampling_temperature_is_used_for_the_ratio() -> None:
    model = micro_model()
    samples = [on_policy(model, s, temperature=0.7) for s in batch(model)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    at_sampling_t = grpo_update(model, None, optimizer, samples, UpdateSettings(temperature=0.7))
    at_other_t = grpo_update(model, None, optimizer, samples, UpdateSettings(temperature=1.0))
    assert at_sampling_t.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert at_other_t.ratio_mean != pytest.approx(1.0, abs=1e-3)


def test_no_action_tokens_means_no_step() -> None:
    model = micro_model()
    before = [p.detach().clone() for p in model.parameters()]
    stats = grpo_update(model, None, torch.optim.SGD(model.parameters(), lr=1.0),
                        [sample("e#0", [1, 2, 3], [0, 0, 0], 1.0)], UpdateSettings())
    assert stats.num_action_tokens == 0 and stats.num_microbatches == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_pack_microbatches_respects_the_padded_budget() -> None:
    samples = [sample(f"e{i}#0", [1] * n, [0] * n, 0.0) for i, n in enumerate([3, 9, 4, 5, 2, 12])]
    batches = pack_microbatches(samples, max_tokens=10)
    assert sorted(s.sample_id for b in batches for s in b) == sorted(s.sample_id for s in samples)
    for b in batches:
        longest = max(len(s.input_ids) for s in b)
        assert len(b) * longest <= 10 or len(b) == 1
    assert [len(b) for b in batches] == [1, 1, 2, 2]  # 12 | 9 | 5,4 | 3,2


# ---------------------------------------------------------------- the stage (tiny HF model)


def tiny_config(model_dir: Path, **train: object) -> RunConfig:
    return parse_config({
        "model": {"path": str(model_dir)},
        "rollout": {"max_model_length": 256, "max_completion_tokens": 16},
        "train": {"learning_rate": 1e-2, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3, **train},
    })


def stage_samples(step: int) -> list[SampleRecord]:
    rows = [
        ([1, 17, 300, 301, 302, 2, 40, 41, 42], [0, 0, 1, 1, 1, 0, 0, 1, 1], 1.0),
        ([1, 17, 500, 501, 2, 43, 44], [0, 0, 1, 1, 0, 1, 1], -1.0),
        ([1, 18, 600, 601, 602, 603], [0, 0, 1, 1, 1, 1], 0.5),
    ]
    return [
        dataclasses.replace(
            sample(f"train/{step}/0/{i}#0", [t + step for t in ids], mask, adv,
                   [-3.0 - 0.1 * k if m else 0.0 for k, m in enumerate(mask)]),
            step=step,
        )
        for i, (ids, mask, adv) in enumerate(rows)
    ]


def write_samples(run_dir: Path, step: int) -> None:
    RunFolder(run_dir).write_stage(sample_records_to_table(stage_samples(step)), step, "samples")


def train_step(config: RunConfig, run_dir: Path, step: int) -> Path:
    """The train stage on step ``step``'s samples, from the checkpoint before it (no teacher)."""
    folder = RunFolder(run_dir)
    p = folder.step_paths(step)
    return train_stage(config, p.samples, None, folder.checkpoint_before(step), p.checkpoint, p.train_json)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_resume_from_checkpoint_equals_uninterrupted(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_model_dir)
    run_dir = tmp_path / "run"
    for step in (0, 1):  # each call loads the previous checkpoint from disk, as a resume does
        write_samples(run_dir, step)
        train_step(config, run_dir, step)
    folder = RunFolder(run_dir)
    latest = latest_checkpoint(folder)
    assert latest is not None and (latest.step, latest.policy_version) == (1, 2)
    resumed, _ = load_policy_for_training(config, latest)

    model, tokenizer = load_policy_for_training(config, None)  # one process, no disk between
    optimizer = make_optimizer(model, config.train.learning_rate)
    seed_everything(config.train.seed)
    settings = UpdateSettings.from_config(config, tokenizer.pad_token_id)
    for step in (0, 1):
        grpo_update(model, None, optimizer, stage_samples(step), settings)
    expected = trainable_state(model)
    got = trainable_state(resumed)
    assert set(got) == set(expected) and len(got) > 0
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    result = folder.read_train_result(1)
    assert result.policy_version == 2 and result.num_action_tokens > 0 and result.loss != 0.0


def test_train_stage_is_deterministic_idempotent_and_recovers_train_json(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = tiny_config(tiny_model_dir, kl_coef=0.05)
    states = []
    for name in ("a", "b"):
        write_samples(tmp_path / name, 0)
        train_step(config, tmp_path / name, 0)
        checkpoint = latest_checkpoint(RunFolder(tmp_path / name))
        states.append(trainable_state(load_policy_for_training(config, checkpoint)[0]))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    folder = RunFolder(tmp_path / "a")
    first = folder.read_train_result(0)
    assert first.kl == pytest.approx(0.0, abs=1e-6)  # LoRA starts at B = 0: policy == reference
    # killed after the checkpoint was committed, before train.json: rewritten from it
    folder.stage_path(0, "train").unlink()
    checkpoint_files = sorted(p.stat().st_mtime_ns for p in folder.checkpoint_dir(0).iterdir())
    train_step(config, tmp_path / "a", 0)
    assert folder.read_train_result(0) == first
    assert sorted(p.stat().st_mtime_ns for p in folder.checkpoint_dir(0).iterdir()) == checkpoint_files


def test_full_weight_training_and_checkpoint_pruning(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_model_dir, use_lora=False, learning_rate=1e-3, keep_checkpoints=1)
    run_dir = tmp_path / "run"
    for step in (0, 1):
        write_samples(run_dir, step)
        train_step(config, run_dir, step)
    folder = RunFolder(run_dir)
    assert [s for s, _ in folder.checkpoints()] == [1]  # step 0 pruned
    latest = latest_checkpoint(folder)
    assert latest is not None and not latest.use_lora
    ref = policy_model_ref(config, latest)
    assert ref.path == str(latest.path) and ref.adapter is None
    trained, _ = load_policy_for_training(config, latest)
    base, _ = load_policy_for_training(config, None)
    changed = [n for n, p in trained.named_parameters()
               if not torch.equal(p, dict(base.named_parameters())[n])]
    assert changed, "full-weight training changed no weight"


def test_lora_reference_is_the_adapter_switched_off(tiny_model_dir: Path) -> None:
    config = tiny_config(tiny_model_dir)
    model, _ = load_policy_for_training(config, None)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)  # make the adapter matter
    ids = torch.tensor([[1, 17, 300, 301, 302]])
    mask = torch.ones_like(ids)
    wanted = torch.tensor([[False, True, True, False]])
    with torch.no_grad():
        policy = token_logprobs(model, ids, mask, 1.0, wanted)
    reference = adapter_off_reference(model, 1.0)(ids, mask, wanted)
    with model.disable_adapter(), torch.no_grad():
        plain = token_logprobs(model, ids, mask, 1.0, wanted)
    assert torch.equal(reference, plain)
    assert not torch.allclose(reference, policy)


def test_logprobs_of_wanted_tokens_only_match_the_full_computation(tiny_model_dir: Path) -> None:
    config = tiny_config(tiny_model_dir)
    model, _ = load_policy_for_training(config, None)
    ids = torch.tensor([[1, 17, 300, 301, 302, 5], [1, 18, 40, 41, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    wanted = torch.tensor([[False, True, True, False, True], [False, False, True, False, False]])
    with torch.no_grad():
        full = token_logprobs(model, ids, mask, 0.7)
        sparse = token_logprobs(model, ids, mask, 0.7, wanted)
    assert torch.allclose(sparse[wanted], full[wanted], atol=1e-5)
    assert torch.all(sparse[~wanted] == 0)


def _logprobs_by_log_softmax(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor,
                             temperature: float) -> torch.Tensor:
    """The reference: the whole log-softmax over the vocabulary, then the chosen token's entry."""
    logits_BTV = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    logprobs_BTV = torch.log_softmax(logits_BTV / temperature, dim=-1)
    return logprobs_BTV.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("sparse", [True, False])
def test_token_logprobs_and_their_gradients_are_log_softmax_and_gather(
    monkeypatch: pytest.MonkeyPatch, sparse: bool
) -> None:
    # 3 rows of logits per chunk, so the 7 wanted rows (and the 14 of the full path) end mid-chunk
    monkeypatch.setattr(importlib.import_module("rollflow.tasks.trainer_logprobs"), "_HEAD_CHUNK_BYTES", 4 * VOCAB * 3)
    model = micro_model(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # peaked distributions: chosen logprobs from -5 to -21
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13, 14, 15, 0, 0, 0]])
    mask = torch.tensor([[1] * 8, [1, 1, 1, 1, 1, 0, 0, 0]])
    wanted = torch.tensor([[False, True, True, False, True, True, False],
                           [True, False, True, True, False, False, False]])
    used = wanted if sparse else torch.ones_like(wanted)
    weights = torch.randn(wanted.shape, generator=torch.Generator().manual_seed(0))  # uneven per-token weights
    params = [p for p in model.parameters()]

    def values_and_grads(logprobs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grads = torch.autograd.grad((logprobs * weights * used).sum(), params)
        return logprobs.detach(), list(grads)

    mine, mine_grads = values_and_grads(token_logprobs(model, ids, mask, 0.7, wanted if sparse else None))
    ref, ref_grads = values_and_grads(_logprobs_by_log_softmax(model, ids, mask, 0.7))
    assert mine.dtype == torch.float32 and mine.shape == ref.shape
    assert ref[used].max() - ref[used].min() > 5  # far from the uniform -log(40) everywhere
    assert torch.allclose(mine[used], ref[used], atol=1e-5, rtol=0)
    assert torch.all(mine[~used] == 0)
    assert any(g.abs().max() > 1e-2 for g in ref_grads)
    for p, g_mine, g_ref in zip(params, mine_grads, ref_grads, strict=True):
        assert torch.allclose(g_mine, g_ref, atol=1e-5, rtol=1e-5), (p.shape, (g_mine - g_ref).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chosen_logprobs_is_the_plain_float32_expression_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The chunked head against what ``token_logprobs`` computed before it: the same values and
    the same gradient, in the logits' dtype, to the last bit."""
    monkeypatch.setattr(importlib.import_module("rollflow.tasks.trainer_logprobs"), "_HEAD_CHUNK_BYTES", 4 * 1000 * 4)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(11, 1000, generator=gen) * 4).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 1000, (11,), generator=gen)
    weights = torch.randn(11, generator=gen)

    def plain(x_NV: torch.Tensor) -> torch.Tensor:
        x_NV = x_NV.float() / 0.7
        return x_NV.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x_NV, dim=-1)

    expected = plain(logits)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    got = chosen_logprobs(logits, targets, 0.7)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    with torch.no_grad():
        got_no_grad = chosen_logprobs(logits, targets, 0.7)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    assert torch.equal(got, expected) and torch.equal(got_no_grad, expected)
    assert torch.equal(got_grad, expected_grad)


@pytest.mark.parametrize("use_lora", [True, False])
def test_gradient_checkpointing_still_trains(tiny_model_dir: Path, use_lora: bool) -> None:
    config = tiny_config(tiny_model_dir, gradient_checkpointing=True, use_lora=use_lora)
    model, tokenizer = load_policy_for_training(config, None)
    before = trainable_state(model)
    optimizer = make_optimizer(model, config.train.learning_rate)
    settings = UpdateSettings.from_config(config, tokenizer.pad_token_id)
    stats = grpo_update(model, None, optimizer, stage_samples(0), settings)
    after = trainable_state(model)
    assert stats.grad_norm > 0
    assert any(not torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------- sampler and trainer agree


class TwoTurnChat(EnvironmentMultiTurn):
    """Free text, two assistant turns, then done: enough context deltas to misalign."""

    checks_tool_protocol = False
    dataset = [{"input": "Say something.", "id": "t0"}, {"input": "And again.", "id": "t1"}]

    def start_episode(self, example: TaskExample, prompt_text: str) -> list[Message]:
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt_text}]

    def max_episode_turns(self, example: TaskExample) -> int:
        return 2

    def step_episode(self, example: TaskExample, messages: list[Message], assistant_response: str) -> EnvironmentStepResult:
        done = sum(m["role"] == "assistant" for m in messages) >= 2
        return EnvironmentStepResult(done=done, messages=() if done else ({"role": "user", "content": "More."},))

    def score_episode(self, example: TaskExample, episode: EnvironmentEpisode) -> RewardResult:
        return RewardResult(score=float(len(episode.response_text) % 2))


def test_trainer_logprobs_match_the_sampler_on_flattened_episodes(tiny_model_dir: Path) -> None:
    config = tiny_config(tiny_model_dir)
    temperature = 0.8
    model, tokenizer = load_policy_for_training(dataclasses.replace(
        config, train=dataclasses.replace(config.train, use_lora=False)), None)
    policy = TransformersPolicy(model, tokenizer, SamplingSettings(
        temperature=temperature, max_completion_tokens=12, max_model_length=256, seed=5))
    handle = handle_from_hook(TwoTurnChat())
    items = handle.tasks("train")
    groups = asyncio.run(play_groups(handle, items, 2, policy, EpisodeLimits(max_turns=2), concurrency=4))
    samples = []
    for task_index, (item, rollouts) in enumerate(zip(items, groups, strict=True)):
        for index, r in enumerate(rollouts):
            assert r.error is None and len(r.actions) == 2, r.error
            gid = f"train/0/{task_index}"
            record = EpisodeRecord("run", 0, "train", item.task_id, gid, f"{gid}/{index}", index, r)
            score = ScoreRecord("run", 0, "train", item.task_id, gid, record.episode_id, 1.0, None, {},
                                0.0, 1.0, True, 0.5, 0.5, 2, False, 1.0 if index else -1.0, True)
            samples += flatten_episode_to_samples(record, score)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    settings = UpdateSettings(temperature=temperature, loss=LossSettings(clip_eps_low=0.01, clip_eps_high=0.01))
    stats = grpo_update(model, None, optimizer, samples, settings)
    assert stats.num_action_tokens > 20
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-3)  # same tokens, same distribution
    assert stats.clip_fraction == 0.0  # no token strays by even 1% from the sampler


def test_step_with_nothing_to_train_still_makes_a_version(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_model_dir)
    RunFolder(tmp_path).write_stage(sample_records_to_table([]), 0, "samples")
    train_step(config, tmp_path, 0)
    result = RunFolder(tmp_path).read_train_result(0)
    assert (result.num_samples, result.num_action_tokens, result.policy_version) == (0, 0, 1)
    write_samples(tmp_path, 1)  # the next step resumes from the untrained version fine
    train_step(config, tmp_path, 1)
    assert RunFolder(tmp_path).read_train_result(1).policy_version == 2


def test_zero_advantage_samples_add_nothing_and_are_not_computed() -> None:
    """A zero-variance group's samples only count in the normaliser: their tokens, however
    different, leave the update unchanged, and they cost no forward pass."""
    base = micro_model()
    signal = on_policy(base, sample("s#0", [1, 5, 6, 7], [0, 1, 1, 1], 1.0))
    flat_a = sample("a#0", [1, 8, 9, 10, 11], [0, 1, 1, 0, 1], 0.0)
    flat_b = sample("b#0", [1, 20, 21, 22, 23], [0, 1, 1, 0, 1], 0.0)  # same shape, other tokens
    results = []
    for flat in (flat_a, flat_b):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        stats = grpo_update(model, None, optimizer, [signal, flat], UpdateSettings(normaliser=16.0))
        assert stats.num_microbatches == 1 and stats.num_samples == 2 and stats.num_action_tokens == 6
        results.append(dict(model.named_parameters()))
    for name, param in results[0].items():
        assert torch.equal(param, results[1][name]), name
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    stats = grpo_update(model, None, optimizer, [flat_a], UpdateSettings(normaliser=16.0))
    assert stats.num_microbatches == 0 and stats.grad_norm == 0.0
    for name, param in model.named_parameters():
        assert torch.equal(param, dict(base.named_parameters())[name]), f"{name} moved on a zero gradient"


def test_a_stop_request_abandons_the_step_and_writes_no_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    from rollflow.policy.stopping import StopRequested, clear_stop, request_stop

    config = tiny_config(tiny_model_dir)
    write_samples(tmp_path, 0)
    request_stop()
    with pytest.raises(StopRequested):
        train_step(config, tmp_path, 0)
    folder = RunFolder(tmp_path)
    assert not folder.is_complete(0, "train") and folder.checkpoints() == []
    clear_stop()
    train_step(config, tmp_path, 0)  # the step is simply redone
    assert folder.is_complete(0, "train") and len(folder.checkpoints()) == 1


def test_the_model_and_its_batches_go_to_the_device_asked_for(tiny_model_dir: Path) -> None:
    """The one device a CPU-only machine has besides the CPU is ``meta``: it stands in for a
    GPU here, to show the device reaches the weights and every batch tensor (an argument
    dropped on the way would leave them on the CPU, which the suite would never notice)."""
    from rollflow.policy.models import ModelRef, load_causal_lm
    from rollflow.tasks.grpo_update import _microbatch_tensors

    model, _ = load_causal_lm(ModelRef(path=str(tiny_model_dir)), device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    tensors = _microbatch_tensors([sample("e#0", [1, 2, 3], [0, 1, 1], 1.0)], 0, model.device)
    assert {t.device.type for t in tensors.values()} == {"meta"}
