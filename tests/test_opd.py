"""On-policy distillation: the teacher stage, the OPD objective, and OPD runs on tiny models."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollflow.config.parsing import ConfigError
from rollflow.config.run import config_to_toml, load_config, parse_config
from rollflow.policy.models import ModelRef, build_tiny_model, load_causal_lm, load_tokenizer
from rollflow.policy.teacher import TeacherError, TokenizerMismatchError, parse_prompt_logprobs
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import table_to_sample_records, table_to_teacher_records
from rollflow.storage.tracking import RunTracker
from rollflow.tasks.objectives import ObjectiveSettings, opd_token_advantages
from rollflow.tasks.teacher import check_teacher
from tiny_run import tiny_config_at


# ---------------------------------------------------------------- models


def sharpened_tiny_model(dest: Path, seed: int, scale: float) -> Path:
    """A tiny random model (another seed) whose final norm is scaled: peaked next-token
    distributions, so its KL to the near-uniform student is large enough to move."""
    build_tiny_model(dest, seed=seed)
    model, _ = load_causal_lm(ModelRef(path=str(dest)))
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    model.save_pretrained(str(dest))
    return dest


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharpened_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1, scale=30.0)


@pytest.fixture(scope="module")
def wider_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose embedding has 64 rows more than the tokenizer: another vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dest = tmp_path_factory.mktemp("wider-vocab")
    tokenizer = load_tokenizer(ModelRef())
    config = LlamaConfig(
        vocab_size=len(tokenizer) + 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    return dest


def opd_config_at(dest: Path, student: Path, teacher: Path | None, **train: object) -> Path:
    """configs/tiny.toml on ``student``, one episode a task (usual for OPD), OPD from ``teacher``."""
    config = load_config(tiny_config_at(dest, student))
    train_keys = {"objective": "opd", "teacher_path": str(teacher)} if teacher is not None else {}
    train_keys.update(train)
    config = replace(
        config,
        rollout=replace(config.rollout, batch_size=4, episodes_per_task=1),
        train=replace(config.train, **train_keys),
    )
    path = dest / "opd.toml"
    path.write_text(config_to_toml(config))
    return path


# ---------------------------------------------------------------- the objective's arithmetic


def test_opd_advantage_is_teacher_minus_sampler_on_action_tokens_only() -> None:
    mask = (0, 1, 1, 0, 1)
    sampler = (0.0, -1.0, -2.0, 0.0, -0.5)
    teacher = (0.0, -0.5, -3.0, 0.0, -0.5)
    grpo = (0.0, 0.4, 0.4, 0.0, 0.4)
    out = opd_token_advantages(mask, sampler, teacher, grpo, ObjectiveSettings(kl_penalty_coef=2.0))
    assert out == pytest.approx((0.0, 1.0, -2.0, 0.0, 0.0))  # up where the teacher likes it more


def test_opd_discount_sums_later_signal_within_one_action_and_reward_mixes_in() -> None:
    mask = (0, 1, 1, 0, 1)
    sampler = (0.0, -1.0, -2.0, 0.0, -1.0)
    teacher = (0.0, 0.0, 0.0, 0.0, 0.0)  # signal 1, 2, (context), 1
    grpo = (0.0, 0.5, 0.5, 0.0, 0.5)
    settings = ObjectiveSettings(kl_penalty_coef=1.0, discount=0.5, reward_coef=2.0)
    out = opd_token_advantages(mask, sampler, teacher, grpo, settings)
    # token 1: 1 + 0.5 * 2 (the action's next token), not the next action's; + 2 * 0.5
    assert out == pytest.approx((0.0, 1.0 + 1.0 + 1.0, 2.0 + 1.0, 0.0, 1.0 + 1.0))


def test_opd_config_needs_a_teacher_and_refuses_dynamic_sampling() -> None:
    with pytest.raises(ConfigError, match="objective = 'opd' needs a teacher"):
        parse_config({"train": {"objective": "opd"}})
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        parse_config({"train": {"objective": "opd", "teacher_adapter": "a", "dynamic_sampling": True}})
    with pytest.raises(ConfigError, match="teacher_api_model"):
        parse_config({"train": {"objective": "opd", "teacher_base_url": "http://x:8000"}})
    with pytest.raises(ConfigError, match="must be one of"):
        parse_config({"train": {"objective": "distill"}})


def test_vllm_prompt_logprobs_are_read_by_token_id_and_position() -> None:
    answer = {"choices": [{"prompt_logprobs": [
        None,
        {"11": {"logprob": -1.5, "rank": 3, "decoded_token": "a"}},
        {"12": {"logprob": -0.25, "rank": 1, "decoded_token": "b"},
         "99": {"logprob": -0.1, "rank": 1, "decoded_token": "c"}},
    ]}]}
    assert parse_prompt_logprobs(answer, [10, 11, 12], "t") == [0.0, -1.5, -0.25]
    with pytest.raises(TeacherError, match="no logprob for prompt token 13 at position 2"):
        parse_prompt_logprobs(answer, [10, 11, 13], "t")


class _FlakyTokenizeServer:
    """An HTTP server on localhost whose ``/tokenize`` answers the given statuses in turn,
    then 200 with tokens: a teacher server restarting, overloaded or refusing."""

    def __init__(self, statuses: list[int]) -> None:
        import http.server
        import threading

        self.statuses, self.requests = list(statuses), 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests += 1
                status = outer.statuses.pop(0) if outer.statuses else 200
                body = json.dumps({"tokens": [1, 2, 3]} if status == 200 else {"error": "busy"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(("statuses", "requests", "error"), [
    ([503, 502], 4, None),  # a 5xx is retried like the student's requests (then /tokenize twice)
    ([503, 500, 503], 3, "HTTP 503"),  # three in a row: the last one is named
    ([400], 1, "HTTP 400"),  # a refusal is final at once
])
def test_a_server_teacher_retries_5xx_and_not_4xx(statuses: list[int], requests: int, error: str | None) -> None:
    from rollflow.policy.teacher import ServerTeacher

    server = _FlakyTokenizeServer(statuses)
    try:
        teacher = ServerTeacher(server.base_url, "policy")
        if error is None:
            assert teacher.fingerprint().probe_ids == (1, 2, 3)
        else:
            with pytest.raises(TeacherError, match=error):
                teacher.fingerprint()
    finally:
        server.close()
    assert server.requests == requests


# ---------------------------------------------------------------- the tokenizer check


def test_a_teacher_with_another_vocabulary_is_refused_naming_both(
    tiny_model_dir: Path, wider_vocab_dir: Path, tmp_path: Path
) -> None:
    config = load_config(opd_config_at(tmp_path, tiny_model_dir, wider_vocab_dir))
    with pytest.raises(TokenizerMismatchError, match="model vocabulary size") as raised:
        check_teacher(config)
    assert str(tiny_model_dir) in str(raised.value) and str(wider_vocab_dir) in str(raised.value)


def test_a_teacher_with_the_same_tokenizer_passes(tiny_model_dir: Path, teacher_dir: Path, tmp_path: Path) -> None:
    check_teacher(load_config(opd_config_at(tmp_path, tiny_model_dir, teacher_dir)))


# ---------------------------------------------------------------- runs through the flow


def hand_teacher_logprobs(model_dir: Path, input_ids: tuple[int, ...], temperature: float) -> list[float]:
    """log_softmax(logits / T) of token t at the position before it, written out by hand."""
    model, _ = load_causal_lm(ModelRef(path=str(model_dir)))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(input_ids)])).logits[0]
    out = [0.0]
    for t in range(1, len(input_ids)):
        row = logits[t - 1].double() / temperature
        out.append(float(row[input_ids[t]] - torch.logsumexp(row, dim=0)))
    return out


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow  # 11 s in a loaded suite run (docs/testing.md)
def test_a_teacher_equal_to_the_student_gives_the_samplers_logprobs(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Alignment: at step 0 the student is the base model (a fresh LoRA adds 0), so a teacher
    that is the same model must give each sampled token the sampler's own logprob."""
    from rollflow.flows.train import train_flow

    path = opd_config_at(tmp_path, tiny_model_dir, tiny_model_dir, num_steps=1)
    run = Path(train_flow(config_path=str(path), run_dir=str(tmp_path / "run")))
    folder = RunFolder(run)
    samples = table_to_sample_records(folder.read_stage(0, "samples"))
    teacher = {r.sample_id: r for r in table_to_teacher_records(folder.read_stage(0, "teacher"))}
    assert samples and set(teacher) == {s.sample_id for s in samples}
    for sample in samples:
        record = teacher[sample.sample_id]
        for lp, mine, m in zip(record.teacher_logprobs, sample.sampler_logprobs, sample.loss_mask, strict=True):
            assert lp == pytest.approx(mine, abs=1e-4) if m else lp == 0.0
        assert abs(record.teacher_kl) < 1e-4 and record.num_action_tokens == sum(sample.loss_mask)


