"""Async off-policy training (``tasks/collect.py``): the rules, admission, and real runs.

The config rules and the admission arithmetic need no server. The runs use a real managed
vLLM server on a tiny random Llama (2 heads of 32, as in test_vllm_backend.py) and the
real flow under Prefect's test harness; each run starts (and stops) its own server.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.config.checks import check_async, check_run_config
from rollflow.config.parsing import ConfigError
from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import ModelConfig, RunConfig, TrackingConfig, ValidationConfig, config_to_toml, parse_config
from rollflow.config.train import TrainConfig
from rollflow.storage.async_groups import GroupStamp, consumed_groups, finished_groups, read_admission
from rollflow.storage.query import open_run_sql, run_query
from rollflow.storage.runfolder import RunFolder
from rollflow.storage.schemas import table_to_episode_records
from rollflow.tasks.collect import RolloutWorkers
from tiny_run import build_vllm_tiny_model

TESTS = Path(__file__).parent


# ---------------------------------------------------------------- the rules (no server)


def _parsed(rollout: dict[str, object], train: dict[str, object] | None = None) -> RunConfig:
    return parse_config({"rollout": {"backend": "vllm", **rollout}, "train": train or {}})


def test_lockstep_is_the_default_and_keeps_synchronous_publication() -> None:
    config = parse_config({})
    assert config.rollout.max_steps_off_policy is None and config.rollout.weight_sync_type == "synchronous"
    check_async(config)


@pytest.mark.parametrize("mode", ["background_publish", "pipeline"])
def test_the_deferred_modes_need_async(mode: str) -> None:
    with pytest.raises(ConfigError, match=f"weight_sync_type = '{mode}'.*max_steps_off_policy"):
        check_async(_parsed({"weight_sync_type": mode}, {"use_lora": False}))


def test_pipeline_needs_weights_swapped_in_place() -> None:
    pipeline = {"max_steps_off_policy": 1, "weight_sync_type": "pipeline"}
    with pytest.raises(ConfigError, match=r"'pipeline' needs weights swapped in place: full-weight training"):
        check_async(_parsed({**pipeline, "lora_serving": "adapter"}))
    with pytest.raises(ConfigError, match=r"'pipeline' needs weights swapped in place"):
        check_async(_parsed({**pipeline, "base_urls": ["http://127.0.0.1:8000/v1"]}))
    check_async(_parsed(pipeline, {"use_lora": False}))
    check_async(_parsed(pipeline))  # LoRA merged into the base: swapped in place like full weights


def test_any_publication_mode_may_keep_one_checkpoint() -> None:
    """Pruning spares a checkpoint being published (tests/test_checkpoint_retention.py)."""
    for mode in ("synchronous", "background_publish"):
        check_async(_parsed({"max_steps_off_policy": 1, "weight_sync_type": mode}, {"keep_checkpoints": 1}))


def test_async_needs_the_vllm_generator() -> None:
    config = parse_config({"rollout": {"max_steps_off_policy": 1}})
    with pytest.raises(ConfigError, match="needs \\[rollout\\]\\.backend = 'vllm'"):
        check_run_config(config)


def test_an_unknown_sync_type_and_a_negative_limit_are_refused() -> None:
    with pytest.raises(ConfigError, match="weight_sync_type"):
        _parsed({"weight_sync_type": "eventually"})
    with pytest.raises(ConfigError, match="max_steps_off_policy"):
        _parsed({"max_steps_off_policy": -1})
    with pytest.raises(ConfigError, match="groups_in_flight"):
        _parsed({"max_steps_off_policy": 1, "groups_in_flight": 0})


def test_the_reference_api_takes_the_sync_type_in_either_spelling() -> None:
    from rollflow.config.grpo import GRPOConfig

    for spelling in ("WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH", "background_publish"):
        config = GRPOConfig(max_turns=2, max_steps_off_policy=1, weight_sync_type=spelling).to_run_config()
        assert config.rollout.weight_sync_type == "background_publish"


def test_the_reference_api_sets_the_off_policy_correction() -> None:
    from rollflow.config.grpo import GRPOConfig

    config = GRPOConfig(max_turns=2, max_steps_off_policy=1, off_policy_correction="mask",
                        off_policy_cap=3.0).to_run_config()
    assert (config.off_policy_correction, config.train.off_policy_cap) == ("mask", 3.0)
    assert GRPOConfig(max_turns=2, max_steps_off_policy=1).to_run_config().off_policy_correction == "tis"
    with pytest.raises(ConfigError, match="off_policy_correction"):
        GRPOConfig(max_turns=2, off_policy_correction="clip").to_run_config()  # type: ignore[arg-type]


def test_groups_in_flight_defaults_to_batch_size() -> None:
    config = _parsed({"max_steps_off_policy": 1, "batch_size": 3})
    assert config.groups_in_flight == 3
    assert _parsed({"max_steps_off_policy": 1, "groups_in_flight": 5}).groups_in_flight == 5


def test_async_turns_on_the_truncated_importance_correction_by_default() -> None:
    assert _parsed({"max_steps_off_policy": 1}).off_policy_correction == "tis"
    assert parse_config({}).off_policy_correction == "none"  # lockstep's loss is unchanged


# ---------------------------------------------------------------- admission (no server)


def _workers(tmp_path: Path, limit: int, batch: int, control: bool = True) -> RolloutWorkers:
    config = RunConfig(
        env=replace(RunConfig().env, name="varied_reward_env:load_environment"),
        rollout=RolloutConfig(
            backend="vllm", batch_size=batch, episodes_per_task=2, max_turns=2,
            max_steps_off_policy=limit, admission_control=control,
        ),  # fmt: skip
    )
    sys.path.insert(0, str(TESTS))
    folder = RunFolder(tmp_path / "run")
    folder.root.mkdir(parents=True, exist_ok=True)
    return RolloutWorkers(config, folder, generator=None, first_step=0)  # type: ignore[arg-type]


def _finish(workers: RolloutWorkers, index: int, version: int) -> None:
    stamp = GroupStamp(index, f"t{index}", version, version, 0.0, 1.0)
    workers.buffer.finished[index] = stamp
    workers.stamps[index] = stamp


def test_stale_groups_are_dropped_and_counted_when_the_trainer_would_take_them(tmp_path: Path) -> None:
    workers = _workers(tmp_path, limit=1, batch=2)
    for index, version in enumerate([0, 0, 1, 2, 2]):
        _finish(workers, index, version)
    admission = workers.take(step=2)  # ages 2, 2, 1, 0, 0: the two of version 0 are stale
    assert admission.dropped == (0, 1)
    assert admission.admitted == (2, 3)  # oldest admissible first: version 1, then 2
    assert set(workers.buffer.finished) == {4}  # kept for the next step


def test_zero_admits_only_groups_started_under_the_current_policy(tmp_path: Path) -> None:
    workers = _workers(tmp_path, limit=0, batch=2)
    for index, version in enumerate([2, 3, 3]):
        _finish(workers, index, version)
    admission = workers.take(step=3)
    assert admission.admitted == (1, 2) and admission.dropped == (0,)


def _take_in_a_thread(workers: RolloutWorkers, step: int) -> tuple[list[object], threading.Thread]:
    """``workers.take(step)`` on a thread, given 0.3 s to return; what it took, once it has."""
    taken: list[object] = []
    thread = threading.Thread(target=lambda: taken.append(workers.take(step=step)))
    thread.start()
    time.sleep(0.3)
    return taken, thread


def test_the_trainer_waits_for_a_full_batch_of_admissible_groups(tmp_path: Path) -> None:
    workers = _workers(tmp_path, limit=1, batch=2)
    _finish(workers, 0, 0)
    taken, thread = _take_in_a_thread(workers, step=0)
    assert not taken, "one group is not a batch"
    with workers.lock:
        _finish(workers, 1, 0)
        workers.lock.notify_all()
    thread.join(timeout=5)
    assert taken and taken[0].admitted == (0, 1)  # type: ignore[attr-defined]


def test_a_group_still_playing_that_this_step_must_take_is_not_passed_over(tmp_path: Path) -> None:
    """Group 0 (version 0) still plays when step 1 takes its batch: at step 2 it would be
    stale. Group 3 (version 0) and group 4 (version 1) have finished. Taking 3 and 4 left
    group 0 to be dropped at step 2 (the killed-run test below, in a suite run); the
    trainer waits for it instead, and group 4 waits for step 2, where it is one step old."""
    workers = _workers(tmp_path, limit=1, batch=2)
    workers.buffer.running[0] = 0
    _finish(workers, 3, 0)
    _finish(workers, 4, 1)
    taken, thread = _take_in_a_thread(workers, step=1)
    assert not taken, "group 4 took the place of a group that would go stale"
    with workers.lock:
        del workers.buffer.running[0]
        _finish(workers, 0, 0)
        workers.lock.notify_all()
    thread.join(timeout=5)
    assert taken and taken[0].admitted == (0, 3) and taken[0].dropped == ()  # type: ignore[attr-defined]
    assert set(workers.buffer.finished) == {4}
    # A group that is already stale, or not due until a later step, holds nothing up.
    workers.buffer.running.update({7: 0, 8: 2})
    _finish(workers, 5, 2)
    assert workers.take(step=2).admitted == (4, 5)


def test_admission_control_holds_back_a_group_that_would_be_stale(tmp_path: Path) -> None:
    class Published:
        version = 0

    workers = _workers(tmp_path, limit=1, batch=2)
    workers.generator = Published()  # type: ignore[assignment]
    # 4 groups ahead (started or finished) fill steps 0 and 1; a fifth would be taken at
    # step 2 with version 0: two steps old, above the limit.
    workers.buffer.running = dict.fromkeys(range(4), 0)
    assert not workers._may_start()
    workers.buffer.running = dict.fromkeys(range(3), 0)
    assert workers._may_start()  # taken at step 1: one step old
    # Finished groups already too old for the trainer's step are not work ahead of a new
    # group (they will be dropped): counting them would hold the workers back for good.
    Published.version = 5
    workers.buffer.trainer_step, workers.buffer.running = 5, {}
    for index in range(6):
        _finish(workers, index, 1)
    assert workers._may_start()
    off = _workers(tmp_path, limit=1, batch=2, control=False)
    off.buffer.running = dict.fromkeys(range(40), 0)
    assert off._may_start()  # the reference's behaviour: start freely, drop later


def test_a_resumed_step_that_already_chose_its_groups_counts_the_buffer_for_the_next_step(tmp_path: Path) -> None:
    """The state a kill mid-step leaves: step 1 admitted groups 2 and 3, groups 4 and 5
    wait on disk for step 2, version 1 is published. A new group is then taken at step 3
    at the earliest, two steps after version 1: admission control must hold it back.
    (It started it, counting the buffer from step 1, and step 3 dropped it as stale: seen
    in the killed-run test below.)"""
    from rollflow.storage.async_groups import Admission, write_admission, write_group

    class Published:
        version = 1

    config = _workers(tmp_path, limit=1, batch=2).config
    folder = RunFolder(tmp_path / "run")
    stamps = {i: GroupStamp(i, f"t{i}", i // 4, i // 4, 0.0, 1.0) for i in range(6)}  # 0-3 at v0, 4-5 at v1
    for stamp in stamps.values():
        write_group(folder, stamp, [])
    for step, admitted in ((0, (0, 1)), (1, (2, 3))):
        write_admission(folder, Admission(step, admitted, (), 0.0), stamps)
    resumed = RolloutWorkers(config, folder, generator=Published(), first_step=1)  # type: ignore[arg-type]
    assert set(resumed.buffer.finished) == {4, 5}
    assert not resumed._may_start(), "a group started now would be stale when step 3 takes it"
    Published.version = 2  # step 1 trained and published: the group would be one step old
    assert resumed._may_start()


# ---------------------------------------------------------------- real runs (vLLM server)


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_tiny_model(tmp_path_factory.mktemp("async-tiny"))


def async_config(model_dir: Path, tmp_path: Path, **rollout: object) -> RunConfig:
    train = rollout.pop("train", {})
    assert isinstance(train, dict)
    return RunConfig(
        model=ModelConfig(path=str(model_dir)),
        env=replace(RunConfig().env, name="varied_reward_env:load_environment"),
        rollout=RolloutConfig(
            backend="vllm", batch_size=2, episodes_per_task=2, max_turns=2, concurrency=4,
            max_model_length=1024, max_completion_tokens=12, vllm_kvcache_space_gib=1,
            generation_timeout_s=120.0, max_steps_off_policy=1, **rollout,  # type: ignore[arg-type]
        ),  # fmt: skip
        train=TrainConfig(**{"num_steps": 3, "learning_rate": 1e-2, "lora_rank": 8, "lora_alpha": 16.0, **train}),
        validation=ValidationConfig(validation_interval=0),
        tracking=TrackingConfig(enabled=False),
    )


def _write(config: RunConfig, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(config_to_toml(replace(config, storage=replace(config.storage, runs_dir=str(tmp_path / "runs")))))
    return path


def _hf_logprobs(model: torch.nn.Module, context: list[int], tokens: tuple[int, ...]) -> list[float]:
    ids = torch.tensor([context + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _assert_sampled_by(model: torch.nn.Module, records: list, tolerance: float = 1e-4) -> None:
    for record in records:
        context: list[int] = []
        for action in record.rollout.actions:
            context += action.prompt_delta_ids
            expected = _hf_logprobs(model, context, action.token_ids)
            worst = max(abs(a - b) for a, b in zip(action.logprobs, expected, strict=True))
            assert worst < tolerance, f"{record.episode_id} (v{record.rollout.policy_version}): off by {worst:.2e}"
            context += action.token_ids


def _version_model(model_dir: Path, folder: RunFolder, version: int) -> torch.nn.Module:
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    adapter = folder.root / "async" / "policy-v0" if version == 0 else folder.checkpoint_dir(version - 1)
    return PeftModel.from_pretrained(base, str(adapter)).eval()


def _trained_groups(folder: RunFolder, steps: int) -> list[int]:
    trained: list[int] = []
    for step in range(steps):
        admission = read_admission(folder, step)
        assert admission is not None, f"step {step} has no admission.json"
        trained.extend(admission.admitted)
    return trained


def _vllm_servers_of(model_dir: Path) -> list[int]:
    """PIDs of vLLM API servers started on ``model_dir`` (a SIGKILLed run leaves its own)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"vllm.entrypoints.openai.api_server" in args and str(model_dir).encode() in args:
            found.append(int(proc.name))
    return found


