"""Tools from MCP servers (envs/mcp): real server subprocesses, stdio and streamable HTTP.

The servers are the bundled example (envs/mcp_tool_use_game/server.py) and the misbehaving
ones of tests/mcp_servers.py. After every test no server this process started is left
(``_no_server_left``: checked by pid, from /proc).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from rollflow.config.checks import PreflightError
from rollflow.config.run import RunConfig, load_config
from rollflow.envs.handle import EpisodeLimits
from rollflow.envs.mcp import POOL, McpServer, mcp_tools, open_mcp_tools, with_meta
from rollflow.envs.mcp_tool_use_game.tasks import NUM_TRAIN, NUM_VALIDATION, SEED, tasks
from rollflow.envs.protocol import make_tool_call, render_tool_calls
from rollflow.envs.runner import EnvironmentLoadError, load_environment_handle
from rollflow.envs.scripted import ScriptedPolicy
from rollflow.envs.tool_use_game import expert_policy, generate_examples
from rollflow.envs.tools import count_tool_messages, run_tool_calls
from rollflow.ops.preflight import check_environment
from rollflow.ops.prompt_preview import preview_prompt
from rollflow.storage.query import open_run_sql, run_query

sys.path.insert(0, str(Path(__file__).resolve().parent))
from repo_script import load_script  # noqa: E402
from tiny_run import train_tiny_on  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SPEC = "rollflow.envs.mcp:load_environment"
GAME_SERVER = {"name": "game", "command": ["python", "-m", "rollflow.envs.mcp_tool_use_game.server"]}
KWARGS = {
    "servers": [GAME_SERVER],
    "tasks": "rollflow.envs.mcp_tool_use_game.tasks:tasks",
    "reward": "rollflow.envs.mcp_tool_use_game.tasks:reward",
    "max_turns": 4,
}
MISBEHAVING = str(REPO / "tests" / "mcp_servers.py")


def test_server(kind: str, **keys: object) -> dict[str, object]:
    return {"name": kind, "command": ["python", MISBEHAVING, kind], **keys}


test_server.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def _server_processes() -> list[int]:
    """This process's descendants that are MCP servers (by their command line)."""
    mine, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            status = (entry / "status").read_text()
        except OSError:
            continue
        is_server = "mcp_tool_use_game" in cmdline or "mcp_servers.py" in cmdline
        if is_server and "State:\tZ" not in status and _descends_from(int(entry.name), mine):
            found.append(int(entry.name))
    return found


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rpartition(")")[2].split()[1])
    return False


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(autouse=True)
def _no_server_left() -> Iterator[None]:
    yield
    pids = POOL.pids()
    POOL.close_all()
    assert all(_gone(pid) for pid in pids), f"MCP servers left running: {pids}"
    assert _server_processes() == [], f"MCP server processes left: {_server_processes()}"


def test_stdio_server_tools_are_listed_and_calls_routed() -> None:
    tools = mcp_tools([GAME_SERVER])
    assert sorted(tools) == ["calculator", "list_fact_keys", "lookup"]
    assert tools["lookup"].parameters_schema["properties"]["key"]["type"] == "string"
    assert tools["lookup"].parameters_schema["required"] == ["key"]
    assert tools["lookup"].description.startswith("Look up the value of one fact")
    task = tasks("train")[0]
    key = task["needed_keys"][0]
    calls = [
        make_tool_call("lookup", {"key": key}, 0),
        make_tool_call("lookup", {"key": "no_such_key"}, 1),  # isError: the model's feedback
        make_tool_call("calculator", {"expression": "6 * 7"}, 2),
        make_tool_call("lookup", {}, 3),  # fails the listed schema before reaching the server
    ]
    outcome = asyncio.run(run_tool_calls(with_meta(tools, task["mcp_meta"]), calls))
    contents = [message["content"] for message in outcome.messages]
    from rollflow.envs.tool_use_game.tasks import generate_examples

    facts = generate_examples(0, 200, 50)[0][0].metadata["facts"]
    assert contents[0] == str(facts[key])
    assert contents[1].startswith("tool_error: lookup failed: McpToolError:") and "no_such_key" in contents[1]
    assert contents[2] == "42"
    assert contents[3].startswith("tool_error: arguments of lookup do not match its schema")
    assert outcome.errors == 2
    assert count_tool_messages(list(outcome.messages)) == (4, 2)