@pytest.fixture(scope="module")
def opd_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, teacher_dir: Path,
            prefect_harness: object) -> Path:
    from rollflow.flows.train import train_flow

    root = tmp_path_factory.mktemp("opd")
    path = opd_config_at(root, tiny_model_dir, teacher_dir, num_steps=2)
    return Path(train_flow(config_path=str(path), run_dir=str(root / "run")))


@pytest.mark.slow  # 12 s in a loaded suite run (docs/testing.md)
def test_an_opd_run_writes_teacher_logprobs_aligned_to_a_forward_pass_by_hand(
    opd_run: Path, teacher_dir: Path
) -> None:
    folder = RunFolder(opd_run)
    config = load_config(folder.config_path)
    for step in (0, 1):
        samples = table_to_sample_records(folder.read_stage(step, "samples"))
        records = {r.sample_id: r for r in table_to_teacher_records(folder.read_stage(step, "teacher"))}
        assert samples and set(records) == {s.sample_id for s in samples}
    sample = samples[0]
    by_hand = hand_teacher_logprobs(teacher_dir, sample.input_ids, config.rollout.temperature)
    record = records[sample.sample_id]
    for stored, mine, m in zip(record.teacher_logprobs, by_hand, sample.loss_mask, strict=True):
        assert stored == pytest.approx(mine, abs=1e-4) if m else stored == 0.0
    gaps = [s - t for s, t, m in zip(sample.sampler_logprobs, by_hand, sample.loss_mask, strict=True) if m]
    assert record.teacher_kl == pytest.approx(sum(gaps) / len(gaps), abs=1e-4)


