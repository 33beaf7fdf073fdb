"""What a run keeps on disk: ``generators/checkpoints.py``'s ``checkpoints_to_keep``, which
``prune_checkpoints`` asks (resume, a publication in flight, the adapters an async
generator holds). Checkpoint folders here carry only ``version.json``: what pruning reads.
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from rollflow.config.run import parse_config
from rollflow.generators import vllm_generator
from rollflow.generators.checkpoints import prune_checkpoints
from rollflow.storage.async_groups import Admission, write_admission
from rollflow.storage.runfolder import RunFolder
from fake_vllm import FakePolicy, FakeServer
from test_async_generator import _config, _random_adapter

JOIN_S = 5.0


def _commit(folder: RunFolder, step: int) -> None:
    tmp = folder.new_checkpoint_tmp(step)
    info = {"policy_version": step + 1, "step": step, "use_lora": True, "format": "adapter"}
    (tmp / "version.json").write_text(json.dumps(info))
    folder.commit_checkpoint(tmp, step)


def _steps(folder: RunFolder) -> list[int]:
    return [step for step, _ in folder.checkpoints()]


def _finish_step(folder: RunFolder, step: int) -> None:
    folder.step_dir(step).mkdir(parents=True, exist_ok=True)
    (folder.step_dir(step) / "metrics.json").write_text("{}")


def _admit(folder: RunFolder, step: int) -> None:
    write_admission(folder, Admission(step, (), (), 0.0), {})


def test_an_async_run_keeping_one_checkpoint_resumes_after_dying_between_train_and_metrics(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's B4: step 1 trained (checkpoint 1 committed, the older one pruned), then
    the run died before step 1's metrics. The resume starts at step 1, whose generator
    serves version 1: checkpoint 0."""
    from rollflow.flows.runs import RunHandle
    from rollflow.flows.train import run_async_training
    from rollflow.config.checks import check_run_config

    class ServerStarted(Exception):
        pass

    def server_started(*_: object, **__: object) -> None:
        raise ServerStarted

    config = parse_config({
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"backend": "vllm", "max_steps_off_policy": 1},
        "train": {"keep_checkpoints": 1, "num_steps": 3},
    })  # fmt: skip
    check_run_config(config)
    folder = RunFolder(tmp_path / "run")
    for step in (0, 1):  # as the async schedule does: admit, train (commit, then prune), metrics
        _admit(folder, step)
        _commit(folder, step)
        prune_checkpoints(folder, config.train.keep_checkpoints)
        if step == 0:
            _finish_step(folder, 0)
    assert _steps(folder) == [0, 1], "step 1's resume acts with checkpoint 0"
    monkeypatch.setattr(vllm_generator, "VLLMServer", server_started)
    with pytest.raises(ServerStarted):  # past the checkpoint lookup: the server is next
        run_async_training(RunHandle(config=config, folder=folder))
    _finish_step(folder, 1)
    _admit(folder, 2)
    _commit(folder, 2)
    prune_checkpoints(folder, 1)
    assert _steps(folder) == [1, 2], "once step 1 is logged, checkpoint 0 is needed no more"


