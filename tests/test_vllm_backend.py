"""The vLLM policy against a real vLLM server (``.venv-vllm``, ``make vllm-setup``).

One managed server for the whole session, started by ``open_generator`` exactly as a
training run starts it and lent to the flows the tests run (``lending.lend``), on a tiny random Llama with the real SmolLM2
tokenizer (2 heads of 32: vLLM's CPU attention needs a head size of at least 32). Its
end-of-turn token gets a large embedding so that actions end by ``stop`` often enough to
test. Every claim is checked against a Hugging Face forward pass of the same weights: the
sampled ids' logprobs under the distribution sampled from, within 1e-4.

Adapter tests run last and unload their adapter, so the base-model tests never share the
server with a loaded adapter (a vLLM CPU bug serves base requests with an adapter then).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import ModelConfig, RunConfig
from rollflow.config.train import TrainConfig
from rollflow.envs.agent import PolicyAction
from rollflow.envs.types import Message
from rollflow.generators.generator import run_adapter_prefix
from rollflow.generators.lending import lend
from rollflow.generators.policy_io import step_policy
from rollflow.generators.run_generator import open_generator
from rollflow.generators.vllm_generator import VLLMGenerator
from rollflow.policy.models import ModelRef, load_tokenizer
from rollflow.policy.sampling import SamplingSettings, sampling_logprobs
from rollflow.policy.vllm_admin import VLLMPolicyError
from rollflow.policy.vllm_backend import VLLMPolicy, adapter_name
from rollflow.policy.vllm_server import VLLMServer, free_port
from rollflow.policy.vllm_spec import VLLMServerError, VLLMServerSpec
from rollflow.policy.vllm_weights import write_lm_head_shard
from rollflow.storage.runfolder import RunFolder
from tiny_run import build_vllm_tiny_model

pytestmark = pytest.mark.slow

MAX_LEN = 3072  # above vLLM's 2048-token prefill step on CPU: see the long-prompt test
LORA_RANK = 8
TOLERANCE = 1e-4
QUESTIONS = [f"Question {i}: how many crates are in bay {i}?" for i in range(6)]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, its end-of-turn embedding made large so that stops are common."""
    return build_vllm_tiny_model(tmp_path_factory.mktemp("vllm-tiny"))


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(ModelRef(path=str(model_dir)))


@pytest.fixture(scope="session")
def run_config(model_dir: Path) -> RunConfig:
    return RunConfig(
        model=ModelConfig(path=str(model_dir)),
        rollout=RolloutConfig(
            backend="vllm", max_model_length=MAX_LEN, max_completion_tokens=12,
            vllm_kvcache_space_gib=1, generation_timeout_s=120.0, lora_serving="adapter",
        ),  # fmt: skip
        train=TrainConfig(lora_rank=LORA_RANK, lora_alpha=16.0),
    )


@pytest.fixture(scope="session")
def generator(run_config: RunConfig) -> Iterator[VLLMGenerator]:
    """The session's one generator, opened by the run's own code path and lent to the flows
    the tests start (step 0: base model)."""
    with open_generator(run_config, None, versions_in_flight=1) as opened, lend(opened) as lent:
        assert isinstance(lent, VLLMGenerator)
        step_policy(lent, None, 0)
        yield lent


@pytest.fixture(scope="session")
def server(generator: VLLMGenerator) -> VLLMServer:
    managed = generator.server
    assert managed is not None and managed.running
    print(f"vLLM server healthy after {managed.startup_s:.1f} s")
    return managed


def _policy(server: VLLMServer, tokenizer: PreTrainedTokenizerBase, **settings: float) -> VLLMPolicy:
    sampling = SamplingSettings(
        max_model_length=MAX_LEN, max_completion_tokens=12, generation_timeout_s=120.0, seed=7,
        **settings,  # type: ignore[arg-type]
    )  # fmt: skip
    return VLLMPolicy([server.base_url], tokenizer, sampling, served_model="policy", max_lora_rank=LORA_RANK)