def test_an_opd_run_with_groups_of_one_trains(opd_run: Path) -> None:
    """One episode a task: every GRPO advantage is 0, so only OPD's signal moves the weights."""
    sql = "SELECT count(*), count_if(advantage <> 0) FROM scores WHERE split = 'train'"
    _, rows = run_query(open_run_sql([opd_run]), sql)
    assert rows[0][0] > 0 and rows[0][1] == 0
    folder = RunFolder(opd_run)
    assert all(folder.read_train_result(s).grad_norm > 0 for s in (0, 1))
    _, path = folder.latest_checkpoint()
    lora_b = [t for name, t in load_file(str(path / "adapter_model.safetensors")).items() if "lora_B" in name]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # B starts at zero


def test_teacher_kl_reaches_sql_per_episode_and_mlflow_per_step(opd_run: Path) -> None:
    con = open_run_sql([opd_run])
    _, per_episode = run_query(con, """
        SELECT e.step, e.episode_id, sum(t.teacher_kl * t.num_action_tokens) / sum(t.num_action_tokens)
        FROM teacher t JOIN episodes e USING (run_id, step, episode_id)
        GROUP BY ALL ORDER BY ALL""")
    assert len(per_episode) == 8 and all(math.isfinite(r[2]) for r in per_episode)
    folder = RunFolder(opd_run)
    logged = {s: json.loads((folder.step_dir(s) / "metrics.json").read_text())["opd/teacher_kl"] for s in (0, 1)}
    _, per_step = run_query(con, "SELECT step, sum(teacher_kl * num_action_tokens) / sum(num_action_tokens) "
                                 "FROM teacher GROUP BY step ORDER BY step")
    assert [logged[s] for s, _ in per_step] == pytest.approx([v for _, v in per_step])
    assert logged[0] > 0.1  # the sharpened teacher is far from the student
    history = RunTracker.open(opd_run).metric_history("opd/teacher_kl")
    assert [s for s, _ in history] == [0, 1]
    assert "time/teacher" in json.loads((folder.step_dir(0) / "metrics.json").read_text())


