"""Ctrl-C on a real `rollflow train`, sent as a terminal sends it: SIGINT to the run's whole
process group, mid-run, on the tiny model (tests/tiny_run.py).

It must stop the run as ``kill`` (SIGTERM) does: exit status 130, one line on how to resume,
no traceback, and nothing the run started left running (its Prefect server included, which
used to get the SIGINT too and die under the engine, leaving it to retry for minutes). The
time from the signal to the exit is printed, not asserted (`pytest -s` shows it).

A stop during the update (issue 59, item 14) takes effect within seconds, also mid-backward
and also in a run started as a background job (SIGINT ignored), says so at once, and commits
no checkpoint for the step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kill_matrix import PREFECT_SERVER, RunProcess, _cmdline

STOP_LINE = "rollflow: stopping"  # the handler's line, at once on stderr


def _prefect_servers(run: RunProcess) -> list[int]:
    return [p.pid for p in run.look().values() if PREFECT_SERVER in _cmdline(p.pid)]


@pytest.mark.slow
def test_ctrl_c_stops_the_run_with_status_130_one_resume_line_and_nothing_left(
    tiny_config_path: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "interrupted"
    log = tmp_path / "stderr.txt"
    run = RunProcess(["train", str(tiny_config_path), "--run-dir", str(run_dir)], log)
    try:
        # Mid-run: step 0 is trained and step 1's rollout is under way, Prefect's server up.
        run.wait_until(lambda: (run_dir / "checkpoints" / "step=000000").exists(), "step 0's checkpoint")
        run.wait_until(lambda: bool(_prefect_servers(run)), "Prefect's temporary server in the run's tree")
        signalled = time.monotonic()
        os.killpg(run.child.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        status = run.finish()  # also: nothing the run was seen with outlives it
        took = time.monotonic() - signalled
    finally:
        if run.child.poll() is None:
            os.killpg(run.child.pid, signal.SIGKILL)
            run.child.wait(timeout=60)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nrollflow train exited {took:.1f} s after Ctrl-C, status {status} (load average {load})")
    text = log.read_text()
    assert status == 130, text[-3000:]
    resume_lines = [line for line in text.splitlines() if "rollflow resume" in line]
    assert len(resume_lines) == 1, text[-3000:]
    assert resume_lines[0].endswith(f"continue with `rollflow resume {run_dir}`"), text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_the_own_session_server_runs_prefects_own_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """flows/prefect_server.py repeats Prefect's server command: it must still be Prefect's."""
    import subprocess

    from prefect.server.api.server import SubprocessASGIServer

    from rollflow.flows.prefect_server import own_session_server_class

    OwnSessionServer = own_session_server_class()
    calls: list[dict] = []
    monkeypatch.setattr(subprocess, "Popen", lambda **kwargs: calls.append(kwargs))
    for cls, port in ((SubprocessASGIServer, 1), (OwnSessionServer, 2)):
        server = cls(port)
        try:
            server.port = 8999
            server._run_uvicorn_command()
        finally:
            del SubprocessASGIServer._instances[port]
    prefects, ours = calls
    assert ours.pop("start_new_session") is True
    ours.pop("preexec_fn")
    assert ours == prefects


def test_the_own_session_server_is_prefects_default_and_leaves_a_harness_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.server.api.server import SubprocessASGIServer

    from rollflow.flows.prefect_server import own_session_server_class, serve_prefect_in_own_session

    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    # as `rollflow train` runs: no server configured (the suite's session harness sets one)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        server = serve_prefect_in_own_session()
        assert isinstance(server, own_session_server_class()) and not server.running
        assert SubprocessASGIServer() is server  # what Prefect's client, events and logs ask for
        assert serve_prefect_in_own_session() is None  # one there already
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert serve_prefect_in_own_session() is None  # a server of the user's, or the test harness
    assert not SubprocessASGIServer._instances


def test_a_run_on_a_configured_server_never_imports_prefects_server() -> None:
    """1.7 CPU-seconds a run on a nightly pipeline's server (or the suite's) does not need."""
    import subprocess
    import sys

    probe = ("import sys\n"
             "from rollflow.flows.prefect_server import serve_prefect_in_own_session\n"
             "from rollflow.flows.train import train_flow\n"
             "assert serve_prefect_in_own_session() is None\n"
             "print(sorted(m for m in sys.modules if m.startswith('prefect.server')))")  # fmt: skip
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_a_stage_error_after_ctrl_c_is_the_stop_not_a_failed_stage(tmp_path: Path) -> None:
    """Ctrl-C during a stage's DuckDB query (the metrics stage, found in a suite run: status 1
    and a traceback): DuckDB checks for signals itself, eats the handler's SystemExit and
    raises ``RuntimeError: Query interrupted``. After a stop request a stage's error is the
    stop (``stops_through``); before one it is the stage's own."""
    from rollflow.config.run import RunConfig
    from rollflow.flows.step import metrics
    from rollflow.policy.stopping import clear_stop, request_stop
    from rollflow.storage.runfolder import RunFolder

    folder = RunFolder(tmp_path / "not-a-run")
    p = folder.step_paths(0)
    with pytest.raises(Exception) as failed:  # noqa: PT011 - whatever the stage's own error is
        metrics.fn(RunConfig(), folder, p, out=p.metrics_json)
    request_stop(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as stopped:  # what the handler raised and DuckDB ate
            metrics.fn(RunConfig(), folder, p, out=p.metrics_json)
        assert stopped.value.code == 130
        assert type(stopped.value.__cause__) is type(failed.value)
    finally:
        clear_stop()


# ---------------------------------------------------------------- a stop during the update (issue 59, item 14)

_IGNORING_SIGINT = (  # what a non-interactive shell's background job inherits: SIGINT ignored
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _stop_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(STOP_LINE)]


def _long_backward_update(signum: int) -> None:
    """The child of the test below: two-thirds of a GRPO update's time is its backward, one
    C++ call in which Python's signal handler cannot run; ``signum`` arrives early in it."""
    import threading

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from update_exactness import grouped_samples

    from rollflow.policy.stopping import exit_on_stop_signals
    from rollflow.tasks.grpo_update import UpdateSettings, grpo_update, make_optimizer

    exit_on_stop_signals()  # as `rollflow train` does, whatever SIGINT's inherited disposition
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    model = LlamaForCausalLM(config)
    samples = grouped_samples(config.vocab_size, groups=2, per_group=4, prompt=150)
    times: dict[str, float] = {}

    def signal_soon() -> None:  # from another thread, as the kernel delivers it: the main one is in backward
        time.sleep(0.05)
        times["signal"] = time.monotonic()
        os.kill(os.getpid(), signum)

    def backward_starts(grad: torch.Tensor) -> None:
        if "signal" not in times:
            times["forward"] = time.monotonic() - times["start"]
            threading.Thread(target=signal_soon, daemon=True).start()

    def on_logits(module: torch.nn.Module, inputs: object, logits: torch.Tensor) -> None:
        logits.register_hook(backward_starts)  # the first grad the backward computes

    model.lm_head.register_forward_hook(on_logits)
    times["start"] = time.monotonic()
    try:
        grpo_update(model, None, make_optimizer(model, 1e-4), samples, UpdateSettings(max_tokens_per_microbatch=10**6))
    finally:
        print(f"forward {times.get('forward', -1):.3f} stop {time.monotonic() - times.get('signal', 0):.3f}", flush=True)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.slow  # ~10 s each
def test_a_stop_mid_backward_takes_effect_within_a_layer_and_says_so_at_once(signum: int) -> None:
    """Before: the signal waited for the whole backward (35 s of a 45 s one, measured), and
    nothing was printed until the run's end. The forward is about a third of the update: the
    stop must come well within it, a few layers' backward, not the rest of the backward."""
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    child = f"import test_ctrl_c; test_ctrl_c._long_backward_update({int(signum)})"
    done = subprocess.run([sys.executable, "-c", _IGNORING_SIGINT, "-c", child], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 128 + signum, done.stderr[-3000:]
    forward_s, stop_s = (float(x) for x in done.stdout.split()[1::2])
    print(f"\n{signal.Signals(signum).name}: forward {forward_s:.2f} s, stop {stop_s:.2f} s after the signal")
    assert 0 <= stop_s < forward_s / 2, done.stdout
    assert len(_stop_lines(done.stderr)) == 1, done.stderr[-3000:]


def _long_update_config(tiny_config_path: Path) -> Path:
    """configs/tiny.toml, one step whose update is many small optimizer steps: 16 episodes,
    one per micro-batch, one optimizer step each, with a KL reference pass; no validation."""
    from rollflow.config.run import config_to_toml, load_config

    config = load_config(tiny_config_path)
    config = replace(
        config,
        rollout=replace(config.rollout, batch_size=4, episodes_per_task=4),
        train=replace(config.train, num_steps=1, max_tokens_per_microbatch=1, minibatches=16, kl_coef=0.1),
        validation=replace(config.validation, validation_interval=0),
        tracking=replace(config.tracking, enabled=False),
    )
    tiny_config_path.write_text(config_to_toml(config))
    return tiny_config_path


def _stop_in_the_update(run: RunProcess, signum: int) -> tuple[int, float]:
    """Send ``signum`` to the run alone once its log says the update started; (status,
    seconds from the signal to the exit)."""
    run.wait_until(lambda: "train step 0: update on " in run.log.read_text(), "the update")
    signalled = time.monotonic()
    os.kill(run.child.pid, signum)
    status = run.finish()
    return status, time.monotonic() - signalled


@pytest.mark.slow  # ~100 s: a run to its update, a resume to its update, a resume to the end
def test_a_stop_during_the_update_of_a_background_run_ends_it_in_seconds_and_resume_completes(
    tiny_config_path: Path, tmp_path: Path, shared_prefect_url: str
) -> None:
    """Started as a background job is (SIGINT ignored), stopped in the update by Ctrl-C, its
    resume by SIGTERM: each exits with the signal's status, says it stops in one line and
    commits no checkpoint; the next resume trains the step. Before: no line until the end."""
    config = _long_update_config(tiny_config_path)
    run_dir = tmp_path / "run"
    for attempt, signum in enumerate((signal.SIGINT, signal.SIGTERM)):
        argv = ["train", str(config), "--run-dir", str(run_dir)] if attempt == 0 else ["resume", str(run_dir)]
        log = tmp_path / f"stderr-{attempt}.txt"
        command = [sys.executable, "-c", _IGNORING_SIGINT, "-m", "rollflow.flows.cli"]
        run = RunProcess(argv, log, command=command, prefect_url=shared_prefect_url)
        status, took = _stop_in_the_update(run, signum)
        text = log.read_text()
        print(f"\n{signal.Signals(signum).name} in the update: exit {status} after {took:.1f} s")
        assert status == 128 + signum, text[-3000:]
        assert took < 60, text[-3000:]  # seconds (on a loaded machine), not the rest of the update
        assert len(_stop_lines(text)) == 1, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert not (run_dir / "checkpoints" / "step=000000").exists()  # the update is redone on resume
    run = RunProcess(["resume", str(run_dir)], tmp_path / "stderr-final.txt", prefect_url=shared_prefect_url)
    assert run.finish() == 0, run.tail()
    assert (run_dir / "checkpoints" / "step=000000").is_dir()
    trained = json.loads((run_dir / "steps" / "step=000000" / "train.json").read_text())
    print(f"the whole update, resumed: {trained['timings']['update_s']:.1f} s")


# ---------------------------------------------------------------- Ctrl-C outside a stage (review F6)

REPORT_ROWS = 64_000  # 8 episode ids, 8,000 rows each: the report's joins take some 20 s


def _finished_eval_with_a_slow_report(root: Path, config_path: Path, base_url: str) -> None:
    """An evaluation folder whose pass is done (the flow runs nothing again), with so many rows
    per episode id that the report's SQL (episodes joined with scores) runs for seconds."""
    import numpy as np
    import pyarrow as pa

    from rollflow.flows.eval import EVAL_STEP, open_eval_run
    from rollflow.flows.eval_config import EvalOverrides, checked_eval_config
    from rollflow.storage.schemas import episode_records_to_table, score_records_to_table
    from rollflow.storage.synthetic import synthetic_episode, synthetic_score

    config = checked_eval_config(str(config_path), EvalOverrides(base_url=base_url, api_model="none"))
    folder = open_eval_run(config, root)
    episodes = [synthetic_episode("eval", EVAL_STEP, t, i, split="validation") for t in range(4) for i in range(2)]
    copies = pa.array(np.arange(REPORT_ROWS) % len(episodes))
    scores = [synthetic_score(e, 1.0) for e in episodes]
    for stage, table in (("episodes", episode_records_to_table(episodes)), ("scores", score_records_to_table(scores))):
        folder.write_stage(table.take(copies), EVAL_STEP, stage, "validation")
    folder.write_json_atomic(folder.step_paths(EVAL_STEP, "validation").metrics_json, {})


@pytest.mark.slow  # ~40 s: the command's imports, its flow on the session's server, the report's start
def test_ctrl_c_during_the_eval_report_exits_130_with_one_line(tmp_path: Path, shared_prefect_url: str) -> None:
    """DuckDB, interrupted outside a stage, ate the handler's SystemExit and raised
    ``RuntimeError: Query interrupted``: `rollflow eval` printed its traceback and exited 1."""
    root, config, base_url = tmp_path / "eval", tmp_path / "eval.toml", "http://127.0.0.1:9/v1"
    config.write_text("[tracking]\nenabled = false\n")
    _finished_eval_with_a_slow_report(root, config, base_url)
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    env = {**os.environ, "PREFECT_API_URL": shared_prefect_url, "PREFECT_LOGGING_LEVEL": "INFO"}  # a user's level
    with out.open("w") as stdout, err.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "rollflow.flows.cli", "eval", "--config", str(config), "--base-url", base_url,
             "--api-model", "none", "--run-dir", str(root)],
            stdout=stdout, stderr=stderr, env=env, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's job starts
        )  # fmt: skip
    try:
        log = root / "logs" / "prefect.log"  # the flow's whole log: its end means the report is next
        deadline = time.monotonic() + 240
        while not (log.exists() and "Flow run" in (text := log.read_text()) and "Completed()" in text):
            assert child.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "the eval flow never finished"
            time.sleep(0.2)
        time.sleep(3)  # well into the report's SQL
        assert child.poll() is None, "the report finished before the Ctrl-C: make REPORT_ROWS larger"
        os.killpg(child.pid, signal.SIGINT)
        status = child.wait(timeout=60)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=60)
    text = err.read_text()
    assert status == 130, text[-3000:]
    assert "Traceback" not in text and "Query interrupted" not in text, text[-3000:]
    ours = [line for line in text.splitlines() if line.startswith("rollflow eval:")]
    assert ours == [f"rollflow eval: stopped before the report; the evaluation is complete: the same "
                    f"`rollflow eval` with `--run-dir {root}` prints it"], text[-3000:]
    assert out.read_text() == ""  # no half a report