def _act_all(policy: VLLMPolicy, conversations: Sequence[list[Message]]) -> list[PolicyAction]:
    async def one(messages: list[Message]) -> PolicyAction:
        session = policy.open_session(())
        try:
            return await session.act(messages)
        finally:
            await session.close()

    async def every() -> list[PolicyAction]:
        return list(await asyncio.gather(*(one(m) for m in conversations)))

    return asyncio.run(every())


def _hf_logprobs(
    model: PreTrainedModel, context: Sequence[int], action: Sequence[int], temperature: float, top_p: float
) -> list[float]:
    """What the transformers backend would record for ``action`` after ``context``."""
    ids = torch.tensor([[*context, *action]])
    with torch.no_grad():
        logits_TV = model(ids).logits[0, len(context) - 1 : -1]  # (A, V): predicts each action token
    logprobs_TV = sampling_logprobs(logits_TV, temperature, top_p)
    return [float(logprobs_TV[t, token]) for t, token in enumerate(action)]


def _assert_exact(
    model: PreTrainedModel, actions: Sequence[PolicyAction], temperature: float, top_p: float = 1.0
) -> None:
    for action in actions:
        expected = _hf_logprobs(model, action.prompt_delta_ids, action.token_ids, temperature, top_p)
        worst = max(abs(a - b) for a, b in zip(action.logprobs, expected, strict=True))
        assert worst < TOLERANCE, f"logprobs differ from HF by {worst:.2e}: {action.logprobs} vs {expected}"


def _conversations() -> list[list[Message]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


# ---------------------------------------------------------------- before the server starts


def test_a_model_vllm_cannot_load_gives_the_log_tail_and_flags(tmp_path: Path, own_tmpdir: Path) -> None:
    """Runs first, before the session's server: never two servers at once. In its own
    TMPDIR: the failed server's log is kept as evidence, and must not stay in /tmp."""
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["NoSuchLM"], "model_type": "nosuch"}))
    server = VLLMServer(VLLMServerSpec(str(folder), max_model_len=MAX_LEN, kvcache_space_gib=1))
    with pytest.raises(VLLMServerError) as caught:
        server.start()
    message = str(caught.value)
    assert "exited with code" in message and str(folder) in message
    assert "--logprobs-mode processed_logprobs" in message and "nosuch" in message.lower()
    assert not server.running


# ---------------------------------------------------------------- the base model


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9)])
def test_sampled_ids_and_logprobs_equal_an_hf_forward_pass(
    server: VLLMServer, tokenizer: PreTrainedTokenizerBase, hf_model: PreTrainedModel,
    temperature: float, top_p: float,
) -> None:  # fmt: skip
    policy = _policy(server, tokenizer, temperature=temperature, top_p=top_p)
    actions = _act_all(policy, _conversations())
    for action, conversation in zip(actions, _conversations(), strict=True):
        assert list(action.prompt_delta_ids) == policy.codec.render_prompt_ids(conversation, ())
        assert action.token_ids and len(action.token_ids) == len(action.logprobs)
    _assert_exact(hf_model, actions, temperature, top_p)


def test_a_second_turn_sends_only_the_exact_tokens_and_stays_exact(
    server: VLLMServer, tokenizer: PreTrainedTokenizerBase, hf_model: PreTrainedModel
) -> None:
    policy = _policy(server, tokenizer)

    async def two_turns() -> tuple[PolicyAction, PolicyAction]:
        session = policy.open_session(())
        messages: list[Message] = [{"role": "user", "content": QUESTIONS[0]}]
        first = await session.act(messages)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And bay 2?"}]
        second = await session.act(messages)
        await session.close()
        return first, second

    first, second = asyncio.run(two_turns())
    assert not second.reset
    context = [*first.prompt_delta_ids, *first.token_ids, *second.prompt_delta_ids]
    expected = _hf_logprobs(hf_model, context, second.token_ids, 1.0, 1.0)
    assert max(abs(a - b) for a, b in zip(second.logprobs, expected, strict=True)) < TOLERANCE


def test_the_same_seed_gives_the_same_tokens(server: VLLMServer, tokenizer: PreTrainedTokenizerBase) -> None:
    runs = [_act_all(_policy(server, tokenizer), _conversations()) for _ in range(2)]
    assert [a.token_ids for a in runs[0]] == [a.token_ids for a in runs[1]]