def sampled_records(student: torch.nn.Module, prompts: list[list[int]], count: int, pad_id: int) -> list:
    """``count`` continuations of 6 tokens sampled from ``student``, as samples with its logprobs."""
    from rollflow.storage.records import SampleRecord

    samples = []
    per_prompt = -(-count // len(prompts))
    for p, prompt in enumerate(prompts):  # one batched generate a prompt: same length, no padding
        with torch.no_grad():
            out = student.generate(torch.tensor([prompt]), do_sample=True, max_new_tokens=6, min_new_tokens=6,
                                   temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id,
                                   num_return_sequences=per_prompt)
            logits = student(input_ids=out).logits[:, :-1].float()
            picked = torch.log_softmax(logits, -1).gather(-1, out[:, 1:, None])[..., 0].tolist()
        for row in range(per_prompt):
            i = row * len(prompts) + p
            if i >= count:
                continue
            ids = out[row].tolist()
            mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
            sampler = [0.0] + [v if m else 0.0 for v, m in zip(picked[row], mask[1:], strict=True)]
            samples.append(SampleRecord("r", 0, f"s{i}", f"e{i}", f"g{i}", tuple(ids), tuple(mask),
                                        tuple([0.0] * len(ids)), tuple(sampler)))
    return samples


def _gap_on_trained_tokens(student: torch.nn.Module, samples: list, records: dict) -> float:
    """Sum over the samples' action tokens of (teacher_logp - student_logp)^2, at temperature 1."""
    total = 0.0
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample.input_ids])
            logits = student(input_ids=ids).logits[0, :-1].float()
            mine = [0.0] + torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist()
            teacher = records[sample.sample_id].teacher_logprobs
            total += sum((t - m) ** 2 for t, m, on in zip(teacher, mine, sample.loss_mask, strict=True) if on)
    return total


