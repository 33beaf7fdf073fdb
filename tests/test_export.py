"""``rollflow export``: adapter and merged folders whose greedy output is the trained policy's,
loaded fresh with transformers / peft from the exported folder alone."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rollflow.config.run import RunConfig, config_to_toml, load_config
from rollflow.envs.types import Message
from rollflow.flows.cli import main
from rollflow.flows.export import ExportError, export_policy
from rollflow.generators.checkpoints import OPTIMIZER_FILE, latest_checkpoint, read_checkpoint, save_checkpoint
from rollflow.generators.models import load_policy_for_training, policy_model_ref
from rollflow.policy.models import ModelRef, load_causal_lm
from rollflow.policy.sampling import SamplingSettings
from rollflow.policy.transformers_backend import TransformersPolicy
from rollflow.policy.vllm_spec import VLLMServerError, VLLMServerSpec, lora_rank_limit, resolve_python
from rollflow.storage.records import TrainResult
from rollflow.storage.runfolder import RunFolder
from tiny_run import REPO

MESSAGES: list[Message] = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 6 * 7?"},
]
NEW_TOKENS = 12


def run_with_checkpoints(root: Path, model_dir: Path, *, use_lora: bool, steps: int = 2) -> RunFolder:
    """A run folder whose checkpoints the train stage's own ``save_checkpoint`` wrote, each
    with weights moved far from the base (seeded) so every policy's greedy text differs."""
    config = load_config(REPO / "configs" / "tiny.toml")
    config = replace(
        config,
        model=replace(config.model, path=str(model_dir)),
        train=replace(config.train, use_lora=use_lora),
        storage=replace(config.storage, runs_dir=str(root.parent)),
        tracking=replace(config.tracking, enabled=False),
    )
    folder = RunFolder(root)
    folder.write_config(config_to_toml(config))
    if not steps:
        return folder
    model, tokenizer = load_policy_for_training(config, None)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(steps):
        _move_weights(model, use_lora, seed=step)
        result = TrainResult(run_id=folder.run_id, step=step, policy_version=step + 1, loss=0.0, kl=None,
                             clip_fraction=0.0, grad_norm=1.0, num_samples=1, num_tokens=1,
                             num_action_tokens=1, learning_rate=1e-3, tokens_per_s=1.0)
        save_checkpoint(folder, model, tokenizer, optimizer, result, use_lora)
    return folder


def _move_weights(model: PreTrainedModel, use_lora: bool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if use_lora and "lora_B" in name:  # B starts at zero: the adapter would do nothing
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            elif not use_lora and "layers.0" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)


def policy_greedy(config: RunConfig, folder: RunFolder, step: int | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy action ids) of the run's policy as the rollout stage acts with it."""
    checkpoint = latest_checkpoint(folder) if step is None else read_checkpoint(folder.checkpoint_dir(step))
    model, tokenizer = load_causal_lm(policy_model_ref(config, checkpoint))
    return _act(TransformersPolicy(model, tokenizer, _greedy()))


def base_greedy(model_dir: Path) -> list[int]:
    model, tokenizer = load_causal_lm(ModelRef(path=str(model_dir)))
    return _act(TransformersPolicy(model, tokenizer, _greedy()))[1]


def _greedy() -> SamplingSettings:
    return SamplingSettings(temperature=0.0, max_completion_tokens=NEW_TOKENS, max_model_length=512)


def _act(policy: TransformersPolicy) -> tuple[list[int], list[int]]:
    async def one() -> tuple[list[int], list[int]]:
        session = policy.open_session([])
        action = await session.act(MESSAGES)
        await session.close()
        return list(action.prompt_delta_ids), list(action.token_ids)

    return asyncio.run(one())


