"""The dtype benchmark runs end to end on a tiny model and prints both dtypes' figures."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[1] / "bench" / "dtype_bench.py"


def test_dtype_bench_prints_a_line_per_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("dtype_bench", _BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tiny", "--repeats", "1", "--context", "16", "--length", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["float32", "bfloat16"]
    for line in lines:
        assert len(re.findall(r"\d+ ms", line)) == 2, line
        assert int(re.search(r"(\d+) tokens/s", line).group(1)) > 0, line
