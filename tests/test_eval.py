"""The evaluation flow: config overrides, a tiny local model, and an OpenAI-compatible server.

The report's numbers are checked against a hand count over the Parquet files (pyarrow,
not the SQL the report uses), so a wrong query or a wrong join would show.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from json_server import json_server

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig, load_config
from rollflow.flows.cli import main
from rollflow.flows.eval import eval_flow, eval_report, format_report
from rollflow.flows.eval_config import EvalOverrides, eval_config
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import table_to_episode_records


def hand_count(run_dir: Path) -> dict[str, Any]:
    folder = RunFolder(run_dir)
    episodes = table_to_episode_records(folder.read_stage(0, "episodes", "validation"))
    scores = pq.read_table(folder.stage_path(0, "scores", "validation")).to_pylist()
    finals = {s["episode_id"]: s["final_reward"] for s in scores}
    counted = [e for e in episodes if e.rollout.error is None]
    return {
        "num_episodes": len(episodes),
        "reward_mean": sum(finals[e.episode_id] for e in counted) / len(counted),
        "pass_rate": sum(s["passed"] for s in scores) / len(scores),  # an errored episode failed
        "terminated_ratio": sum(e.rollout.terminated for e in episodes) / len(episodes),
        "turns_mean": sum(e.rollout.turns for e in episodes) / len(episodes),
        "tokens_mean": sum(e.rollout.context_tokens for e in episodes) / len(episodes),
        "finals": finals,
        "ids": [e.episode_id for e in episodes],
    }


# ---------------------------------------------------------------- overrides


def test_overrides_replace_only_what_they_name() -> None:
    base = RunConfig()
    same = eval_config(base, EvalOverrides())
    assert same == base
    config = eval_config(base, EvalOverrides(model="/m/smol.Q8.gguf", adapter="/a", num_tasks=3))
    assert (config.model.path, config.model.gguf_file, config.model.adapter) == ("/m", "smol.Q8.gguf", "/a")
    assert config.validation.num_tasks == 3 and config.rollout == base.rollout
    folder = eval_config(base, EvalOverrides(model="/models/hf"))
    assert (folder.model.path, folder.model.gguf_file) == ("/models/hf", None)
    # how the model runs stays (the third review: --model dropped [model].device)
    on_cpu = replace(base, model=replace(base.model, device="cpu", dtype="bfloat16", adapter="/old-adapter"))
    moved = eval_config(on_cpu, EvalOverrides(model="/models/hf")).model
    assert (moved.device, moved.dtype, moved.adapter) == ("cpu", "bfloat16", None)
    served = eval_config(base, EvalOverrides(base_url="http://127.0.0.1:9/v1", api_model="smol"))
    assert (served.rollout.backend, served.rollout.base_url, served.rollout.api_model) == (
        "openai", "http://127.0.0.1:9/v1", "smol")


def test_env_override_keeps_kwargs_only_for_the_same_environment() -> None:
    from rollflow.config.run import EnvConfig

    base = RunConfig(env=EnvConfig(name="rollflow.envs.tool_use_game:load_environment", kwargs={"num_validation": 3}))
    assert eval_config(base, EvalOverrides(env=base.env.name)).env.kwargs == {"num_validation": 3}
    other = eval_config(base, EvalOverrides(env="rollflow.envs.guess_number:load_environment"))
    assert other.env.name == "rollflow.envs.guess_number:load_environment" and other.env.kwargs == {}


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (EvalOverrides(base_url="http://x/v1"), "go together"),
        (EvalOverrides(api_model="m"), "go together"),
        (EvalOverrides(base_url="http://x/v1", api_model="m", model="/m"), "not both"),
        (EvalOverrides(env="no_colon"), r"\[env\]\.name must be 'module:function'"),
        (EvalOverrides(num_tasks=0), r"\[validation\]\.num_tasks must be at least 1"),
    ],
)
def test_bad_overrides_are_refused_with_the_culprit(overrides: EvalOverrides, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        eval_config(RunConfig(), overrides)


# ---------------------------------------------------------------- a tiny local model


@pytest.fixture(scope="module")
def tiny_eval(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, prefect_harness: object
) -> Path:
    """configs/tiny.toml evaluated on 3 validation tasks with the session's tiny model."""
    repo = Path(__file__).resolve().parent.parent
    root = tmp_path_factory.mktemp("eval")
    return Path(
        eval_flow(
            config_path=str(repo / "configs" / "tiny.toml"), run_dir=str(root / "run"),
            model=str(tiny_model_dir), num_tasks=3,
        )
    )