def exported_greedy(out: Path, adapter: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) from the exported folder alone: its tokenizer and template."""
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    if adapter:
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(str(out))  # finds the base by its path
    else:
        model = AutoModelForCausalLM.from_pretrained(str(out))
    model.eval()
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt_ids = list(prompt["input_ids"])
    with torch.no_grad():
        output = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return prompt_ids, _until_stop(output[0, len(prompt_ids):].tolist(), tokenizer.eos_token_id)


def _until_stop(ids: Sequence[int], stop: int) -> list[int]:
    return list(ids[: ids.index(stop) + 1]) if stop in ids else list(ids)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> RunFolder:
    return run_with_checkpoints(tmp_path_factory.mktemp("lora") / "run", tiny_model_dir, use_lora=True)


@pytest.mark.slow  # three model loads and generations: ~15 s on 2 busy cores
def test_the_adapter_export_generates_what_the_trained_policy_generates(
    lora_run: RunFolder, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "adapter"
    result = export_policy(lora_run.root, out)
    assert (result.step, result.policy_version, result.format) == (1, 2, "adapter")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", "chat_template.jinja", "export.json",
         "tokenizer.json", "tokenizer_config.json",
         "SERVING.md", "system_prompt.txt", "tools.json"])  # the tool-use game: how to serve it as trained
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(tiny_model_dir.resolve()) == result.base_model
    assert json.loads((out / "export.json").read_text())["step"] == 1
    config = load_config(lora_run.config_path)
    prompt, trained = policy_greedy(config, lora_run)
    assert trained != base_greedy(tiny_model_dir)  # else the test could not tell a lost adapter
    assert exported_greedy(out, adapter=True) == (prompt, trained)


@pytest.mark.slow  # ~12 s on 2 busy cores
def test_the_merged_export_generates_what_the_trained_policy_generates(
    lora_run: RunFolder, tmp_path: Path
) -> None:
    out = tmp_path / "merged"
    result = export_policy(lora_run.root, out, step=0, merged=True)
    assert (result.step, result.policy_version, result.format, result.base_model) == (0, 1, "merged", None)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any("adapter" in name for name in names)
    config = load_config(lora_run.config_path)
    older, newer = policy_greedy(config, lora_run, step=0), policy_greedy(config, lora_run)
    assert older[1] != newer[1]  # --step 0 picked the older policy, not the newest
    assert exported_greedy(out, adapter=False) == older


def test_a_full_weight_run_exports_its_weights_without_the_training_state(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = run_with_checkpoints(tmp_path / "run", tiny_model_dir, use_lora=False, steps=1)
    out = tmp_path / "full"
    assert main(["export", str(folder.root), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert f"as a full model to {out}" in printed.out
    assert f"vllm.entrypoints.openai.api_server --model {out} --served-model-name policy" in printed.out
    assert "as with --merged" in printed.err
    assert not (out / OPTIMIZER_FILE).exists() and not (out / "version.json").exists()
    config = load_config(folder.config_path)
    prompt, trained = policy_greedy(config, folder)
    assert trained != base_greedy(tiny_model_dir)
    assert exported_greedy(out, adapter=False) == (prompt, trained)


def test_the_cli_prints_the_vllm_line_for_an_adapter(
    lora_run: RunFolder, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a"
    out.mkdir()  # an empty folder is fine
    assert main(["export", str(lora_run.root), "--out", str(out), "--step", "0"]) == 0
    printed = capsys.readouterr().out
    assert "exported step 0 (policy version 1) as a LoRA adapter" in printed
    assert f"--enable-lora --lora-modules policy={out} --max-lora-rank 8" in printed  # rank 4: vLLM's next accepted value
    assert 'served as model "policy" ("base" is the base model alone, untrained)' in printed


def test_an_export_carries_the_system_text_that_serves_it_as_it_was_trained(
    lora_run: RunFolder, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newcomer's item 6: the export had only the model's own template, which ignores
    ``tools=``; a server asked with tools sent a prompt the policy never saw. Its
    ``system_prompt.txt``, sent as the first message without ``tools=``, renders with the
    exported template exactly the prompt a rollout gave the policy."""
    from rollflow.envs.runner import load_environment_handle
    from rollflow.policy.codec import ChatCodec
    from rollflow.tasks.prompts import opening_prompt

    out = tmp_path / "served"
    assert main(["export", str(lora_run.root), "--out", str(out), "--merged"]) == 0
    assert f"{out / 'SERVING.md'} says how to serve it" in capsys.readouterr().out
    system = (out / "system_prompt.txt").read_text()
    config = load_config(lora_run.config_path)
    handle = load_environment_handle(config.env.name, config.env.kwargs)
    messages, tool_specs = opening_prompt(config.env.name, handle, handle.tasks("validation")[0])
    trained = ChatCodec(AutoTokenizer.from_pretrained(str(out))).render_text(messages, tool_specs)
    sent = [{"role": "system", "content": system}, *[m for m in messages if m["role"] != "system"]]
    served = AutoTokenizer.from_pretrained(str(out)).apply_chat_template(sent, add_generation_prompt=True, tokenize=False)
    assert served == trained
    assert json.loads((out / "tools.json").read_text()) == [dict(spec) for spec in tool_specs]
    guide = (out / "SERVING.md").read_text()
    assert "Do **not** pass `tools=`" in guide and "--tools-in-system-prompt" in guide


def _file_modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoints_and_exports_get_the_modes_of_ordinary_files(
    tmp_path: Path, tiny_model_dir: Path, umask: int
) -> None:
    """safetensors writes its files 0600; a checkpoint or export is read by other users (a
    vLLM server, a colleague), so every file gets what open() gives under the umask."""
    previous = os.umask(umask)
    try:
        folder = run_with_checkpoints(tmp_path / "run", tiny_model_dir, use_lora=True, steps=1)
        export_policy(folder.root, tmp_path / "adapter")
        export_policy(folder.root, tmp_path / "merged", merged=True)
    finally:
        os.umask(previous)
    expected = 0o666 & ~umask
    for written in (folder.checkpoint_dir(0), tmp_path / "adapter", tmp_path / "merged"):
        modes = _file_modes(written)
        assert any(name.endswith(".safetensors") for name in modes), written
        assert modes == dict.fromkeys(modes, expected), written


