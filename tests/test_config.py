"""Config: TOML -> typed sections, errors that name the key, round trips, GRPOConfig."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from rollflow.config.grpo import GRPOConfig
from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig, config_to_toml, flatten_config, load_config, parse_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_empty_document_gives_the_documented_defaults() -> None:
    config = parse_config({})
    assert config == RunConfig()
    assert config.rollout.episodes_per_task == 4
    assert config.train.failed_parse_reward == -0.1
    assert config.train.use_lora is True
    assert config.groups_in_flight == config.rollout.batch_size  # None resolves to batch_size
    assert config.val_max_turns == config.rollout.max_turns


def test_values_are_typed_and_normalised() -> None:
    config = parse_config({
        "train": {"learning_rate": 1, "lora_target_modules": ["q_proj"], "loss": "dapo"},
        "env": {"name": "rollflow.envs.x:load_environment", "kwargs": {"split": "train", "n": 3}},
    })
    assert isinstance(config.train.learning_rate, float) and config.train.learning_rate == 1.0
    assert config.train.lora_target_modules == ("q_proj",)
    assert config.train.loss == "dapo"
    assert config.env.kwargs == {"split": "train", "n": 3}


def test_reference_aliases_map_to_the_same_field() -> None:
    config = parse_config({"rollout": {"group_size": 8, "max_context_tokens": 4096}})
    assert config.rollout.episodes_per_task == 8
    assert config.rollout.max_model_length == 4096
    same = parse_config({"rollout": {"group_size": 8, "episodes_per_task": 8}})
    assert same.rollout.episodes_per_task == 8


def test_alias_and_canonical_name_disagreeing_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"\[rollout\]\.(group_size|episodes_per_task).*contradicts"):
        parse_config({"rollout": {"group_size": 8, "episodes_per_task": 4}})


@pytest.mark.parametrize(
    ("document", "pattern"),
    [
        ({"train": {"learnig_rate": 0.1}}, r"unknown key \[train\]\.learnig_rate.*'learning_rate'"),
        ({"trian": {}}, r"unknown section \[trian\].*'train'"),
        ({"train": {"batch_size": 2}}, r"\[train\]\.batch_size belongs in \[rollout\]"),
        ({"train": {"group_size": 2}}, r"\[train\]\.group_size belongs in \[rollout\]"),
        ({"train": {"loss": "ppo"}}, r"\[train\]\.loss must be one of 'grpo', 'dr_grpo', 'dapo'"),
        ({"train": {"use_lora": "yes"}}, r"\[train\]\.use_lora must be true or false; got str"),
        ({"rollout": {"batch_size": 2.5}}, r"\[rollout\]\.batch_size must be an integer"),
        ({"rollout": {"batch_size": True}}, r"\[rollout\]\.batch_size must be an integer"),
        ({"rollout": {"batch_size": 0}}, r"\[rollout\]\.batch_size must be at least 1"),
        ({"train": {"minibatches": 0}}, r"\[train\]\.minibatches must be at least 1"),
        ({"train": {"lr_warmup_steps": -1}}, r"\[train\]\.lr_warmup_steps must be at least 0"),
        ({"train": {"lr_warmup_steps": 2.5}}, r"\[train\]\.lr_warmup_steps must be an integer"),
        ({"rollout": {"top_p": 1.5}}, r"\[rollout\]\.top_p must be in \(0.0, 1.0\]"),
        ({"rollout": {"temperature": 0}}, r"\[rollout\]\.temperature must be in \(0.0, inf\)"),
        ({"train": {"lora_target_modules": "q_proj"}}, r"lora_target_modules must be a list"),
        ({"env": {"name": "rollflow.envs.tool_use_game"}}, r"\[env\]\.name must be 'module:function'"),
        ({"env": {"kwargs": 3}}, r"\[env\]\.kwargs must be a table"),
        ({"rollout": {"backend": "openai"}}, r"needs \[rollout\]\.base_url"),
        ({"rollout": {"max_completion_tokens": 4096}}, r"must be below \[rollout\]\.max_model_length"),
        ({"storage": {"compression": "xz"}}, r"\[storage\]\.compression must be one of"),
        ({"train": 3}, r"\[train\] must be a table"),
        ({"validation": {"episodes_per_task": 0}}, r"\[validation\]\.episodes_per_task must be at least 1"),
        ({"train": {"episodes_per_task": 2}}, r"belongs in \[rollout\] or \[validation\], not \[train\]"),
    ],
)
def test_bad_config_errors_name_the_key(document: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        parse_config(document)


def test_sections_validate_when_built_from_python_too() -> None:
    from rollflow.config.train import TrainConfig

    with pytest.raises(ConfigError, match=r"\[train\]\.clip_eps_low must be in"):
        TrainConfig(clip_eps_low=-0.1)


def test_toml_round_trip_is_exact(tmp_path: Path) -> None:
    config = parse_config({
        "model": {"path": "some/model", "gguf_file": "m.gguf"},
        "env": {"name": "rollflow.envs.x:load", "kwargs": {"split": "val", "odd key": [1, 2], "t": {"a": 0.1}}},
        "rollout": {"groups_in_flight": 3, "max_steps_off_policy": 1, "temperature": 0.7},
        "train": {"learning_rate": 3.3e-7, "overlong_buffer_tokens": 128, "lora_target_modules": ["a"]},
        "tracking": {"tracking_uri": "http://localhost:5000", "experiment": 'quote " inside'},
    })
    text = config_to_toml(config)
    assert parse_config(tomllib.loads(text)) == config
    path = tmp_path / "frozen.toml"
    path.write_text(text)
    assert load_config(path) == config


def test_load_config_reports_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nx = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_flatten_config_gives_text_params_with_section_prefixes() -> None:
    config = parse_config({"env": {"kwargs": {"split": "train", "nested": {"k": True}}}})
    flat = flatten_config(config)
    assert flat["train.learning_rate"] == "2e-05"
    assert flat["train.use_lora"] == "true"
    assert flat["train.lora_target_modules"] == "q_proj,k_proj,v_proj,o_proj"
    assert flat["env.kwargs.split"] == "train"
    assert flat["env.kwargs.nested.k"] == "true"
    assert all(isinstance(v, str) for v in flat.values())
    assert "rollout.groups_in_flight" not in flat  # None: not a param


def test_tiny_config_file_is_valid_and_short() -> None:
    config = load_config(CONFIGS / "tiny.toml")
    assert config.train.num_steps == 2
    assert config.model.path is not None


# ---------------------------------------------------------------- GRPOConfig


def test_grpo_config_maps_reference_fields_onto_sections() -> None:
    flat = GRPOConfig(
        model="/models/smol/SmolLM2.gguf", batch_size=2, episodes_per_task=8, num_steps=3,
        validation_interval=10, max_turns=6, max_model_length=1024, learning_rate=1e-4,
        sequential_validation=True, max_sampling_attempts=3, failed_parse_reward=-0.5,
        overlong_masking=True, val_max_turns=2, max_steps_off_policy=1, groups_in_flight=5,
        use_lora=False, max_completion_tokens=64,
    )
    config = flat.to_run_config()
    assert (config.model.path, config.model.gguf_file) == ("/models/smol", "SmolLM2.gguf")
    assert config.rollout.batch_size == 2 and config.rollout.episodes_per_task == 8
    assert config.rollout.max_turns == 6 and config.rollout.max_model_length == 1024
    assert config.rollout.max_steps_off_policy == 1 and config.groups_in_flight == 5
    assert config.rollout.max_completion_tokens == 64
    assert config.train.num_steps == 3 and config.train.learning_rate == 1e-4
    assert config.train.failed_parse_reward == -0.5 and config.train.overlong_masking
    assert config.train.use_lora is False
    assert config.validation.validation_interval == 10 and config.val_max_turns == 2
    assert config.validation.sequential_validation is True


def test_grpo_config_requires_max_turns_like_the_reference() -> None:
    with pytest.raises(ConfigError, match="max_turns is required"):
        GRPOConfig().to_run_config()


def test_grpo_config_group_size_alias() -> None:
    assert GRPOConfig(max_turns=2, group_size=6).to_run_config().rollout.episodes_per_task == 6
    assert GRPOConfig(max_turns=2).to_run_config().rollout.episodes_per_task == 4
    with pytest.raises(ConfigError, match="group_size = 6 contradicts episodes_per_task = 4"):
        GRPOConfig(max_turns=2, group_size=6, episodes_per_task=4).to_run_config()


def test_grpo_config_wandb_project_is_ignored_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="wandb_project.*MLflow"):
        config = GRPOConfig(max_turns=2, wandb_project="grpo-tool-use-game").to_run_config()
    assert config.tracking == RunConfig().tracking


def test_grpo_config_invalid_values_use_the_section_errors() -> None:
    with pytest.raises(ConfigError, match=r"\[rollout\]\.batch_size must be at least 1"):
        GRPOConfig(max_turns=2, batch_size=0).to_run_config()


def test_auto_dtype_takes_bfloat16_only_where_the_cpu_runs_it_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dtype = "auto"``: bfloat16 where oneDNN has a native bfloat16 path (AVX-512/AMX),
    float32 on a CPU that would emulate it; full-weight training stays float32 either way."""
    import torch

    from rollflow.generators.models import torch_dtype, training_dtype

    config = parse_config({"model": {"dtype": "auto"}})
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert torch_dtype(config) == (torch.bfloat16 if native else torch.float32)  # this machine's answer
    for has_bf16, wanted in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda has=has_bf16: has)
        assert torch_dtype(config) == wanted
        assert training_dtype(config) == wanted  # LoRA: the frozen base in the chosen dtype
        full = parse_config({"model": {"dtype": "auto"}, "train": {"use_lora": False}})
        assert training_dtype(full) == torch.float32
    with pytest.raises(ConfigError, match=r"\[model\]\.dtype"):
        parse_config({"model": {"dtype": "fastest"}})


