"""The rollout bench: legs in processes of their own, interleaved, summarised per leg.

The end-to-end test runs the bench's smallest mode for real (a 2-layer model, the
transformers engine with and without KV reuse, two rounds): four fresh processes, each
warming up and playing the same step.
"""

from __future__ import annotations

import pytest
from repo_script import load_script

bench = load_script("bench/rollout_bench.py")


def test_every_leg_of_the_bench_names_settings_this_config_has() -> None:
    assert {name: bench.missing_settings(leg) for name, leg in bench.LEGS.items()} == {
        name: [] for name in bench.LEGS
    }
    unknown = bench.Leg("future", "vllm", rollout={"no_such_setting": 1})
    assert bench.missing_settings(unknown) == ["[rollout].no_such_setting"]


def test_a_leg_with_a_setting_the_config_lacks_is_skipped_with_a_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(bench.LEGS, "future", bench.Leg("future", "vllm", rollout={"no_such_setting": 1}))
    assert bench.main(["--quick", "--legs", "future", "--repeats", "1"]) == 1  # nothing left to run
    assert "skipping leg future: this checkout's config has no [rollout].no_such_setting" in capsys.readouterr().err


def test_legs_are_interleaved_round_by_round() -> None:
    a, b, c = (bench.LEGS[name] for name in ("vllm", "vllm-lora-merged", "transformers"))
    order = [(repeat, leg.name) for repeat, leg in bench.interleaved([a, b, c], 2)]
    assert order == [(1, "vllm"), (1, "vllm-lora-merged"), (1, "transformers"),
                     (2, "vllm"), (2, "vllm-lora-merged"), (2, "transformers")]  # fmt: skip


@pytest.mark.slow
def test_the_quick_bench_runs_each_leg_in_its_own_process_and_summarises_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    legs = ["transformers", "transformers-no-kv-reuse"]
    assert bench.main(["--quick", "--legs", ",".join(legs), "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| transformers")]
    runs, summary = rows[:4], rows[4:]
    assert [(cells[0].strip(), cells[1].strip()) for cells in runs] == [
        ("transformers", "1"), ("transformers-no-kv-reuse", "1"), ("transformers", "2"), ("transformers-no-kv-reuse", "2")
    ]  # fmt: skip
    for cells in runs:
        rollout_s, generated, prompt = float(cells[2]), int(cells[6]), int(cells[7])
        assert rollout_s > 0 and generated > 0 and prompt > 0, cells
        assert cells[8].strip() == "n/a"  # no server
    # the same seeds in fresh processes: each leg's repeat plays the same episodes
    assert runs[0][6:8] == runs[2][6:8] and runs[1][6:8] == runs[3][6:8]
    assert [cells[0].strip() for cells in summary] == legs
    for cells in summary:
        assert cells[1].strip() == "2"
        median, low, high = (float(x) for x in cells[2].replace("(", " ").replace("-", " ").replace(")", " ").split())
        assert low <= median <= high