def test_a_lockstep_run_keeps_just_its_newest_checkpoints(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    for step in range(3):
        _commit(folder, step)
        prune_checkpoints(folder, 1)
        assert _steps(folder) == [step], "lockstep resumes from the newest checkpoint alone"
    for step in range(3, 6):
        _commit(folder, step)
    prune_checkpoints(folder, 2)
    assert _steps(folder) == [4, 5]


def test_an_adapter_a_running_group_samples_keeps_its_checkpoint(
    fake_vllm: FakePolicy, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's B3 crash: a group started under version 1 still runs when step 2 ends
    and prunes with keep_checkpoints = 1; vLLM reads an adapter's folder again when it
    evicts and reloads it."""
    import asyncio

    from rollflow.generators import async_generator

    monkeypatch.setattr(async_generator, "fresh_adapter", lambda config, folder: tmp_path / "adapter-v0")
    folder = RunFolder(tmp_path / "run")
    config = _config(tiny_model_dir, lora=True, lora_serving="adapter")
    config = replace(config, train=replace(config.train, keep_checkpoints=1))
    with async_generator.open_async_generator(config, folder, 0) as generator:
        _commit(folder, 0)
        generator.publish(1, folder.checkpoint_dir(0))
        slow = asyncio.run(generator.start_group())
        assert slow == 1
        _commit(folder, 1)
        generator.publish(2, folder.checkpoint_dir(1))
        _commit(folder, 2)  # version 3, not yet published
        prune_checkpoints(folder, 1)
        assert _steps(folder) == [0, 1, 2], "version 1 (a running group) and 2 (new groups) are served"
        generator.finish_group(slow)
        generator.retire_unused()
        prune_checkpoints(folder, 1)
        assert _steps(folder) == [1, 2]
    assert _steps(folder) == [2], "a closed generator holds nothing, and prunes what it held"


def test_a_checkpoint_being_published_in_the_background_is_not_pruned(
    fake_vllm: FakePolicy, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rollflow.generators.async_generator import open_async_generator
    from rollflow.tasks.collect import Publisher

    config = _config(tiny_model_dir, lora=False, weight_sync_type="background_publish")
    folder = RunFolder(tmp_path / "run")
    with open_async_generator(config, folder, 0) as generator:
        publisher = Publisher(generator, deferred=True)
        _commit(folder, 0)
        fake_vllm.reload_may_finish.clear()  # the swap takes a while
        publisher.publish(1, folder.checkpoint_dir(0))
        _commit(folder, 1)  # the next step trains meanwhile, and prunes
        prune_checkpoints(folder, 1)
        assert _steps(folder) == [0, 1], "the checkpoint being reloaded into the server was deleted"
        fake_vllm.reload_may_finish.set()
        done = threading.Thread(target=publisher.join)
        done.start()
        done.join(JOIN_S)
        assert not done.is_alive()
        prune_checkpoints(folder, 1)
        assert _steps(folder) == [0, 1], "the server holds version 1's weights: a restart reloads them"
        publisher.publish(2, folder.checkpoint_dir(1))
        publisher.join()
        prune_checkpoints(folder, 1)
        assert _steps(folder) == [1]


def test_a_merged_lora_generator_keeps_only_the_served_merged_folder(
    fake_vllm: FakePolicy, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """LoRA served merged: each version is merged into the base and reloaded in place; the
    merged folder of the served version is what a restart reloads, so neither an older
    merged folder nor the served version's checkpoint is kept for it."""
    import shutil

    from rollflow.generators.async_generator import open_async_generator
    from rollflow.generators.vllm_generator import SERVING_DIR

    config = _config(tiny_model_dir, lora=True)  # lora_serving = "merged", the default
    folder = RunFolder(tmp_path / "run")
    adapter = _random_adapter(tiny_model_dir, tmp_path / "adapter")

    def commit(step: int) -> None:
        tmp = folder.new_checkpoint_tmp(step)
        for item in adapter.iterdir():
            shutil.copy2(item, tmp / item.name)
        (tmp / "version.json").write_text(json.dumps({"policy_version": step + 1, "step": step, "use_lora": True}))
        folder.commit_checkpoint(tmp, step)

    serving = folder.root / SERVING_DIR
    with open_async_generator(config, folder, 0) as generator:
        spec = FakeServer.specs[-1]
        assert not spec.enable_lora and "-untied-" in Path(spec.model_dir).name, "merged: a plain, untied server"
        for step in range(3):
            commit(step)
            generator.publish(step + 1, folder.checkpoint_dir(step))
            assert sorted(p.name for p in serving.iterdir()) == [f".policy-v{step + 1}-merged.lock", f"policy-v{step + 1}-merged"]
        commit(3)  # version 4, not yet published
        prune_checkpoints(folder, 1)
        assert _steps(folder) == [3], "version 3 is served from its merged folder, not its checkpoint"
    reloads = [c for c in fake_vllm.calls if c[0] == "reload"]
    assert [(c[1].name, c[2]) for c in reloads] == [(f"policy-v{v}-merged", v) for v in (1, 2, 3)]
    assert not [c for c in fake_vllm.calls if c[0] == "add"], "no adapter reached the server"
    assert not serving.exists(), "the merged folders outlived their generator"



@pytest.mark.slow  # 11 s in a loaded suite run (docs/testing.md)
def test_a_train_stage_run_on_a_ray_node_leaves_pruning_to_the_driver_that_knows_the_readers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The review's R1: the train stage on a Ray node runs in a fresh worker process, where
    no async generator registered what it reads, and pruned version 1 while the driver's
    generator still served it. Here the remote body runs in another Python process (the
    node's part of ``cluster/ray_trainer.py``, without Ray's scheduling), and the driver prunes."""
    import pickle
    import subprocess
    import sys

    from rollflow.generators.checkpoints import reading_versions
    from test_train import tiny_config, train_step, write_samples

    config = tiny_config(tiny_model_dir, keep_checkpoints=1)
    run = tmp_path / "run"
    folder = RunFolder(run)
    write_samples(run, 0)
    train_step(config, run, 0)  # checkpoint 0: version 1, which the driver's generator serves
    write_samples(run, 1)
    p = folder.step_paths(1)
    args = {"config": config, "samples": str(p.samples), "teacher": None, "previous": str(folder.checkpoint_dir(0)),
            "out_checkpoint": str(p.checkpoint), "out_result": str(p.train_json), "step": 1}  # fmt: skip
    (tmp_path / "args.pkl").write_bytes(pickle.dumps(args))
    node = (
        "import pickle, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import rollflow.cluster.ray_rollout as ray_rollout\n"
        "ray_rollout.this_node = lambda: 'worker-1'  # no Ray here: the node's name\n"
        "from rollflow.cluster.ray_trainer import train_on_node\n"
        f"train_on_node.fn(**pickle.loads(open({str(tmp_path / 'args.pkl')!r}, 'rb').read()))\n"
    )
    with reading_versions(folder, lambda: {1}):
        done = subprocess.run([sys.executable, "-c", node], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert folder.read_train_result(1).node == "worker-1"
        assert _steps(folder) == [0, 1], "the node pruned a checkpoint the driver's generator reads"
        prune_checkpoints(folder, config.train.keep_checkpoints)  # what RayTrainer.train does after
        assert _steps(folder) == [0, 1], "the driver spares what its generator reads"
    prune_checkpoints(folder, config.train.keep_checkpoints)
    assert _steps(folder) == [1]