@pytest.mark.slow  # 6 s in a loaded suite run (docs/testing.md)
def test_eval_writes_validation_tables_and_nothing_of_training(tiny_eval: Path, tiny_model_dir: Path) -> None:
    folder = RunFolder(tiny_eval)
    assert folder.is_complete(0, "episodes", "validation") and folder.is_complete(0, "scores", "validation")
    assert (folder.step_dir(0, "validation") / "metrics.json").exists()
    assert folder.steps("train") == [] and folder.checkpoints() == []
    frozen = load_config(folder.config_path)
    assert frozen.model.path == str(tiny_model_dir) and frozen.validation.num_tasks == 3
    episodes = table_to_episode_records(folder.read_stage(0, "episodes", "validation"))
    assert len(episodes) == 3 and all(e.split == "validation" for e in episodes)
    assert all(a.token_ids for e in episodes if e.rollout.error is None for a in e.rollout.actions)


@pytest.mark.slow
def test_evaluating_a_finished_folder_again_opens_no_generator_and_changes_nothing(
    tiny_eval: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = hand_count(tiny_eval)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a finished evaluation opened a generator (with vLLM: a server)")

    monkeypatch.setattr("rollflow.flows.eval.open_generator", refused)
    repo = Path(__file__).resolve().parent.parent
    again = eval_flow(config_path=str(repo / "configs" / "tiny.toml"), run_dir=str(tiny_eval),
                      model=str(tiny_model_dir), num_tasks=3)
    assert Path(again) == tiny_eval and hand_count(tiny_eval) == before


def test_report_numbers_match_a_hand_count(tiny_eval: Path) -> None:
    report = eval_report(tiny_eval, worst=2)
    expected = hand_count(tiny_eval)
    for key in ("num_episodes", "reward_mean", "pass_rate", "terminated_ratio", "turns_mean", "tokens_mean"):
        assert report.metrics[key] == pytest.approx(expected[key]), key
    assert len(report.worst) == 2
    rewards = [w.final_reward for w in report.worst]
    assert rewards == sorted(rewards) and rewards[0] == min(expected["finals"].values())
    assert all(w.episode_id in expected["ids"] for w in report.worst)


def test_report_text_names_every_figure_and_the_show_command(tiny_eval: Path) -> None:
    report = eval_report(tiny_eval)
    text = format_report(report, "tiny")
    for label in ("pass rate", "reward", "terminated", "max_turns", "context_overflow", "parse_failure",
                  "turns", "tokens", "worst episodes"):
        assert label in text
    assert f"rollflow show {tiny_eval} EPISODE_ID" in text
    assert f"{report.metrics['pass_rate']:.3f}" in text
    assert all(w.episode_id in text for w in report.worst)


@pytest.mark.slow  # 3 s in a loaded suite run (docs/testing.md)
def test_rollflow_eval_prints_the_report(
    tiny_model_dir: Path, tmp_path: Path, prefect_harness: object, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    repo = Path(__file__).resolve().parent.parent
    caplog.set_level(logging.INFO, logger="prefect")  # what a user's console shows (tests run at WARNING)
    status = main([
        "eval", "--config", str(repo / "configs" / "tiny.toml"), "--model", str(tiny_model_dir),
        "--tasks", "1", "--run-dir", str(tmp_path / "cli"),
    ])
    text = capsys.readouterr().out
    assert status == 0 and text.startswith(f"evaluation {tmp_path / 'cli'}") and "episodes      1 " in text
    assert f"policy        {tiny_model_dir}" in text
    assert not [r for r in caplog.records if "pass rate" in r.getMessage()]  # printed once, not logged too
    assert main(["eval", "--tasks", "0"]) == 1
    assert main(["eval", "--model", str(tmp_path / "missing"), "--run-dir", str(tmp_path / "x")]) == 1
    assert "--model" in (err := capsys.readouterr().err) and "that path does not exist" in err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- an OpenAI-compatible server


@dataclass
class ChatServer:
    """Answers every chat completion with ``answer``; records the request bodies."""

    answer: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    base_url: str = ""


@pytest.fixture
def chat_server() -> Iterator[ChatServer]:
    server = ChatServer(answer="17")

    def answer(path: str, headers: Mapping[str, str], body: dict[str, Any]) -> tuple[int, Any, float]:
        server.bodies.append({"path": path, **body})
        message = {"role": "assistant", "content": server.answer}
        return 200, {
            "id": "c", "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32},
        }, 0.0  # fmt: skip

    with json_server(answer) as url:
        server.base_url = f"{url}/v1"
        yield server


def served_eval(chat_server: ChatServer, tmp_path: Path, validation: str) -> Path:
    """`rollflow eval` against ``chat_server`` with ``validation`` as its [validation] table."""
    config = tmp_path / "served.toml"
    config.write_text(f"[tracking]\nenabled = false\n[validation]\n{validation}\n")
    return Path(eval_flow(
        config_path=str(config), run_dir=str(tmp_path / "run"), base_url=chat_server.base_url, api_model="smol",
    ))


def test_eval_against_an_openai_compatible_server(
    chat_server: ChatServer, tmp_path: Path, prefect_harness: object
) -> None:
    root = served_eval(chat_server, tmp_path, "num_tasks = 2")
    assert len(chat_server.bodies) == 2  # one answer ends each episode
    body = chat_server.bodies[0]
    assert body["path"] == "/v1/chat/completions" and body["model"] == "smol"
    assert {t["function"]["name"] for t in body["tools"]} >= {"lookup", "calculator"}
    assert body["messages"][0]["role"] == "system" and body["messages"][-1]["role"] == "user"
    expected = hand_count(root)
    report = eval_report(root)
    assert report.metrics["num_episodes"] == 2 and report.metrics["terminated_ratio"] == 1.0
    assert report.metrics["turns_mean"] == 1.0 and report.metrics["tokens_mean"] == 0.0  # text only
    for cause in ("max_turns", "context_overflow", "parse_failure", "env_truncated"):
        assert report.metrics[f"{cause}_ratio"] == 0.0  # nothing truncated: 0, not NaN
    assert report.metrics["reward_mean"] == pytest.approx(expected["reward_mean"])
    assert report.metrics["pass_rate"] == pytest.approx(expected["pass_rate"])
    episodes = table_to_episode_records(RunFolder(root).read_stage(0, "episodes", "validation"))
    assert all(e.rollout.response_text == "17" for e in episodes)


def test_validation_plays_each_task_episodes_per_task_times(
    chat_server: ChatServer, tmp_path: Path, prefect_harness: object
) -> None:
    root = served_eval(chat_server, tmp_path, "num_tasks = 2\nepisodes_per_task = 3")
    assert len(chat_server.bodies) == 6
    episodes = table_to_episode_records(RunFolder(root).read_stage(0, "episodes", "validation"))
    by_group: dict[str, list[str]] = {}
    for e in episodes:
        by_group.setdefault(e.group_id, []).append(e.task_id)
    assert len(by_group) == 2 and all(len(ids) == 3 and len(set(ids)) == 1 for ids in by_group.values())
    assert len({ids[0] for ids in by_group.values()}) == 2  # two different tasks
    assert eval_report(root).metrics["num_episodes"] == 6


# ---------------------------------------------------------------- a failed evaluation, and how to run it again


def test_a_failed_eval_says_in_one_line_how_to_run_it_again_and_resume_refuses_its_folder(
    tmp_path: Path, prefect_harness: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every episode refused by the server (the newcomer's HTTP 400): ``rollflow eval`` ends in
    one line that says how to play them again; ``rollflow resume`` on the folder would have
    trained GRPO in it, and is refused in one line that says the same. Then the server
    answers, and what the line says does play them again."""
    refusing = [True]
    answered: list[str] = []

    def answer(path: str, headers: Mapping[str, str], body: dict[str, Any]) -> tuple[int, Any, float]:
        if refusing[0]:
            return 400, {"error": {"message": "tool choice requires --enable-auto-tool-choice"}}, 0.0
        answered.append(path)
        return 200, {
            "id": "c", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "17"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32},
        }, 0.0  # fmt: skip

    config, root = tmp_path / "served.toml", tmp_path / "run"
    config.write_text("[tracking]\nenabled = false\n[validation]\nnum_tasks = 2\n")
    with json_server(answer) as url:
        command = ["eval", "--config", str(config), "--base-url", f"{url}/v1", "--api-model", "smol",
                   "--run-dir", str(root)]
        assert main(command) == 1
        err = capsys.readouterr().err
        ours = [line for line in err.splitlines() if line.startswith("rollflow")]  # besides the progress lines
        assert len(ours) == 1 and "Traceback" not in err, err
        assert ours[0].startswith("rollflow eval: validation step 0: all 2 episodes failed"), err
        assert f"the same `rollflow eval` with `--run-dir {root}` plays them again" in ours[0], err
        assert ours[0].endswith(f"(Prefect's log, with the traceback: {root / 'logs' / 'prefect.log'})"), err
        assert "rollflow resume" not in err, err

        assert main(["resume", str(root)]) == 1
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"rollflow resume: {root} is an evaluation, not a training run"), err
        assert err.rstrip().endswith(f"to run it again: the same `rollflow eval` with `--run-dir {root}`"), err
        assert not (root / "train").exists() and not (root / "checkpoints").exists()

        refusing[0] = False
        assert main(command) == 0, capsys.readouterr().err
    assert eval_report(root).metrics["error_ratio"] == 0.0 and len(answered) == 2


@pytest.mark.parametrize(
    ("kind", "under_pipeline", "advice"),
    [
        ("train", False, "`rollflow resume {root}` plays them again"),
        ("eval", False, "the same `rollflow eval` with `--run-dir {root}` plays them again"),
        ("eval", True, "`rollflow pipeline --run-dir {parent}` plays them again"),
        ("train", True, "`rollflow pipeline --run-dir {parent}` plays them again"),
    ],
)
def test_the_replay_advice_follows_what_made_the_folder(
    kind: str, under_pipeline: bool, advice: str, tmp_path: Path
) -> None:
    from rollflow.flows.step import replaying_failed_episodes
    from rollflow.storage.runs import mark_run_kind
    from rollflow.tasks.step_health import StepFailedError

    parent = tmp_path / "nightly"
    root = parent / "grpo" if under_pipeline else tmp_path / "run"
    root.mkdir(parents=True)
    if under_pipeline:
        mark_run_kind(parent, "pipeline")
    if kind != "train":
        mark_run_kind(root, kind)
    folder = RunFolder(root)
    with pytest.raises(StepFailedError) as failed:
        with replaying_failed_episodes(folder, folder.step_paths(0, "validation")):
            raise StepFailedError("validation step 0: all 2 episodes failed: ConnectError", rollout_failed=True)
    expected = advice.format(root=root, parent=parent)
    assert str(failed.value).endswith(f"; its episodes were discarded: {expected}"), str(failed.value)