@pytest.mark.slow
def test_a_killed_async_lora_run_resumed_trains_every_group_once_stamped_with_the_version_that_sampled_it(
    vllm_model_dir: Path, shared_prefect_url: str, tmp_path: Path
) -> None:
    """SIGKILL a real `rollflow train` (async, LoRA, background publication) once step 0 is
    trained and groups wait in the buffer; its server too (it is in a session of its own).
    Resume in-process: no group trained twice, none finished lost, every episode's tokens
    scored by hand under the version its stamp names."""
    from rollflow.flows.train import train_flow
    from rollflow.tasks.schedule import select_train_tasks
    from test_flow_train import kill_group, start_train_process

    sys.path.insert(0, str(TESTS))
    config = async_config(
        vllm_model_dir, tmp_path, groups_in_flight=4, weight_sync_type="background_publish",
        lora_serving="adapter",  # it reads each version's adapter (async/policy-vN) back for the mismatch check
        train={"num_steps": 4, "keep_checkpoints": 10},
    )  # fmt: skip
    run_dir = tmp_path / "run"
    folder = RunFolder(run_dir)

    def buffered() -> set[int]:
        """Finished groups no step has taken yet, once step 0 is trained."""
        if not (folder.step_dir(0) / "metrics.json").exists():
            return set()
        return set(finished_groups(folder)) - consumed_groups(folder)

    child = start_train_process(_write(config, tmp_path, "killed"), run_dir, tmp_path / "stderr.txt", shared_prefect_url)
    try:
        # The generator and the admissions are threads of the trainer: with its process group
        # stopped the folder cannot change, so the state checked is the state the kill leaves
        # (a plain poll-then-kill lost the race in CI: the next step admitted the buffered
        # groups between the check and the kill).
        deadline = time.monotonic() + 600
        while True:
            assert child.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached step 1 with groups buffered"
            if buffered():
                os.killpg(child.pid, signal.SIGSTOP)
                if buffered():
                    break
                os.killpg(child.pid, signal.SIGCONT)
            time.sleep(0.05)
    finally:
        kill_group(child)
        for pid in _vllm_servers_of(vllm_model_dir):
            os.killpg(pid, signal.SIGKILL)
    before_stamps = finished_groups(folder)
    before_taken = consumed_groups(folder)
    waiting = set(before_stamps) - before_taken
    assert waiting, "the kill should leave finished groups no step had taken yet"

    train_flow(run_dir=str(run_dir))

    trained = _trained_groups(folder, 4)
    assert len(trained) == len(set(trained)) == 8, f"a group was trained twice: {trained}"
    dropped = [i for s in range(4) for i in read_admission(folder, s).dropped]  # type: ignore[union-attr]
    taken_after = consumed_groups(folder)
    assert waiting <= taken_after, f"finished groups lost across the kill: {sorted(waiting - taken_after)}"
    assert not set(dropped) & set(trained)
    stamps = finished_groups(folder)
    items = __import__("rollflow.envs.runner", fromlist=["load_environment_handle"]).load_environment_handle(
        config.env.name, config.env.kwargs
    ).tasks("train")
    for index in trained:  # the data position: group n played the run's n-th training task
        assert stamps[index].task_id == select_train_tasks(items, index, 1, config.train.seed)[0].task_id
    versions_seen = set()
    for step in range(4):
        episodes = table_to_episode_records(folder.read_stage(step, "episodes"))
        assert len(episodes) == 4 and len({e.episode_id for e in episodes}) == 4
        assert {e.rollout.error for e in episodes} == {None}
        for record in episodes:
            assert 0 <= step - record.rollout.policy_version <= 1, "never older than max_steps_off_policy"
            versions_seen.add(record.rollout.policy_version)
        metrics = json.loads((folder.step_dir(step) / "metrics.json").read_text())
        assert {"async/train_wait_s", "async/staleness_mean", "async/staleness_max"} <= set(metrics)
        assert metrics["async/dropped_stale_groups"] == 0, "admission control started nothing that went stale"
        if step == 0:  # version 0's served adapter is the trainer's own start: no mismatch
            assert metrics["policy/mismatch_kl"] < 1e-6
    # The stamps are the truth: each episode's logprobs are its start version's, by hand,
    # across the kill, the background publication and the resume.
    for version in sorted(versions_seen):
        model = _version_model(vllm_model_dir, folder, version)
        records = [
            r for step in range(4) for r in table_to_episode_records(folder.read_stage(step, "episodes"))
            if r.rollout.policy_version == version
        ]  # fmt: skip
        _assert_sampled_by(model, records)
    con = open_run_sql([run_dir])
    try:
        _, rows = run_query(con, "SELECT step, max(staleness), any_value(train_wait_s) FROM admissions "
                                 "WHERE admitted GROUP BY step ORDER BY step")  # fmt: skip
        assert [r[0] for r in rows] == [0, 1, 2, 3] and all(r[1] <= 1 and r[2] >= 0 for r in rows)
        _, rows = run_query(con, "SELECT max(step - policy_version) FROM episodes WHERE split = 'train'")
        assert rows[0][0] <= 1
    finally:
        con.close()