def test_the_http_server_listens_before_it_prints_its_url() -> None:
    """A caller that reads the URL and connects at once must be let in (CI once lost this race:
    the port was bound but not yet listening while uvicorn started, and the connect was refused)."""
    command = [sys.executable, "-m", "rollflow.envs.mcp_tool_use_game.server", "--http"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        port = int(url.removeprefix("http://127.0.0.1:").split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)


def test_streamable_http_server() -> None:
    command = [sys.executable, "-m", "rollflow.envs.mcp_tool_use_game.server", "--http"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/mcp"), url
        tools = mcp_tools([{"url": url, "headers": {"X-Test": "1"}, "startup_timeout_s": 30}])
        assert sorted(tools) == ["calculator", "list_fact_keys", "lookup"]
        outcome = asyncio.run(run_tool_calls(tools, [make_tool_call("calculator", {"expression": "2 ** 5"}, 0)]))
        assert outcome.messages[0]["content"] == "32"
    finally:
        POOL.close_all()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)


@pytest.mark.parametrize(
    ("server", "words"),
    [
        (test_server("fails"), "'fails' failed to start.*cannot open the database"),
        (test_server("not-mcp", startup_timeout_s=3), "'not-mcp' did not answer as an MCP server"),
        (test_server("no-tools"), "'no-tools' lists no tools"),
        (test_server("bad-schema"), "'bad-schema' lists tool 'broken' with an invalid input schema"),
    ],
    ids=["fails", "not-mcp", "no-tools", "bad-schema"],
)
def test_preflight_refuses_a_bad_server_in_one_line(server: dict[str, object], words: str) -> None:
    config = load_config(REPO / "configs" / "mcp_tool_use_game.toml")
    config = replace(config, env=replace(config.env, kwargs={**KWARGS, "servers": [server]}))
    with pytest.raises(PreflightError, match=words) as refused:
        check_environment(config)
    assert "\n" not in str(refused.value)


def test_a_pass_of_the_bundled_mcp_game_is_a_right_answer_as_in_the_python_game() -> None:
    """The config-only form gave its suite no pass threshold, so ``passed`` was reward > 0:
    a wrong answer after one good tool call (0.05 of tool credit) counted as solved. The
    bundled config's ``pass_threshold`` is the Python-tool game's own threshold, and the two
    forms judge the same episodes alike."""
    from rollflow.tasks.shaping import ending_of, env_passed

    config = load_config(REPO / "configs" / "mcp_tool_use_game.toml")
    forms = (load_environment_handle(config.env.name, config.env.kwargs),
             load_environment_handle("rollflow.envs.tool_use_game:load_environment", {}))  # fmt: skip
    list_keys = render_tool_calls([make_tool_call("list_fact_keys", {}, 0)])
    verdicts = []
    for handle in forms:
        item = handle.tasks("validation")[0]
        answer = tasks("validation")[0]["answer"]
        rollouts = [
            asyncio.run(handle.play(item, ScriptedPolicy(lambda m, turn, say=say: list_keys if turn == 0 else say),
                                    EpisodeLimits(max_turns=4)))  # fmt: skip
            for say in (str(answer), str(answer + 1))
        ]
        scores = asyncio.run(handle.score(item, rollouts))
        assert [s.components["tool_call_ok"] for s in scores] == [1.0, 1.0], scores  # both earned tool credit
        verdicts.append([(s.threshold, env_passed(ending_of(r, s), s)) for r, s in zip(rollouts, scores, strict=True)])
    assert verdicts[0] == verdicts[1] == [(0.8, True), (0.8, False)]
    with pytest.raises(EnvironmentLoadError, match="pass_threshold must be a finite number, got 'solved'"):
        load_environment_handle(SPEC, {**KWARGS, "pass_threshold": "solved"})


def _learning_configs() -> tuple[RunConfig, RunConfig]:
    """The Python-tool game's GRPO config and the MCP config, its arm of the paired comparison."""
    configs = REPO / "configs"
    return load_config(configs / "learn_tool_use_game.toml"), load_config(configs / "mcp_tool_use_game.toml")


def test_the_mcp_config_is_the_learning_configs_run_with_its_tools_over_mcp() -> None:
    """Everything but [env] and [tracking] is the learning config's, so a paired run differs
    only in where the tools run (scripts/learn.sh rewrites both the same way)."""
    native, mcp = _learning_configs()
    assert replace(mcp, env=native.env, tracking=native.tracking) == native


@pytest.mark.parametrize("split", ["train", "validation"])
def test_the_mcp_config_opens_each_episode_with_the_learning_configs_prompt(split: str) -> None:
    """Token for token, with the bundled model's chat template: the tools' descriptions and
    schemas (the server publishes the Python tools' own), the system prompt, no worked example."""
    previews = [preview_prompt(config, load_environment_handle(config.env.name, config.env.kwargs), split, 0)
                for config in _learning_configs()]  # fmt: skip
    assert previews[0].task_id == previews[1].task_id
    assert previews[0].tools == previews[1].tools == ("list_fact_keys", "lookup", "calculator")
    assert previews[1].text == previews[0].text
    assert "<|im_start|>tool" not in previews[0].text  # no worked example: the learning config's prompt


def test_the_expert_plays_the_same_episode_through_both_forms() -> None:
    """The game's expert solution of train task 0, through the Python tools and through the
    server: the same messages (tool results included), the same tool specs, the same score."""
    played = []
    for config in _learning_configs():
        handle = load_environment_handle(config.env.name, config.env.kwargs)
        item = handle.tasks("train")[0]
        policy = expert_policy(generate_examples(SEED, NUM_TRAIN, NUM_VALIDATION)[0][:1])
        rollout = asyncio.run(handle.play(item, policy, EpisodeLimits(max_turns=config.rollout.max_turns)))
        [score] = asyncio.run(handle.score(item, [rollout]))
        played.append((rollout, score, policy.opened_tool_specs))
    (native, native_score, native_specs), (mcp, mcp_score, mcp_specs) = played
    assert native.error is None and native.terminated and native.turns == 4
    assert mcp.messages == native.messages
    assert mcp.response_text == native.response_text
    assert mcp_specs == native_specs
    assert (mcp_score.reward, mcp_score.threshold, dict(mcp_score.components)) == (
        native_score.reward, native_score.threshold, dict(native_score.components)
    )
    assert native_score.reward == 1.0


def test_a_server_killed_mid_episode_fails_that_episode_and_is_restarted() -> None:
    handle = load_environment_handle(SPEC, KWARGS)
    [item] = handle.tasks("train")[:1]
    first_pid = POOL.pids()[0]
    list_keys = render_tool_calls([make_tool_call("list_fact_keys", {}, 0)])

    def kill_then_call(messages: object, turn: int) -> str:
        if turn == 1:
            os.kill(first_pid, signal.SIGKILL)
            assert _gone(first_pid)
        return list_keys if turn < 2 else "7"

    limits = EpisodeLimits(max_turns=4)
    killed = asyncio.run(handle.play(item, ScriptedPolicy(kill_then_call), limits))
    assert killed.error is not None and "MCP server 'game'" in killed.error and "died" in killed.error, killed.error
    after = asyncio.run(handle.play(item, ScriptedPolicy(lambda m, t: list_keys if t == 0 else "7"), limits))
    assert after.error is None, after.error
    assert after.messages[-2]["content"].startswith('["'), after.messages[-2]
    assert POOL.pids() and POOL.pids()[0] != first_pid


def test_a_server_that_keeps_state_is_one_per_episode() -> None:
    server = test_server("slow", keeps_state=True)

    async def count_twice() -> tuple[list[str], list[int]]:
        async with await open_mcp_tools([server]) as toolbox:
            calls = [make_tool_call("counter", {}, 0), make_tool_call("counter", {}, 1)]
            outcome = await run_tool_calls(toolbox.tools, calls)
            return [m["content"] for m in outcome.messages], POOL.pids()

    first, first_pids = asyncio.run(count_twice())
    second, second_pids = asyncio.run(count_twice())
    assert first == second == ["1", "2"]  # a fresh counter each episode
    assert first_pids != second_pids and all(_gone(pid) for pid in first_pids + second_pids)


def test_call_timeout_and_concurrency_bound() -> None:
    tools = mcp_tools([test_server("slow", timeout_s=5.0, max_concurrent_calls=1)])

    async def naps(*seconds: float) -> list[str]:
        outcomes = await asyncio.gather(
            *(run_tool_calls(tools, [make_tool_call("nap", {"seconds": s}, 0)]) for s in seconds)
        )
        return [outcome.messages[0]["content"] for outcome in outcomes]

    [timed_out] = asyncio.run(naps(60.0))
    assert timed_out.startswith("tool_error: nap failed: McpToolError: Timed out"), timed_out
    started = time.monotonic()
    assert asyncio.run(naps(0.5, 0.5)) == ["slept 0.5", "slept 0.5"]
    assert time.monotonic() - started >= 1.0  # one call at a time


@pytest.mark.parametrize("end", ["returns", "ctrl-c", "sigkill"])
def test_no_server_outlives_the_process_that_started_it(end: str) -> None:
    """A normal exit and Ctrl-C stop the server (atexit); SIGKILL leaves it to the kernel
    (PR_SET_PDEATHSIG, set by the launcher). The server lingers after its stdin closes, so
    the closed pipe alone would not end it within the test."""
    script = (
        "import sys, time\n"
        "from rollflow.envs.mcp import POOL, mcp_tools\n"
        f"mcp_tools([{test_server('lingering')!r}])\n"
        "print(POOL.pids()[0], flush=True)\n"
        "sys.stdin.readline() if sys.argv[1] == 'returns' else time.sleep(60)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script, end], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdin is not None and run.stdout is not None
        server_pid = int(run.stdout.readline())
        assert not _gone(server_pid, timeout_s=0.2)
        if end == "returns":
            run.stdin.write("\n")
            run.stdin.flush()
        else:
            run.send_signal(signal.SIGINT if end == "ctrl-c" else signal.SIGKILL)
        run.wait(timeout=20)
        assert _gone(server_pid), f"the server {server_pid} outlived its process ({end})"
    finally:
        run.kill()


def test_without_the_sdk_the_import_names_the_extra() -> None:
    script = "import sys; sys.modules['mcp'] = None\nimport rollflow.envs.mcp\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "pip install 'rollflow[mcp]'" in result.stderr.splitlines()[-1], result.stderr[-500:]


@pytest.mark.slow
def test_two_steps_of_rollflow_train_on_an_mcp_server(
    tiny_model_dir: Path, tmp_path: Path, prefect_harness: object
) -> None:
    run_dir = train_tiny_on(tiny_model_dir, tmp_path, SPEC, {**KWARGS, "system_prompt": "Use the tools."}, max_turns=2)
    con = open_run_sql(run_dir)
    _, rows = run_query(
        con,
        "SELECT e.step, count(*), count_if(e.error IS NULL), count_if(s.reward IS NOT NULL) "
        "FROM episodes e JOIN scores s USING (run_id, split, step, episode_id) WHERE e.split = 'train' "
        "GROUP BY ALL ORDER BY ALL",
    )
    assert rows == [(0, 4, 4, 4), (1, 4, 4, 4)]  # 2 tasks x 2 episodes a step, none an error, all scored
    _, steps = run_query(con, "SELECT count(*) FROM steps")
    assert steps == [(2,)]


@pytest.mark.parametrize(
    ("servers", "words"),
    [
        ([{"command": []}], r"servers\[0\]\.command must be a non-empty list of strings"),
        ([{"command": ["x"], "url": "http://h/mcp"}], "exactly one of command or url"),
        ([{"url": "ftp://h/mcp"}], "must start with http:// or https://"),
        ([{"command": ["x"], "timeout": 3}], r"servers\[0\] has unknown keys \['timeout'\]"),
        ([{"command": ["x"], "max_concurrent_calls": 0}], "max_concurrent_calls must be an integer >= 1"),
        ([], "servers must be a non-empty list"),
    ],
)
def test_a_bad_server_table_is_refused_before_anything_starts(servers: object, words: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=words):
        load_environment_handle(SPEC, {**KWARGS, "servers": servers})
    assert POOL.pids() == []


def test_the_overhead_bench_runs_every_leg_and_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/mcp_bench.py end to end, small: the table's shape and the answers, not the timings."""
    bench = load_script("bench/mcp_bench.py")
    assert bench.main(["--calls", "6", "--warmup", "1", "--concurrency", "3"]) == 0
    out = capsys.readouterr().out
    key = tasks("train")[0]["needed_keys"][0]
    assert f'lookup({{"key": "{key}"}}) on train task 0 answers ' in out
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    assert rows[0] == ["leg", "concurrency", "calls", "median ms", "p90 ms", "calls/s"]
    assert [row[:3] for row in rows[1:]] == [
        [leg, level, "6"] for level in ("1", "3") for leg in ("python", "mcp-stdio", "mcp-http")
    ]
    for row in rows[1:]:
        median, p90, rate = (float(cell) for cell in row[3:])
        assert 0 < median <= p90 and rate > 0, row
