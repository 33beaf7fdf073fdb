"""The update bench runs its four legs end to end on the tiny model, each in its own process,
and the faster legs' logprobs and gradient agree with the plain leg's."""

from __future__ import annotations

import re

import pytest
from repo_script import load_script


@pytest.mark.slow  # four child processes, ~40 s on 2 busy cores
def test_the_tiny_update_bench_prints_every_leg_with_its_differences(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench/update_bench.py")
    assert bench.main(["--tiny", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"batch .*: 8 episodes, \d+ tokens", out), out
    assert "load average (1, 5, 15 min)" in out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if re.match(r"\| [a-z-]+ \| 0 \|", line)}
    assert list(rows) == ["plain", "no-mask", "shared-prefix", "exact"], out
    for leg, (_, seconds, tokens_per_s, logprob_diff, grad_diff, microbatches, _) in rows.items():
        assert float(seconds) > 0 and float(tokens_per_s) > 0, leg
        assert float(logprob_diff) < 1e-4 and float(grad_diff) < 1e-4, (leg, logprob_diff, grad_diff)
    assert int(rows["exact"][5]) <= int(rows["plain"][5])  # a group's episodes travel together
    assert re.search(r"\| exact \| [\d.]+ \| [\d.]+-[\d.]+ \| \d+ \| [\d.]+x \|", out), out