@pytest.mark.slow
def test_a_pipeline_run_swaps_full_weights_in_place_and_in_flight_groups_finish_under_them(
    vllm_model_dir: Path, prefect_harness: object, tmp_path: Path
) -> None:
    """Full weights, ``pipeline``: each new version is reloaded into the running server
    (no restart) while groups are in flight; a group sampled by one version from start to
    finish has exactly that checkpoint's logprobs (so the prefix cache was reset: a cached
    prefix would carry the old weights' keys)."""
    from rollflow.flows.train import train_flow

    sys.path.insert(0, str(TESTS))
    config = async_config(
        vllm_model_dir, tmp_path, groups_in_flight=4, weight_sync_type="pipeline",
        train={"use_lora": False, "learning_rate": 1e-3, "keep_checkpoints": 10},
    )  # fmt: skip
    run_dir = Path(train_flow(config_path=str(_write(config, tmp_path, "pipeline")), run_dir=str(tmp_path / "run")))
    folder = RunFolder(run_dir)
    log = (run_dir / "logs" / "vllm-server.log").read_text()
    assert log.count("Application startup complete") == 1, "the weights moved without a restart"
    collector = json.loads((run_dir / "async" / "collector.json").read_text())["processes"][0]
    assert len(collector["publish_s"]) == 3, "versions 1, 2, 3 were published"
    stamps = finished_groups(folder)
    by_version: dict[int, list] = {}
    for step in range(3):
        admission = read_admission(folder, step)
        assert admission is not None and len(admission.admitted) == 2
        episodes = table_to_episode_records(folder.read_stage(step, "episodes"))
        assert len(episodes) == 4 and {e.rollout.error for e in episodes} == {None}
        for k, index in enumerate(admission.admitted):
            stamp = stamps[index]
            assert stamp.start_version <= stamp.finish_version <= step + 1
            if stamp.start_version == stamp.finish_version:
                group = [e for e in episodes if e.group_id == f"train/{step}/{k}"]
                by_version.setdefault(stamp.start_version, []).extend(group)
    assert by_version, "no group ran under a single version"
    for version, records in sorted(by_version.items()):
        source = vllm_model_dir if version == 0 else folder.checkpoint_dir(version - 1)
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
        _assert_sampled_by(model, records)


