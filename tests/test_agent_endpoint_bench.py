"""The agent endpoint bench: the native game and the example agent through the capture
endpoint, each leg in its own process, side by side.

The end-to-end test runs the bench's smallest size for real (the 2-layer test model, one
round): two fresh processes, each warming up and playing the same step's tasks. It checks
the output's shape and what the legs did, never a timing.
"""

from __future__ import annotations

import pytest
from repo_script import load_script

bench = load_script("bench/agent_endpoint_bench.py")


def test_rounds_alternate_which_leg_goes_first() -> None:
    assert bench.leg_order(3) == [(1, "native"), (1, "endpoint"), (2, "endpoint"), (2, "native"),
                                  (3, "native"), (3, "endpoint")]  # fmt: skip


def test_a_call_is_paired_with_its_own_episodes_handling_in_order() -> None:
    times = bench.CallTimes(
        handled=[("rf-a", 0.30, 0.25), ("rf-b", 0.50, 0.40), ("rf-a", 0.20, 0.0)],
        round_trips=[("rf-b", 0.55), ("rf-a", 0.32), ("rf-a", 0.21)],
    )
    assert bench.paired_calls(times) == [(0.55, 0.50, 0.40), (0.32, 0.30, 0.25), (0.21, 0.20, 0.0)]
    with pytest.raises(AssertionError, match="without being handled"):
        bench.paired_calls(bench.CallTimes(round_trips=[("rf-c", 0.1)]))
    with pytest.raises(AssertionError, match="1 handled calls have no round trip"):
        bench.paired_calls(bench.CallTimes(handled=[("rf-a", 0.3, 0.2)]))


def test_more_turns_than_the_example_agent_takes_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from rollflow.envs.openai_agent_example.agent import MAX_STEPS

    assert bench.AGENT_MAX_STEPS == MAX_STEPS
    with pytest.raises(SystemExit):
        bench.main(["--max-turns", "7"])
    assert "the example agent stops after 6 calls" in capsys.readouterr().err


def test_a_vllm_policys_request_counters_are_not_taken_for_engine_batches() -> None:
    """The vLLM leg died on ``stats.batches`` (its stats count requests, not batches)."""
    from types import SimpleNamespace

    from rollflow.policy.vllm_backend import VLLMStats

    assert bench.batch_counters(SimpleNamespace(stats=VLLMStats())) is None
    assert bench.batch_counters(SimpleNamespace()) is None
    engine = SimpleNamespace(batches=[], batch_sizes=[])
    assert bench.batch_counters(SimpleNamespace(stats=engine)) is engine


@pytest.mark.slow
def test_the_smallest_bench_plays_both_legs_in_their_own_processes_and_compares_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench.main(["--groups", "1", "--episodes", "2", "--max-turns", "2", "--max-tokens", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    table_rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("|")]
    rows = [cells for cells in table_rows if cells[0].strip() in ("native", "endpoint")]
    runs, summary = rows[:2], rows[2:]
    assert [(cells[0].strip(), cells[1].strip()) for cells in runs] == [("native", "1"), ("endpoint", "1")]
    actions = {}
    for cells in runs:
        wall_s, done_actions, sampled, errors = float(cells[2]), int(cells[4]), int(cells[5]), int(cells[10])
        assert wall_s > 0 and done_actions >= 2 and sampled >= done_actions and errors == 0, cells
        batches, rows = cells[9].split(";")[0].split(":")  # the transformers engine ran every action
        assert sum(int(n) for n in rows.split(",")) == done_actions and int(batches) >= 1, cells
        actions[cells[0].strip()] = done_actions
    assert [cells[0].strip() for cells in summary] == ["native", "endpoint"]
    assert all(cells[1].strip() == "1" for cells in summary)
    assert "same tasks in every run: yes" in out
    overhead = [line for line in out.splitlines() if line.startswith("endpoint over native")]
    assert len(overhead) == 2 and all(line.count("%") == 3 for line in overhead), overhead
    # every action the endpoint leg sampled went through one handled, round-tripped call
    (served,) = [cells for cells in table_rows if cells[0].strip() == "sampled, median"]
    assert int(served[1]) == actions["endpoint"]
    assert all(float(cell) >= 0 for cell in served[2:7]), served
    (server,) = [line for line in out.splitlines() if line.startswith("the endpoint's server, started and stopped")]
    assert float(server.split(": ")[1].split()[0]) > 0, server  # a real server started and stopped