@pytest.mark.slow  # ~40 s: the command's imports, its flow on the session's server
def test_ctrl_c_during_an_eval_is_one_line_on_how_to_finish_it_and_no_crash(
    tmp_path: Path, shared_prefect_url: str
) -> None:
    """Ctrl-C while the episodes wait on the server: status 130, the handler's line and the
    command's, and none of Prefect's 'Crash detected!' lines (the newcomer saw 4); the run
    folder's log keeps them."""
    from json_server import json_server

    asked: list[str] = []

    def slow_answer(path: str, headers: object, body: object) -> tuple[int, object, float]:
        asked.append(path)
        message = {"role": "assistant", "content": "17"}
        return 200, {"id": "c", "object": "chat.completion", "usage": {"total_tokens": 5},
                     "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}, 60.0  # fmt: skip

    root, config = tmp_path / "eval", tmp_path / "eval.toml"
    config.write_text("[tracking]\nenabled = false\n[validation]\nnum_tasks = 2\n")
    err = tmp_path / "stderr.txt"
    env = {**os.environ, "PREFECT_API_URL": shared_prefect_url, "PREFECT_LOGGING_LEVEL": "INFO"}
    with json_server(slow_answer) as url, err.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "rollflow.flows.cli", "eval", "--config", str(config), "--base-url", f"{url}/v1",
             "--api-model", "smol", "--run-dir", str(root)],
            stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's job starts
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while not asked:
                assert child.poll() is None, err.read_text()[-3000:]
                assert time.monotonic() < deadline, "the evaluation never asked the server"
                time.sleep(0.2)
            os.killpg(child.pid, signal.SIGINT)
            status = child.wait(timeout=60)
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(timeout=60)
    text = err.read_text()
    assert status == 130, text[-3000:]
    assert "Traceback" not in text and "Crash detected" not in text, text[-3000:]
    ours = [line for line in text.splitlines() if line.startswith("rollflow eval:")]
    assert ours == [f"rollflow eval: stopped; the same `rollflow eval` with `--run-dir {root}` finishes the evaluation"], text
    assert "Crash detected" in (root / "logs" / "prefect.log").read_text()