@pytest.mark.slow
def test_an_async_lora_run_keeping_one_checkpoint_loads_each_adapter_once_and_never_prunes_one_in_use(
    vllm_model_dir: Path, prefect_harness: object, tmp_path: Path
) -> None:
    """The review's B3 end to end: synchronous publication with keep_checkpoints = 1 while
    groups run under the version each step's pruning would have deleted (admission control
    starts groups under version s while step s trains). Each adapter is loaded once, not in
    place, under the run's own name; no episode errors; only the newest checkpoint is left."""
    import re

    from rollflow.flows.train import train_flow
    from rollflow.generators.generator import run_adapter_prefix
    from rollflow.policy.vllm_backend import adapter_name

    sys.path.insert(0, str(TESTS))
    config = async_config(
        vllm_model_dir, tmp_path, groups_in_flight=4, lora_serving="adapter", train={"num_steps": 3, "keep_checkpoints": 1}
    )  # its point is vLLM's adapter loading: served as adapters, not merged
    run_dir = Path(train_flow(config_path=str(_write(config, tmp_path, "keep-one")), run_dir=str(tmp_path / "run")))
    folder = RunFolder(run_dir)
    for step in range(3):
        episodes = table_to_episode_records(folder.read_stage(step, "episodes"))
        assert len(episodes) == 4 and {e.rollout.error for e in episodes} == {None}
    assert [step for step, _ in folder.checkpoints()] == [2]
    log = (run_dir / "logs" / "vllm-server.log").read_text()
    loaded = re.findall(r"Loaded new LoRA adapter: name '([^']+)'", log)
    assert loaded == [adapter_name(run_adapter_prefix(folder), v) for v in range(4)], loaded
    assert "Reloaded LoRA adapter" not in log, "an adapter was loaded again"
