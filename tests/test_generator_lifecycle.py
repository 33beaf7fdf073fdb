"""One generator per run: the training flow opens it, every stage of the run samples on it,
and it is closed when the run ends, also when the run fails; a vLLM generator lent by the
caller (``lending.lend``) is used and left running.

The vLLM cases stand a recording server in for ``VLLMServer`` (tests/fake_vllm.py):
what is checked is who starts and stops it, not what it samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fake_vllm import FakePolicy, FakeServer

from rollflow.config.rollout import RolloutConfig
from rollflow.config.run import ModelConfig, RunConfig, config_to_toml, load_config
from rollflow.config.train import TrainConfig
from rollflow.generators import run_generator
from rollflow.generators import vllm_generator
from rollflow.generators.generator import LocalGenerator
from rollflow.generators.lending import lend
from rollflow.generators.run_generator import open_generator
from rollflow.generators.vllm_generator import VLLMGenerator
from rollflow.storage.runfolder import RunFolder


class CountingLocal(LocalGenerator):
    """The transformers backend's generator, counting what the run asks of it."""

    opened: list[CountingLocal] = []

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.versions: list[int] = []
        self.closed = False
        CountingLocal.opened.append(self)

    def policy_for(self, version: int, checkpoint: Path | None):  # noqa: ANN201 - LocalGenerator's
        assert not self.closed, "asked for a policy after it was closed"
        self.versions.append(version)
        return super().policy_for(version, checkpoint)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> type[CountingLocal]:
    CountingLocal.opened = []
    monkeypatch.setattr(run_generator, "LocalGenerator", CountingLocal)
    return CountingLocal


def _untracked(config_path: Path) -> str:
    config = load_config(config_path)
    config_path.write_text(config_to_toml(replace(config, tracking=replace(config.tracking, enabled=False))))
    return str(config_path)


@pytest.mark.slow  # 4 s in a loaded suite run (docs/testing.md)
def test_a_lockstep_run_samples_every_stage_on_one_generator_and_closes_it_at_the_end(
    counting: type[CountingLocal], tiny_config_path: Path, prefect_harness: object, tmp_path: Path
) -> None:
    """Two steps, validation before step 0 and after step 1: four policies, one generator."""
    from rollflow.flows.train import train_flow

    train_flow(config_path=_untracked(tiny_config_path), run_dir=str(tmp_path / "run"))
    assert len(counting.opened) == 1, "one generator for the whole run"
    (run_generator,) = counting.opened
    assert run_generator.versions == [0, 0, 1, 2]  # validation 0, step 0, step 1, validation 2
    assert run_generator.closed


def test_a_run_that_fails_mid_step_still_closes_its_generator(
    counting: type[CountingLocal], tiny_config_path: Path, prefect_harness: object, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from rollflow.flows import step as step_module
    from rollflow.flows.train import train_flow

    def broken_train(*args: object) -> Path:
        raise RuntimeError("the trainer fell over")

    monkeypatch.setattr(step_module, "train_stage", broken_train)
    with pytest.raises(RuntimeError, match="the trainer fell over"):
        train_flow(config_path=_untracked(tiny_config_path), run_dir=str(tmp_path / "run"))
    assert [g.closed for g in counting.opened] == [True]


@pytest.mark.slow  # 9 s in a loaded suite run (docs/testing.md)
def test_a_trained_run_resumed_for_nothing_opens_no_generator(
    counting: type[CountingLocal], tiny_config_path: Path, prefect_harness: object, tmp_path: Path
) -> None:
    from rollflow.flows.train import train_flow

    run_dir = train_flow(config_path=_untracked(tiny_config_path), run_dir=str(tmp_path / "run"))
    counting.opened.clear()
    train_flow(run_dir=run_dir)
    assert counting.opened == [], "everything was done: no model loaded, no server started"


# ---------------------------------------------------------------- vLLM: who stops the server


@pytest.fixture
def fake_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeServer]]:
    started: list[FakeServer] = []

    class Recording(FakeServer):
        def spawn(self) -> Recording:
            started.append(self)
            return self

    monkeypatch.setattr(vllm_generator, "VLLMServer", Recording)
    monkeypatch.setattr(vllm_generator, "managed_policy", lambda *args: FakePolicy())
    yield started


def _vllm_config(model_dir: Path, **rollout: object) -> RunConfig:
    return RunConfig(
        model=ModelConfig(path=str(model_dir)),
        rollout=RolloutConfig(backend="vllm", **rollout),  # type: ignore[arg-type]
        train=TrainConfig(lora_rank=8, lora_alpha=16.0),
    )


def test_a_vllm_generator_stops_its_server_when_its_block_ends_also_on_failure(
    fake_server: list[FakeServer], tiny_model_dir: Path
) -> None:
    config = _vllm_config(tiny_model_dir)
    with open_generator(config, None, versions_in_flight=1) as generator:
        assert isinstance(generator, VLLMGenerator) and [s.running for s in fake_server] == [True]
    assert [s.running for s in fake_server] == [False]
    with pytest.raises(RuntimeError, match="a stage fell over"):
        with open_generator(config, None, versions_in_flight=1):
            raise RuntimeError("a stage fell over")
    assert [s.running for s in fake_server] == [False, False]


def test_a_lent_generator_serves_the_runs_that_fit_it_and_only_its_owner_stops_it(
    fake_server: list[FakeServer], tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = _vllm_config(tiny_model_dir)
    folder = RunFolder(tmp_path / "run")
    with open_generator(config, None, versions_in_flight=1) as owned, lend(owned):
        with open_generator(config, folder, versions_in_flight=1) as again:
            assert again is owned and again.folder is folder, "the lent one, bound to the run's folder"
        assert owned.server is not None and owned.server.running, "a borrower leaves it running"
        other = replace(config, rollout=replace(config.rollout, max_model_length=1536))  # another server's spec
        with open_generator(other, folder, versions_in_flight=1) as own:
            assert own is not owned
        assert [s.running for s in fake_server] == [True, False]
        owned.close()
        with open_generator(config, folder, versions_in_flight=1) as fresh:
            assert fresh is not owned, "a closed generator is never handed out"
    assert [s.running for s in fake_server] == [False, False, False]


def test_starting_managed_servers_says_so_before_the_wait_and_after(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newcomer's item 12: a managed server's start (25-100 s on a CPU) printed nothing."""
    from rollflow.policy.vllm_spec import VLLMServerSpec

    servers = [FakeServer(VLLMServerSpec(str(tiny_model_dir))) for _ in range(2)]
    servers[1].startup_s = 41.5
    vllm_generator.start_together(servers)
    assert capsys.readouterr().err.splitlines() == [
        "  vLLM: starting 2 managed vLLM replicas (tens of seconds on a CPU)", "  vLLM: serving after 41.5 s"]
