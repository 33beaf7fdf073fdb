"""The whole training flow on a tiny model under Prefect's test harness: files, metrics, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

import rollflow.flows.step as step_module
from rollflow.config.parsing import ConfigError
from rollflow.config.run import load_config
from rollflow.flows.cli import main
from rollflow.flows.runs import RunSetupError, open_run
from rollflow.flows.train import train_flow
from rollflow.storage.errors import ConfigMismatchError
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder, StepPaths
from rollflow.storage.runs import run_status
from rollflow.storage.schemas import table_to_episode_records
from rollflow.storage.stage_outputs import locate_output
from rollflow.storage.tracking import RunTracker
from rollflow.ops.run_summary import CURVE_SQL
from tiny_run import kill_group, tiny_config_at

pytestmark = pytest.mark.usefixtures("prefect_harness")

STAGES = ("rollout_stage", "score_stage", "flatten_stage", "train_stage", "metrics_stage")


class InjectedCrash(RuntimeError):
    pass


def final_adapter(run_dir: Path) -> dict:
    folder = RunFolder(run_dir)
    step, path = folder.latest_checkpoint()
    return {"step": step, "weights": load_file(str(path / "adapter_model.safetensors"))}


def episode_ids(run_dir: Path) -> list[tuple[int, str]]:
    con = open_run_sql([run_dir])
    _, rows = run_query(con, "SELECT step, episode_id FROM episodes WHERE split = 'train' ORDER BY ALL")
    return rows


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, prefect_harness: object) -> Path:
    """One run that nothing interrupts: the reference every resumed run must equal."""
    root = tmp_path_factory.mktemp("uninterrupted")
    path = tiny_config_at(root, tiny_model_dir)
    return Path(train_flow(config_path=str(path), run_dir=str(root / "run")))


@pytest.mark.slow  # 13 s in a loaded suite run (docs/testing.md)
def test_the_updates_really_change_the_policy(uninterrupted: Path) -> None:
    """Guards the resume tests: identical weights must not come from a no-op update."""
    folder = RunFolder(uninterrupted)
    _, rows = run_query(open_run_sql([uninterrupted]), "SELECT count(*) FROM scores WHERE advantage <> 0")
    assert rows[0][0] > 0
    assert all(folder.read_train_result(s).grad_norm > 0 for s in (0, 1))
    lora_b = [t for name, t in final_adapter(uninterrupted)["weights"].items() if "lora_B" in name]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # B starts at zero


def test_tiny_run_writes_every_stage_and_logs_each_step_once(uninterrupted: Path) -> None:
    folder = RunFolder(uninterrupted)
    config = load_config(folder.config_path)
    assert folder.completed_steps() == [0, 1]
    assert [s for s, _ in folder.checkpoints()] == [0, 1]
    assert folder.steps("validation") == [0, 2]  # baseline, then after the last step
    per_step = config.rollout.batch_size * config.rollout.episodes_per_task
    ids = episode_ids(uninterrupted)
    assert len(ids) == 2 * per_step and len(set(ids)) == len(ids)
    metrics = json.loads((folder.step_dir(1) / "metrics.json").read_text())
    assert metrics["episodes/count"] == per_step
    assert metrics["policy/version"] == 2  # step 1 trained version 1 into version 2
    assert {"reward/mean", "optim/loss", "time/rollout", "episodes/terminated_ratio"} <= set(metrics)
    tracker = RunTracker.open(uninterrupted)
    assert [s for s, _ in tracker.metric_history("episodes/count")] == [0, 1]
    assert [s for s, _ in tracker.metric_history("val/reward/mean")] == [0, 2]
    assert (uninterrupted / "reward_curve.png").stat().st_size > 0
    transcripts = (folder.step_dir(2, "validation") / "transcripts.txt").read_text()
    assert "validation/2/0/0" in transcripts and "validation/2/1/0" in transcripts


def test_rerunning_a_finished_run_changes_nothing(uninterrupted: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in uninterrupted.rglob("*.parquet")}
    assert train_flow(run_dir=str(uninterrupted)) == str(uninterrupted)
    after = {p: p.stat().st_mtime_ns for p in uninterrupted.rglob("*.parquet")}
    assert before == after
    tracker = RunTracker.open(uninterrupted)
    assert [s for s, _ in tracker.metric_history("optim/loss")] == [0, 1]


def test_the_readmes_sql_recipes_run_on_a_real_run_and_per_step_ones_count_training_only(uninterrupted: Path) -> None:
    """Every ``rollflow sql $RUN "..."`` line of the README, on a real 2-step run's views.
    Newcomer F8: before, the tool-calls recipe grouped train and validation episodes by
    step (step 0 counted both, and a "step 2" row was validation alone)."""
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    recipes = re.findall(r'rollflow sql \$RUN "([^"]+)"', readme)
    assert len(recipes) >= 5, recipes
    con = open_run_sql([uninterrupted])
    for sql in recipes:
        columns, rows = run_query(con, sql)
        assert rows, f"no rows: {sql}"
        if columns[:1] == ["step"] and "FROM episodes" in sql:
            assert sorted({row[0] for row in rows}) == [0, 1], f"train steps only: {sql}"


def test_a_resume_left_with_only_the_last_validation_opens_the_run_cluster_and_its_replica_placement(
    uninterrupted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review F10: before, that pass opened the generator without ``run_cluster`` or
    ``host=replica_host``: a run whose replicas are placed on cluster nodes started a local
    server on the driver for it. Spies call the real ones (no cluster here: mode "none")."""
    import shutil
    from contextlib import contextmanager

    import rollflow.flows.train as train
    from rollflow.cluster.ray_replicas import replica_host
    from rollflow.storage.stage_outputs import finished_output

    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    validation = RunFolder(run_dir).step_paths(2, "validation")
    shutil.rmtree(validation.metrics_json.parent)  # the last validation, all of it
    opened: list[tuple[str, object]] = []
    real_cluster, real_generator = train.run_cluster, train.open_generator

    @contextmanager
    def cluster_spy(config: object):  # noqa: ANN202 - the real one's
        with real_cluster(config) as cluster:  # type: ignore[arg-type]
            opened.append(("cluster", config))
            yield cluster
        opened.append(("cluster closed", config))

    def generator_spy(config: object, folder: object, **kwargs: object):  # noqa: ANN202 - the real one's
        opened.append(("generator", kwargs))
        return real_generator(config, folder, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(train, "run_cluster", cluster_spy)
    monkeypatch.setattr(train, "open_generator", generator_spy)
    handle = open_run(None, str(run_dir))
    try:
        assert handle.next_step() == 2
        train.run_training(handle)
    finally:
        handle.close()
    config = handle.config
    placed = {"versions_in_flight": 1, "host": replica_host(config)}
    assert opened == [("cluster", config), ("generator", placed), ("cluster closed", config)]
    assert finished_output(validation.metrics_json) is not None


def stage_step(args: tuple) -> int:
    """The step a stage call works on: its ``step`` argument or paths, else its output path's step."""
    steps = [a.step if isinstance(a, StepPaths) else a for a in args
             if isinstance(a, StepPaths) or (isinstance(a, int) and not isinstance(a, bool))]
    return steps[0] if steps else locate_output(args[-1]).step


def crash_at_step_one(monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    real: Callable[..., Path] = getattr(step_module, stage)

    def crashing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if stage_step(args) == 1:
            raise InjectedCrash(f"{stage} died at step 1")
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, stage, crashing)


@pytest.mark.parametrize(
    "stage",
    [pytest.param(s, marks=() if s == "train_stage" else pytest.mark.slow) for s in STAGES],
)
def test_a_crash_in_any_stage_resumes_to_the_same_run(
    stage: str, tiny_config_path: Path, tmp_path: Path, uninterrupted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "crashed"
    with monkeypatch.context() as patch:
        crash_at_step_one(patch, stage)
        with pytest.raises(InjectedCrash):
            train_flow(config_path=str(tiny_config_path), run_dir=str(run_dir))
    assert not (RunFolder(run_dir).step_dir(1) / "metrics.json").exists()  # step 1 unfinished
    train_flow(run_dir=str(run_dir))
    assert episode_ids(run_dir) == episode_ids(uninterrupted)
    resumed, reference = final_adapter(run_dir), final_adapter(uninterrupted)
    assert resumed["step"] == reference["step"] == 1
    assert resumed["weights"].keys() == reference["weights"].keys()
    for name, tensor in reference["weights"].items():
        assert resumed["weights"][name].equal(tensor), f"{name} differs after resume"
    tracker = RunTracker.open(run_dir)
    assert [s for s, _ in tracker.metric_history("optim/loss")] == [0, 1]


@pytest.mark.slow  # 11 s in a loaded suite run (docs/testing.md)
def test_a_failed_run_names_the_resume_command_and_the_resume_says_where_it_continues(
    tiny_config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "crashed"
    with monkeypatch.context() as patch:
        crash_at_step_one(patch, "train_stage")
        with pytest.raises(InjectedCrash):
            main(["train", str(tiny_config_path), "--run-dir", str(run_dir)])
    assert f"continue with `rollflow resume {run_dir}`" in capsys.readouterr().err
    # `rollflow runs` says it failed, and why (before: "in progress or failed", no notes)
    failed = run_status(run_dir)
    assert failed.describe() == "failed at step 1 of 2, stage train", failed.describe()
    assert failed.end_note == "InjectedCrash: train_stage died at step 1"
    assert main(["resume", str(run_dir)]) == 0
    assert run_status(run_dir).end is None, "the resume that finished it forgot the failure"
    err = capsys.readouterr().err
    assert ("found 1 of 2 steps trained, the checkpoint of step 0; continuing at step 1 from its "
            "train stage (episodes, scores, samples kept)") in err, err
    assert "rollflow resume" not in err  # it finished: no hint
    # and it ends saying what validation found (first vs last pass, paired) and where the curve is
    assert "validation pass rate " in err and " at step 0 -> " in err and " at step 2: " in err, err
    assert f"the curve: rollflow sql {run_dir} \"{CURVE_SQL}\"" in err, err
    columns, rows = run_query(open_run_sql(run_dir), CURVE_SQL)  # the printed query runs
    assert columns == ["step", "pass_rate", "episodes"] and [row[0] for row in rows] == [0, 2]
    # resumed again, finished: said so, without starting Prefect (before: "only validation
    # not yet written is left", then a flow run for nothing)
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["resume", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert "complete: its 2 steps and their last validation are written; nothing to do" in err, err
    assert "only validation not yet written is left" not in err
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_a_stop_request_mid_rollout_records_no_episode_and_the_rollout_replays(
    tiny_config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM's flag, raised mid-decoding: no episode is recorded as failed, nothing is written."""
    import rollflow.policy.generation as generation
    from rollflow.policy.stopping import StopRequested, clear_stop, request_stop
    from rollflow.generators.policy_io import acting_policy
    from rollflow.generators.run_generator import open_generator
    from rollflow.tasks.rollout import rollout_stage

    handle = open_run(tiny_config_path, tmp_path / "run")
    out = handle.folder.step_paths(0).episodes
    draws = 0
    real_draw = generation.draw_tokens

    def draw_then_stop(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        nonlocal draws
        draws += 1
        if draws == 5:
            request_stop()
        return real_draw(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(generation, "draw_tokens", draw_then_stop)
        with pytest.raises(StopRequested), open_generator(handle.config, handle.folder, versions_in_flight=1) as generator:
            rollout_stage(handle.config, out, 0, "train", acting_policy(handle.config, generator, None))
    assert draws == 5
    assert handle.folder.part_paths(0, "episodes", "train") == []
    assert not handle.folder.is_complete(0, "episodes", "train")
    clear_stop()
    with open_generator(handle.config, handle.folder, versions_in_flight=1) as generator:
        rollout_stage(handle.config, out, 0, "train", acting_policy(handle.config, generator, None))
    episodes = table_to_episode_records(handle.folder.read_stage(0, "episodes"))
    assert len(episodes) == 4 and all(e.rollout.error is None for e in episodes)


def test_a_half_written_file_is_discarded_on_resume(tiny_config_path: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    handle = open_run(tiny_config_path, run_dir)
    leftover = handle.folder.step_dir(0) / ".scores.parquet.tmp-1234"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"PAR1 half a file")
    open_run(None, run_dir)
    assert not leftover.exists()


def test_resume_needs_a_run_folder(tmp_path: Path) -> None:
    with pytest.raises(RunSetupError, match="not a run folder"):
        open_run(None, tmp_path)


def test_a_changed_config_cannot_reuse_a_run_folder(tiny_config_path: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    open_run(tiny_config_path, run_dir)
    tiny_config_path.write_text(tiny_config_path.read_text().replace("num_steps = 2", "num_steps = 3"))
    with pytest.raises(ConfigMismatchError, match=r"frozen and differs .* in train\.num_steps \(2 frozen, 3 given\)"):
        open_run(tiny_config_path, run_dir)


def test_a_setting_added_since_the_folder_was_made_is_no_mismatch(
    tiny_config_path: Path, tmp_path: Path
) -> None:
    # A folder frozen by an older rollflow lacks keys added since; they take their
    # defaults, so the same config file still opens it (scripts/learn.sh relies on this).
    run_dir = tmp_path / "run"
    open_run(tiny_config_path, run_dir)
    frozen = run_dir / "config.toml"
    lines = [line for line in frozen.read_text().splitlines() if not line.startswith("minibatches")]
    frozen.write_text("\n".join(lines) + "\n")
    assert open_run(tiny_config_path, run_dir).config.train.minibatches == 1
    frozen.write_text(frozen.read_text().replace("[train]\n", "[train]\nretired_setting = 1\n"))
    with pytest.raises(ConfigMismatchError, match=r"does not read with this rollflow .*retired_setting"):
        open_run(tiny_config_path, run_dir)


def test_async_collection_is_refused_with_a_clear_message(tiny_config_path: Path, tmp_path: Path) -> None:
    text = tiny_config_path.read_text().replace("[rollout]\n", "[rollout]\nmax_steps_off_policy = 1\n")
    tiny_config_path.write_text(text)
    with pytest.raises(ConfigError, match="max_steps_off_policy"):
        open_run(tiny_config_path, tmp_path / "run")


def start_train_process(
    config_path: Path, run_dir: Path, stderr: Path, prefect_url: str | None = None
) -> subprocess.Popen[str]:
    """A real `rollflow train` in its own process group, with the Prefect temporary server it
    starts, or its flows on ``prefect_url`` (the ``shared_prefect_url`` fixture).

    Its stderr goes to a file: a pipe nobody reads while the run goes on could fill and stall it.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("PREFECT_API_URL", None)
    if prefect_url is not None:
        env["PREFECT_API_URL"] = prefect_url
    with stderr.open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "rollflow.flows.cli", "train", str(config_path), "--run-dir", str(run_dir)],
            env=env, stdout=subprocess.DEVNULL, stderr=log, text=True, start_new_session=True,
        )


def wait_for(child: subprocess.Popen[str], path: Path) -> None:
    deadline = time.monotonic() + 300
    while not path.exists():
        assert child.poll() is None, f"the run ended before {path} appeared"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def group_gone(pgid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def assert_resume_equals_uninterrupted(run_dir: Path, uninterrupted: Path) -> None:
    assert not (RunFolder(run_dir).step_dir(1) / "metrics.json").exists()
    train_flow(run_dir=str(run_dir))
    assert episode_ids(run_dir) == episode_ids(uninterrupted)
    resumed, reference = final_adapter(run_dir), final_adapter(uninterrupted)
    for name, tensor in reference["weights"].items():
        assert resumed["weights"][name].equal(tensor), f"{name} differs after resume"


@pytest.mark.slow
@pytest.mark.parametrize("kill_when", ["steps/step=000001/episodes", "checkpoints/step=000001"])
def test_sigkill_mid_run_then_resume_equals_the_uninterrupted_run(
    kill_when: str, tiny_config_path: Path, tmp_path: Path, uninterrupted: Path, shared_prefect_url: str
) -> None:
    """A real `rollflow train` process, SIGKILLed as soon as ``kill_when`` appears (its flows
    on the session's Prefect server: the SIGTERM test below checks the temporary one's end)."""
    run_dir = tmp_path / "killed"
    child = start_train_process(tiny_config_path, run_dir, tmp_path / "stderr.txt", shared_prefect_url)
    try:
        wait_for(child, run_dir / kill_when)
    finally:
        kill_group(child)
    assert_resume_equals_uninterrupted(run_dir, uninterrupted)


@pytest.mark.slow
def test_sigterm_stops_the_run_and_its_prefect_server_then_resume_finishes_it(
    tiny_config_path: Path, tmp_path: Path, uninterrupted: Path
) -> None:
    """`kill` (SIGTERM) on a real `rollflow train`: exit status 143, no process left behind."""
    run_dir = tmp_path / "terminated"
    stderr = tmp_path / "stderr.txt"
    child = start_train_process(tiny_config_path, run_dir, stderr)
    try:
        wait_for(child, run_dir / "checkpoints" / "step=000000")
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            kill_group(child)
    assert child.returncode == 143, stderr.read_text()[-2000:]
    assert f"continue with `rollflow resume {run_dir}`" in stderr.read_text()
    if not group_gone(child.pid, within_s=10):  # the server was told to stop; give it a moment
        ps = subprocess.run(["ps", "-o", "pid,args", "-g", str(child.pid)], capture_output=True, text=True)
        kill_group(child)
        pytest.fail(f"processes of the stopped run outlived it:\n{ps.stdout}")
    assert_resume_equals_uninterrupted(run_dir, uninterrupted)