@pytest.mark.slow  # 17 s in a loaded suite run (docs/testing.md)
def test_an_opd_update_moves_the_trained_tokens_towards_the_teacher_and_the_negated_one_away(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The sign of the signal, through the trainer's own update (grpo_update, AdamW): one
    step on OPD advantages from the teacher stage's records shrinks the gap between the
    student's and the teacher's logprobs on the tokens it trained on; the same step on the
    negated advantages, from the same start, widens it. To first order this cannot go the
    other way: Adam's first step is -lr * sign(gradient), so the objective sum_t A_t *
    logp_t rises by lr * |gradient|_1 (measured: 84.2 -> 80.7, and 88.1 negated). (A test of the whole-vocabulary reverse KL of the
    next token was tried and dropped: with 8 samples a prompt from a 49k-token vocabulary
    its estimate is noise, and the first step raised it under either sign, measured.)"""
    from rollflow.policy.teacher import LocalTeacher
    from rollflow.tasks.teacher import teacher_record
    from rollflow.tasks.objectives import opd_advantages
    from rollflow.tasks.grpo_update import UpdateSettings, grpo_update, make_optimizer

    teacher_dir = sharpened_tiny_model(tmp_path / "teacher", seed=0, scale=5.0)
    torch.manual_seed(0)
    student, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    teacher = LocalTeacher(ModelRef(path=str(teacher_dir)), temperature=1.0)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {w}."}], tokenize=True,
                                      return_dict=False, add_generation_prompt=True)
        for w in ("cats", "bays", "crates", "tools")
    ]
    samples = sampled_records(student, prompts, 32, tokenizer.pad_token_id)
    records = {s.sample_id: teacher_record(teacher, s) for s in samples}
    advantages = opd_advantages(samples, records, ObjectiveSettings())
    before = _gap_on_trained_tokens(student, samples, records)
    start = {k: v.clone() for k, v in student.state_dict().items()}
    after = {}
    for sign in (1.0, -1.0):
        student.load_state_dict(start)
        student.requires_grad_(True)
        signed = [replace(s, advantages=tuple(sign * a for a in s.advantages)) for s in advantages]
        grpo_update(student, None, make_optimizer(student, 1e-4), signed, UpdateSettings())
        after[sign] = _gap_on_trained_tokens(student, samples, records)
    assert after[1.0] < 0.99 * before < 0.99 * after[-1.0], (before, after)


# ---------------------------------------------------------------- a vLLM teacher


@pytest.mark.slow
def test_a_vllm_teachers_prompt_logprobs_equal_the_local_teachers(tmp_path: Path) -> None:
    """The server teacher reads the real vLLM answer: the same logprobs as the same model
    scored in process at temperature 1, aligned the same way, and the same tokenizer."""
    from rollflow.policy.teacher import LocalTeacher, ServerTeacher, check_same_tokenizer
    from rollflow.policy.vllm_server import VLLMServer
    from rollflow.policy.vllm_spec import VLLMServerSpec

    tiny_model_dir = build_tiny_model(tmp_path / "model", num_heads=2)  # CPU vLLM: head_dim 16 is unsupported

    tokenizer = load_tokenizer(ModelRef(path=str(tiny_model_dir)))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count the crates in bay 3."}, {"role": "assistant", "content": "Seven."}],
        tokenize=True, return_dict=False,
    )
    wanted = [t >= len(ids) - 5 for t in range(len(ids))]  # the tail: the "action"
    # A sample that fills the teacher's context: what flatten keeps when the last action
    # took the whole remaining budget, scored by a teacher serving the student's length.
    max_len = 128
    text = " ".join(f"crate {i} sits in bay {i % 7}." for i in range(200))
    full = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                         return_dict=False)[:max_len]
    full_wanted = [t >= max_len - 8 for t in range(max_len)]
    local = LocalTeacher(ModelRef(path=str(tiny_model_dir)), temperature=1.0)
    with VLLMServer(VLLMServerSpec(str(tiny_model_dir), max_model_len=max_len, kvcache_space_gib=1)) as server:
        remote = ServerTeacher(server.base_url, "policy")
        check_same_tokenizer(local.fingerprint(), remote.fingerprint(), local.name, remote.name)
        served = remote.token_logprobs(ids, wanted)
        served_full = remote.token_logprobs(full, full_wanted)
        with pytest.raises(TeacherError, match=f"{max_len + 1} tokens.*max_model_len={max_len}"):
            remote.token_logprobs([*full, full[-1]], [*full_wanted, True])
    mine = local.token_logprobs(ids, wanted)
    assert served == pytest.approx(mine, abs=1e-3)
    assert [v == 0.0 for v in served] == [not w for w in wanted]
    assert len(full) == max_len and served_full == pytest.approx(local.token_logprobs(full, full_wanted), abs=1e-3)
    assert served_full[-1] != 0.0  # the last token's logprob comes from the generated position