def test_the_model_device_is_checked_in_the_config_and_on_the_machine() -> None:
    """``[model].device``: a typo is a config error; a CUDA device this machine lacks is a
    load error naming it; "auto" takes CUDA only where PyTorch sees it."""
    import torch

    from rollflow.generators.models import auto_dtype, torch_device
    from rollflow.policy.models import ModelLoadError, resolve_device

    with pytest.raises(ConfigError, match=r"\[model\]\.device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got 'gpu'"):
        parse_config({"model": {"device": "gpu"}})
    assert parse_config({"model": {"device": "cuda:1"}}).model.device == "cuda:1"
    assert torch_device(parse_config({})) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match=r"\[model\]\.device = 'cuda', but this PyTorch sees no CUDA device"):
            resolve_device("cuda")
    else:
        with pytest.raises(ModelLoadError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    assert auto_dtype(torch.device("cpu")) == auto_dtype()  # the CPU rule, as before


def test_a_run_frozen_before_a_setting_retired_still_loads(tmp_path: Path) -> None:
    # An older rollflow froze every section, [pipeline].gate_z included: the run must still
    # resume, export and rescore, while a user's own config naming it is refused.
    text = config_to_toml(RunConfig()).replace("[pipeline]\n", "[pipeline]\ngate_z = 1.0\n", 1)
    assert "gate_z = 1.0" in text
    frozen = tmp_path / "config.toml"
    frozen.write_text(text, encoding="utf-8")
    assert load_config(frozen, frozen=True) == RunConfig()
    with pytest.raises(ConfigError, match=r"gate_z is no longer a setting"):
        load_config(frozen)