def test_a_seeded_prompt_longer_than_one_prefill_step_is_served(
    server: VLLMServer, tokenizer: PreTrainedTokenizerBase, hf_model: PreTrainedModel
) -> None:
    """~2,400 tokens: more than vLLM's 2048-token step on CPU. With chunked prefill the split
    prompt's seeded generator is rewound, which CPU generators cannot do: the engine died
    ("CPU Generator does not use offset") on the bundled game's first step."""
    question: list[Message] = [{"role": "user", "content": " ".join(["crates"] * 1200) + " in bay 3?"}]
    (action,) = _act_all(_policy(server, tokenizer), [question])
    assert len(action.prompt_delta_ids) > 2048 and action.token_ids
    _assert_exact(hf_model, [action], 1.0)


def test_endings_stop_length_and_context(server: VLLMServer, tokenizer: PreTrainedTokenizerBase) -> None:
    policy = _policy(server, tokenizer)
    eos = int(tokenizer.eos_token_id)
    actions = _act_all(policy, _conversations() * 3)
    reasons = {a.finish_reason for a in actions}
    assert reasons == {"stop", "length"}, reasons
    for action in actions:
        if action.finish_reason == "stop":
            assert action.token_ids[-1] == eos and eos not in action.token_ids[:-1]
        else:
            assert len(action.token_ids) == 12 and eos not in action.token_ids

    prompt_len = len(policy.codec.render_prompt_ids(_conversations()[0], ()))
    tight = replace(policy.settings, max_model_length=prompt_len + 3)
    short = VLLMPolicy([server.base_url], tokenizer, tight, served_model="policy")
    cut = [a for a in _act_all(short, [_conversations()[0]] * 12) if a.finish_reason != "stop"]
    assert cut and all(a.finish_reason == "context" and len(a.token_ids) == 3 for a in cut)

    full = VLLMPolicy([server.base_url], tokenizer, replace(tight, max_model_length=prompt_len), served_model="policy")
    (nothing,) = _act_all(full, [_conversations()[0]])
    assert nothing.finish_reason == "context" and nothing.token_ids == () and nothing.sampling_attempts == 0


def test_requests_are_spread_over_servers_and_retried_on_the_next(
    server: VLLMServer, tokenizer: PreTrainedTokenizerBase
) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    alias = server.base_url.replace("127.0.0.1", "localhost")
    policy = VLLMPolicy(
        [server.base_url, dead, alias], tokenizer, SamplingSettings(max_model_length=MAX_LEN, max_completion_tokens=4),
        served_model="policy",
    )  # fmt: skip
    actions = _act_all(policy, _conversations())
    served = {key.base_url for key in policy.stats.sampled_by}
    assert served == {server.base_url, alias}
    assert policy.stats.retries == 2  # sessions 1 and 4 started on the dead one
    assert sorted(a.sampling_attempts for a in actions) == [1, 1, 1, 1, 2, 2]


def test_retries_give_up_after_max_sampling_attempts(tokenizer: PreTrainedTokenizerBase) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    settings = SamplingSettings(max_model_length=MAX_LEN, max_sampling_attempts=3)
    policy = VLLMPolicy([dead], tokenizer, settings, served_model="policy")
    with pytest.raises(VLLMPolicyError, match=r"all 3 attempts .*ConnectError"):
        _act_all(policy, _conversations()[:1])


def test_first_contact_checks_the_model_length_and_the_logprobs_mode(
    server: VLLMServer, tokenizer: PreTrainedTokenizerBase
) -> None:
    _policy(server, tokenizer).connect(check_logprobs_mode=True)  # processed logprobs: accepted
    too_long = VLLMPolicy(
        [server.base_url], tokenizer, SamplingSettings(max_model_length=MAX_LEN * 2), served_model="policy"
    )
    with pytest.raises(VLLMPolicyError, match=f"max_model_len={MAX_LEN}"):
        too_long.connect(check_logprobs_mode=False)
    wrong_name = VLLMPolicy([server.base_url], tokenizer, SamplingSettings(max_model_length=MAX_LEN), served_model="other")
    with pytest.raises(VLLMPolicyError, match="does not serve 'other'"):
        wrong_name.connect(check_logprobs_mode=False)


