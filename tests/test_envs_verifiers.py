"""The verifiers adapter (envs/verifiers.py) with the real library: a SingleTurnEnv, a
MultiTurnEnv subclass and a ToolEnv (tests/vf_arithmetic.py, built from verifiers' own
classes) played through rollflow's runner end with the reward verifiers' own rollout loop
gives the same answers; splits never share a prompt; loading errors are one line; an
error inside an episode is recorded on that episode."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

vf = pytest.importorskip("verifiers", reason="the verifiers extra is not installed")

from rollflow.config.run import load_config  # noqa: E402
from rollflow.envs.handle import EpisodeLimits  # noqa: E402
from rollflow.envs.protocol import make_tool_call, parse_action, render_tool_calls  # noqa: E402
from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle, play_groups  # noqa: E402
from rollflow.envs.scripted import ScriptedPolicy  # noqa: E402
from rollflow.envs.types import Message  # noqa: E402
from rollflow.envs.verifiers import to_rollflow_messages  # noqa: E402
from rollflow.envs.verifiers_loading import load_verifiers_environment  # noqa: E402
from rollflow.storage.query import open_run_sql, run_query  # noqa: E402
from rollflow.config.checks import PreflightError  # noqa: E402
from rollflow.ops.preflight import check_environment  # noqa: E402
from rollflow.tasks.shaping import ending_of, env_passed  # noqa: E402
from tiny_run import REPO, train_tiny_on  # noqa: E402

SPEC = "rollflow.envs.verifiers:load_environment"
ENV_ID = "vf_arithmetic"


def _numbers(messages: Sequence[Message]) -> tuple[int, int]:
    question = next(m["content"] for m in messages if m["role"] == "user")
    a, b = map(int, re.findall(r"\d+", question))
    return a, b


def right(messages: Sequence[Message], turn: int) -> str:
    return f"<answer>{sum(_numbers(messages))}</answer>"


def low_then_right(messages: Sequence[Message], turn: int) -> str:
    total = sum(_numbers(messages))
    return f"<answer>{total - 1 if turn == 0 else total}</answer>"


def unformatted(messages: Sequence[Message], turn: int) -> str:
    return str(sum(_numbers(messages)))  # right, but not where the parser reads


def uses_the_tool(messages: Sequence[Message], turn: int) -> str:
    if turn == 0:
        a, b = _numbers(messages)
        return render_tool_calls([make_tool_call("add", {"a": a, "b": b})])
    return f"<answer>{messages[-1]['content']}</answer>"  # the tool's result


class ScriptedClient:
    """A verifiers ``Client`` answering from the same script, so verifiers' own rollout loop
    plays the same actions: its rewards are the reference."""

    def __new__(cls, script: Any) -> Any:
        from verifiers.legacy.clients.client import Client
        from verifiers.legacy.types import Response, ResponseMessage

        class _Client(Client):  # type: ignore[misc]
            def __init__(self) -> None:
                self._client = self._config = None

            def setup_client(self, config: Any) -> None:
                return None

            async def get_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kw: Any) -> Any:
                messages = to_rollflow_messages(prompt, "prompt")
                turn = sum(m["role"] == "assistant" for m in messages)
                text = script(messages, turn)
                calls = [
                    {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    for c in parse_action(text).tool_calls
                ] or None
                message = ResponseMessage(content=text, tool_calls=calls, finish_reason="stop", is_truncated=False)
                return Response(id="scripted", created=0, model=model, message=message)

            to_native_tool = to_native_prompt = get_native_response = get_response
            raise_from_native_response = from_native_response = get_response

            async def close(self) -> None:
                return None

        return _Client()


def library_rollout(env_args: dict[str, Any], example_id: int, script: Any) -> dict[str, Any]:
    """verifiers' own ``run_rollout`` of training row ``example_id`` with ``script`` as the model."""
    environment = load_verifiers_environment(ENV_ID, env_args)
    row = dict(environment.get_dataset()[example_id])
    return dict(asyncio.run(environment.run_rollout(row, ScriptedClient(script), "scripted", {})))


def play(kwargs: dict[str, Any], script: Any, max_turns: int = 6, n: int = 4) -> list[tuple[Any, Any, Any]]:
    handle = load_environment_handle(SPEC, {"num_validation": 2, **kwargs})
    items = handle.tasks("train")[:n]
    groups = asyncio.run(play_groups(handle, items, 1, ScriptedPolicy(script), EpisodeLimits(max_turns=max_turns), concurrency=n))
    return [(item, rollout, asyncio.run(handle.score(item, [rollout]))[0]) for item, (rollout,) in zip(items, groups, strict=True)]