# ---------------------------------------------------------------- refusals


def test_a_step_without_a_checkpoint_names_the_steps_there_are(lora_run: RunFolder, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"no checkpoint for step 5; it has steps 0, 1"):
        export_policy(lora_run.root, tmp_path / "x", step=5)
    assert not (tmp_path / "x").exists()


def test_a_run_without_checkpoints_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = run_with_checkpoints(tmp_path / "run", tiny_model_dir, use_lora=True, steps=0)
    with pytest.raises(ExportError, match="has no checkpoint: no training step has finished"):
        export_policy(folder.root, tmp_path / "x")
    with pytest.raises(ExportError, match="is not a run folder"):
        export_policy(tmp_path, tmp_path / "y")


def test_a_non_empty_out_is_never_overwritten(
    lora_run: RunFolder, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(lora_run.root), "--out", str(out)]) == 1
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


# ---------------------------------------------------------------- served by vLLM


def _served_greedy(base_url: str, model: str) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) from the server's chat endpoint: its template is the export's."""
    import httpx

    body = {"model": model, "messages": MESSAGES, "temperature": 0.0, "max_tokens": NEW_TOKENS,
            "return_token_ids": True}
    response = httpx.post(f"{base_url}/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    return list(answer["prompt_token_ids"]), list(answer["choices"][0]["token_ids"])


def _vllm_server_module():  # noqa: ANN202 - the module, or a skip
    server = pytest.importorskip("rollflow.policy.vllm_server",
                                 reason="the vLLM server manager (policy/vllm_server.py) is not here")
    try:
        resolve_python(None)
    except VLLMServerError as missing:
        pytest.skip(str(missing))
    return server


@pytest.fixture(scope="module")
def vllm_lora_run(tmp_path_factory: pytest.TempPathFactory) -> RunFolder:
    """Like ``lora_run`` on a tiny model vLLM's CPU attention accepts (head_dim 64, not 16)."""
    from rollflow.policy.models import build_tiny_model

    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_tiny_model(root / "model", hidden_size=128, num_heads=2, intermediate_size=256)
    return run_with_checkpoints(root / "run", model_dir, use_lora=True, steps=1)


@pytest.mark.slow  # a CPU vLLM server start: 3-4 minutes on 2 busy cores
def test_vllm_serves_the_merged_export_with_the_trained_policys_greedy_output(
    vllm_lora_run: RunFolder, tmp_path: Path
) -> None:
    server = _vllm_server_module()
    out = tmp_path / "merged"
    export_policy(vllm_lora_run.root, out, merged=True)
    prompt, trained = policy_greedy(load_config(vllm_lora_run.config_path), vllm_lora_run)
    spec = VLLMServerSpec(model_dir=str(out), max_model_len=512)
    with server.VLLMServer(spec, log_path=tmp_path / "vllm.log") as running:
        served_prompt, served = _served_greedy(running.base_url, spec.served_model_name)
    assert served_prompt == prompt  # the exported chat template renders as the rollouts did
    stop = AutoTokenizer.from_pretrained(str(out)).eos_token_id
    assert _until_stop(served, stop) == trained


@pytest.mark.slow  # a CPU vLLM server start: 3-4 minutes on 2 busy cores
def test_vllm_serves_the_adapter_export_on_its_base_with_the_trained_policys_greedy_output(
    vllm_lora_run: RunFolder, tmp_path: Path
) -> None:
    import httpx

    server = _vllm_server_module()
    out = tmp_path / "adapter"
    result = export_policy(vllm_lora_run.root, out)
    assert result.base_model is not None and result.lora_rank is not None
    prompt, trained = policy_greedy(load_config(vllm_lora_run.config_path), vllm_lora_run)
    spec = VLLMServerSpec(model_dir=result.base_model, max_model_len=512, enable_lora=True,
                          max_lora_rank=lora_rank_limit(result.lora_rank))
    with server.VLLMServer(spec, log_path=tmp_path / "vllm.log") as running:
        # the runtime twin of --lora-modules trained=OUT: the same adapter loader
        loaded = httpx.post(f"{running.base_url}/load_lora_adapter",
                            json={"lora_name": "trained", "lora_path": str(out)}, timeout=300)
        assert loaded.status_code == 200, loaded.text
        served_prompt, served = _served_greedy(running.base_url, "trained")
        _, base = _served_greedy(running.base_url, spec.served_model_name)
    assert served_prompt == prompt
    stop = AutoTokenizer.from_pretrained(str(out)).eos_token_id
    assert _until_stop(served, stop) == trained
    assert _until_stop(base, stop) != trained  # the adapter, not the base, gave those tokens