# ---------------------------------------------------------------- adapters (last: see the docstring)


def _adapter(model_dir: Path, dest: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    lora = LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights=False)  # fmt: skip
    peft_model = get_peft_model(base, lora)
    with torch.no_grad():  # random B too: an adapter that really moves the logprobs
        for name, weight in peft_model.named_parameters():
            if "lora_B" in name:
                weight.normal_(0.0, 0.5)
    peft_model.save_pretrained(str(dest))
    return dest


def _commit_checkpoint(folder: RunFolder, step: int, adapter: Path, version: int) -> None:
    tmp = folder.new_checkpoint_tmp(step)
    for item in adapter.iterdir():
        shutil.copy2(item, tmp / item.name)
    info = {"policy_version": version, "step": step, "use_lora": True, "format": "peft"}
    (tmp / "version.json").write_text(json.dumps(info))
    folder.commit_checkpoint(tmp, step)


def _with_adapter(model_dir: Path, adapter: Path) -> PreTrainedModel:
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).eval()


def test_each_step_samples_with_its_checkpoints_adapter_and_is_stamped_with_its_version(
    generator: VLLMGenerator, server: VLLMServer, run_config: RunConfig, model_dir: Path, hf_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path,
) -> None:  # fmt: skip
    folder = RunFolder(tmp_path / "run")
    adapters = [_adapter(model_dir, tmp_path / f"adapter-{v}", seed=v) for v in (1, 2)]
    try:
        for step, adapter in enumerate(adapters, start=1):
            _commit_checkpoint(folder, step - 1, adapter, version=step)
            with open_generator(run_config, folder, versions_in_flight=1) as bound:  # the lent one, bound to the run
                assert bound is generator and generator.server is server, "the step used the lent server"
                policy = step_policy(bound, folder, step)
            assert isinstance(policy, VLLMPolicy)
            name = adapter_name(run_adapter_prefix(folder), step)  # policy-run-<hash>-v1
            assert policy.version == step and policy.request_model == name
            actions = _act_all(policy, _conversations())
            sampled = [key for key in policy.stats.sampled_by if key.version == step]
            assert {(k.model, k.base_url) for k in sampled} == {(name, server.base_url)}
            _assert_exact(_with_adapter(model_dir, adapter), actions, 1.0)
            with pytest.raises(AssertionError, match="differ from HF"):
                _assert_exact(hf_model, actions, 1.0)  # the adapter really changed them
            served = {m["id"] for m in httpx.get(f"{server.base_url}/models").json()["data"]}
            assert served == {"policy", name}, "the previous version was unloaded"
    finally:
        step_policy(generator, None, 0)  # base again: adapter unloaded
    base_actions = _act_all(_policy(server, tokenizer), _conversations())
    _assert_exact(hf_model, base_actions, 1.0)


