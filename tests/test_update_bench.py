"""The update bench runs its five legs end to end on the tiny model, each in its own process;
the exact legs' logprobs and gradient agree with the plain leg's, and the bfloat16 leg's
within bfloat16 rounding, its mismatch reported."""

from __future__ import annotations

import re

import pytest
from repo_script import load_script


@pytest.mark.slow  # five child processes, ~50 s on 2 busy cores
def test_the_tiny_update_bench_prints_every_leg_with_its_differences(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench/update_bench.py")
    assert bench.main(["--tiny", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"batch .*: 8 episodes, \d+ tokens", out), out
    assert "load average (1, 5, 15 min)" in out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if re.match(r"\| [a-z0-9-]+ \| 0 \|", line)}
    assert list(rows) == ["plain", "no-mask", "shared-prefix", "exact", "bf16"], out
    for leg, (_, seconds, tokens_per_s, logprob_diffs, grad_diff, mismatch, microbatches, _) in rows.items():
        assert float(seconds) > 0 and float(tokens_per_s) > 0, leg
        largest, mean = (float(x) for x in logprob_diffs.split("/"))
        if leg == "bf16":  # bfloat16 rounding: off plain, but by far less than a policy's step
            assert 0 < mean < 0.05 and 0 < float(mismatch) < 0.01, (leg, logprob_diffs, mismatch)
        else:
            assert largest < 1e-4 and float(grad_diff) < 1e-4, (leg, logprob_diffs, grad_diff)
            assert float(mismatch) < 1e-6  # the batch's sampler logprobs are the float32 policy's
    assert int(rows["exact"][6]) <= int(rows["plain"][6])  # a group's episodes travel together
    assert re.search(r"\| exact \| [\d.]+ \| [\d.]+-[\d.]+ \| \d+ \| [\d.]+x \|", out), out