@pytest.mark.parametrize(
    ("kind", "script", "reward", "turns"),
    [
        ("single", right, 1.2, 1),  # correct_answer 1 + 0.2 x format
        ("single", unformatted, 0.04, 1),  # 0.2 x a partial format reward
        ("retry", right, 1.0, 1),
        ("retry", low_then_right, 0.5, 2),  # 1 / attempts
        ("tool", uses_the_tool, 1.0, 2),
    ],
)
def test_rewards_are_the_librarys_for_the_same_answers(kind: str, script: Any, reward: float, turns: int) -> None:
    env_args = {"kind": kind}
    for item, rollout, score in play({"env_id": ENV_ID, "env_args": env_args}, script):
        assert rollout.error is None and score.error is None and rollout.terminated
        assert rollout.turns == turns and score.reward == pytest.approx(reward)
        expected = library_rollout(env_args, item.payload.metadata["example_id"], script)  # type: ignore[union-attr]
        assert score.reward == expected["reward"]
        assert {k: v for k, v in score.components.items() if k != "pass_threshold_met"} == expected["metrics"]
        assert score.components["pass_threshold_met"] == float(reward >= 0.5)
        assert list(rollout.step_metadata[-1].items()) == [("stop_condition", expected["stop_condition"])]
        library_transcript = [(m.get("role"), m.get("content")) for m in (*expected["prompt"], *expected["completion"])]
        assert [(m["role"], m["content"]) for m in rollout.messages] == library_transcript


def test_the_environments_own_replies_and_tools_are_the_next_turn() -> None:
    (_, retry, _), *_ = play({"env_id": ENV_ID, "env_args": {"kind": "retry"}}, low_then_right, n=1)
    assert [m["role"] for m in retry.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert retry.messages[3]["content"] == "Not quite: try higher."
    (_, tool, score), *_ = play({"env_id": ENV_ID, "env_args": {"kind": "tool"}}, uses_the_tool, n=1)
    a, b = _numbers(tool.messages)
    assert tool.messages[2]["tool_calls"][0]["function"]["name"] == "add"
    assert tool.messages[3] == {"role": "tool", "content": str(a + b), "tool_call_id": "call_0"}
    assert score.components["total_tool_calls"] == 1.0 and score.components["add_calls"] == 1.0


@pytest.mark.parametrize(("pass_kwargs", "passes"), [({}, (False, True)), ({"pass_threshold": 0.01}, (True, True))])
def test_passed_is_the_environments_pass_threshold(pass_kwargs: dict, passes: tuple[bool, bool]) -> None:
    """The rubric pays a right answer outside the answer tags 0.04 of format credit: under
    the environment's ``pass_threshold`` (0.5), so not a pass, as verifiers itself says,
    unless ``pass_threshold`` is set lower."""
    for script, passed in zip((unformatted, right), passes, strict=True):
        for _, rollout, score in play({"env_id": ENV_ID, **pass_kwargs}, script, n=2):
            assert score.reward == pytest.approx(0.04 if script is unformatted else 1.2)
            assert env_passed(ending_of(rollout, score), score) is passed
            assert score.components["pass_threshold_met"] == float(script is right)  # verifiers' own, always


def test_a_rollout_cut_short_by_rollflow_is_not_scored() -> None:
    (_, rollout, score), *_ = play({"env_id": ENV_ID, "env_args": {"kind": "retry"}}, low_then_right, max_turns=1, n=1)
    assert not rollout.terminated and str(rollout.truncation_cause) == "max_turns"
    assert score.reward == 0.0 and score.components == {}


def test_an_error_in_env_response_is_recorded_on_its_episode() -> None:
    episodes = play({"env_id": ENV_ID, "env_args": {"kind": "broken"}}, low_then_right, n=2)
    for _, rollout, score in episodes:
        assert rollout.error is not None and "KeyError" in rollout.error and "the game's table is missing" in rollout.error
        assert score.error is not None


def test_splits_never_share_a_prompt() -> None:
    handle = load_environment_handle(SPEC, {"env_id": ENV_ID, "env_args": {"with_eval": True}})
    train = {item.payload.prompt for item in handle.tasks("train")}  # type: ignore[union-attr]
    validation = {item.payload.prompt for item in handle.tasks("validation")}  # type: ignore[union-attr]
    assert len(train) == 12 and validation == {"What is 11 + 12?", "What is 13 + 14?"}  # 2 + 4 is a training question
    split = {}
    for seed in (0, 0, 1):
        handle = load_environment_handle(SPEC, {"env_id": ENV_ID, "num_validation": 3, "seed": seed})
        train = {item.task_id for item in handle.tasks("train")}
        validation = {item.task_id for item in handle.tasks("validation")}
        assert len(train) == 9 and len(validation) == 3 and not train & validation
        assert split.setdefault(seed, validation) == validation
    assert split[0] != split[1]
    handle = load_environment_handle(SPEC, {"env_id": ENV_ID, "num_validation": 3, "num_train": 4})
    assert len(handle.tasks("train")) == 4


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"env_id": "vf_arithmetc"}, r"env_id = 'vf_arithmetc': no module 'vf_arithmetc' is installed"),
        ({"env_id": "json"}, r"module 'json' has no load_environment, so it is not a verifiers environment"),
        ({"env_id": ENV_ID, "env_args": {"fail": True}}, r"'vf_arithmetic' failed to load with env_args = \{'fail': True\}: FileNotFoundError: questions.jsonl"),
        ({"env_id": ENV_ID, "env_args": {"colour": 2}}, r"failed to load .*TypeError: .*colour"),
        ({"env_id": ENV_ID, "env_args": {"kind": "groups"}}, r"its rubric has group reward functions"),
        ({"env_id": ENV_ID, "num_validation": 12}, r"has 12 distinct prompts, which leaves none to train on"),
        ({"env_id": ENV_ID, "pass_threshold": "half"}, r"pass_threshold must be a finite number, got 'half'"),
    ],
)  # fmt: skip
def test_loading_errors_are_one_line(kwargs: dict, pattern: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=pattern) as raised:
        load_environment_handle(SPEC, kwargs)
    assert "\n" not in str(raised.value)