def test_an_adapter_above_the_servers_rank_limit_is_refused(
    server: VLLMServer, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    adapter = tmp_path / "wide"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": LORA_RANK * 4}))
    with pytest.raises(VLLMPolicyError, match=f"rank {LORA_RANK * 4}, above the server's --max-lora-rank {LORA_RANK}"):
        _policy(server, tokenizer).load_adapter(adapter, 9, "policy-wide-v9")


def test_rollflow_train_on_the_vllm_server_stamps_each_step_with_the_version_that_sampled_it(
    generator: VLLMGenerator, server: VLLMServer, run_config: RunConfig, model_dir: Path, prefect_harness: object, tmp_path: Path
) -> None:
    """Two GRPO steps through the real flow; step 1's tokens are scored against step 0's adapter."""
    from rollflow.flows.train import train_flow
    from rollflow.storage.schemas import table_to_episode_records
    from rollflow.config.run import ValidationConfig, config_to_toml

    config = replace(
        run_config,
        env=replace(run_config.env, name="varied_reward_env:load_environment"),
        rollout=replace(run_config.rollout, batch_size=2, episodes_per_task=2, max_turns=2, concurrency=4),
        train=replace(run_config.train, num_steps=2, learning_rate=1e-2),
        validation=ValidationConfig(validation_interval=0),
        tracking=replace(run_config.tracking, enabled=False),
        storage=replace(run_config.storage, runs_dir=str(tmp_path / "runs")),
    )  # the session server's spec: the flow uses the lent generator
    config_path = tmp_path / "vllm.toml"
    config_path.write_text(config_to_toml(config))
    try:
        run_dir = Path(train_flow(config_path=str(config_path), run_dir=str(tmp_path / "run")))
        assert generator.server is server and server.running, "the flow used the lent server and left it running"
        assert server.restarts == 0
    finally:
        step_policy(generator, None, 0)  # base again: adapter unloaded
    folder = RunFolder(run_dir)
    for step in (0, 1):
        episodes = table_to_episode_records(folder.read_stage(step, "episodes"))
        assert len(episodes) == 4 and {e.rollout.error for e in episodes} == {None}
        assert {e.rollout.policy_version for e in episodes} == {step}
    checkpoint = folder.checkpoint_dir(0)
    sampler = _with_adapter(model_dir, checkpoint)
    for record in table_to_episode_records(folder.read_stage(1, "episodes")):
        context: list[int] = []
        for action in record.rollout.actions:
            context += action.prompt_delta_ids
            expected = _hf_logprobs(sampler, context, action.token_ids, 1.0, 1.0)
            worst = max(abs(a - b) for a, b in zip(action.logprobs, expected, strict=True))
            assert worst < TOLERANCE, f"{record.episode_id}: step 1 was not sampled by version 1 ({worst:.2e})"
            context += action.token_ids


def test_full_weights_are_swapped_into_the_running_server_in_place(
    generator: VLLMGenerator, server: VLLMServer, run_config: RunConfig, model_dir: Path, hf_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path,
) -> None:
    """Last: it replaces the session's server (one at a time) with one without LoRA, then
    moves it to new full weights and back without a restart. The same prompts run before
    and after each swap: a prefix cache kept across it would give the old weights' logprobs."""
    import time

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn_like(weight) * 0.05)
    folder = RunFolder(tmp_path / "run")
    tmp = folder.new_checkpoint_tmp(0)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "version.json").write_text(json.dumps({"policy_version": 1, "step": 0, "use_lora": False}))
    folder.commit_checkpoint(tmp, 0)
    full = replace(run_config, train=replace(run_config.train, use_lora=False))
    generator.close()  # one server at a time: the session's is done
    with open_generator(full, folder, versions_in_flight=1) as in_place:
        running = in_place.server
        assert running is not None and running is not server, "a LoRA-less spec is another server"
        with pytest.raises(VLLMPolicyError, match="tied input and output embeddings"):
            step_policy(in_place, folder, 1)  # no lm_head shard: refused, not served stale
        write_lm_head_shard(folder.checkpoint_dir(0), model.get_input_embeddings().weight)  # as save_checkpoint does

        base_policy = step_policy(in_place, folder, 0)
        _assert_exact(hf_model, _act_all(base_policy, _conversations()), 1.0)  # primes the prefix cache

        started = time.monotonic()
        policy = step_policy(in_place, folder, 1)
        swap_s = time.monotonic() - started
        print(f"full-weight sync in place: {swap_s:.2f} s (a restart took {running.startup_s:.1f} s)")
        assert in_place.server is running and running.running, "no restart"
        assert isinstance(policy, VLLMPolicy) and policy.version == 1 and policy.adapter_name is None
        new_weights = AutoModelForCausalLM.from_pretrained(str(folder.checkpoint_dir(0))).eval()
        _assert_exact(new_weights, _act_all(policy, _conversations()), 1.0)

        back = step_policy(in_place, folder, 0)  # the base model's own weights again
        assert in_place.server is running and back.version == 0
        _assert_exact(hf_model, _act_all(back, _conversations()), 1.0)
    assert not running.running, "the generator's own server stopped with it"
