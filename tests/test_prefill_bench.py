"""The prefill benchmark runs end to end on a tiny model and prints a line per slice size."""

from __future__ import annotations

import re

import pytest
from repo_script import load_script


def test_prefill_bench_prints_a_line_per_slice_size(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench/prefill_bench.py")
    assert bench.main(["--tiny", "--rows", "8", "--context", "1024", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1].rstrip(":") for line in lines] == ["whole", "16384", "8192", "4096", "2048"]
    passes = [int(re.search(r"(\d+) passes", line).group(1)) for line in lines]
    assert passes == [1, 1, 1, 2, 4]  # 8 rows x 1024 positions = 8192 tokens
