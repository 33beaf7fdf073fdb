"""The dtype benchmark runs end to end on a tiny model and prints both dtypes' figures."""

from __future__ import annotations

import re

import pytest
from repo_script import load_script


@pytest.mark.slow  # 14 s in a loaded suite run (docs/testing.md)
def test_dtype_bench_prints_a_line_per_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench/dtype_bench.py")
    assert bench.main(["--tiny", "--repeats", "1", "--context", "16", "--length", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["float32", "bfloat16"]
    for line in lines:
        assert len(re.findall(r"\d+ ms", line)) == 2, line
        assert int(re.search(r"(\d+) tokens/s", line).group(1)) > 0, line