def test_preflight_refuses_a_missing_environment_module_in_one_line() -> None:
    config = load_config(REPO / "configs" / "tiny.toml")
    bad = replace(config, env=replace(config.env, name=SPEC, kwargs={"env_id": "primeintellect/no-such-env"}))
    with pytest.raises(PreflightError, match=r"env_id = 'primeintellect/no-such-env': no module 'no_such_env' is installed") as raised:
        check_environment(bad)
    assert "\n" not in str(raised.value)


def test_verifiers_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers -> ImportError
    with pytest.raises(EnvironmentLoadError, match=r"needs the verifiers library.*pip install 'rollflow\[verifiers\]'"):
        load_environment_handle(SPEC, {"env_id": ENV_ID, "num_validation": 2})


def test_loading_keeps_rollflows_signal_handlers_and_works_off_the_main_thread() -> None:
    def ours(signum: int, frame: object) -> None:
        return None

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        load_environment_handle(SPEC, {"env_id": ENV_ID, "num_validation": 2})
        assert signal.getsignal(signal.SIGTERM) is ours  # verifiers' constructor would install its own
        errors: list[BaseException] = []

        def load() -> None:
            try:
                load_environment_handle(SPEC, {"env_id": ENV_ID, "env_args": {"kind": "tool"}, "num_validation": 2})
            except BaseException as exc:  # noqa: BLE001  (reported below)
                errors.append(exc)

        thread = threading.Thread(target=load)
        thread.start()
        thread.join()
        assert errors == []
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
def test_two_steps_of_rollflow_train_on_the_tiny_model(
    tiny_model_dir: Path, tmp_path: Path, prefect_harness: object
) -> None:
    kwargs = {"env_id": ENV_ID, "env_args": {"kind": "single"}, "num_train": 4, "num_validation": 2}
    run_dir = train_tiny_on(tiny_model_dir, tmp_path, SPEC, kwargs, max_turns=1)
    con = open_run_sql(run_dir)
    _, rows = run_query(
        con,
        "SELECT e.step, count(*), count_if(e.task_id LIKE 'verifiers/vf_arithmetic/dataset/%'), count_if(e.error IS NULL) "
        "FROM episodes e JOIN scores s USING (run_id, split, step, episode_id) WHERE e.split = 'train' "
        "GROUP BY ALL ORDER BY ALL",
    )
    assert rows == [(0, 4, 4, 4), (1, 4, 4, 4)]
    _, steps = run_query(con, "SELECT count(*) FROM steps")
    assert steps == [(2,)]


def test_the_eval_report_names_the_library_and_environment() -> None:
    from rollflow.flows.eval import describe_environment

    assert describe_environment(SPEC, {"env_id": ENV_ID}) == f"verifiers environment vf_arithmetic ({SPEC})"
