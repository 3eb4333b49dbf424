"""The benchmarks still run: each bench/bench_*.py's run() at its quickest size (what `bench/run_all.py
--quick` uses). No assertion on speed: the numbers of a quick run on a shared machine mean little.
About 15 s in all."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import run_all  # noqa: E402

KEYS = {"name", "measured", "unit", "target", "pass"}


@pytest.mark.parametrize("path", run_all.modules(), ids=lambda p: p.stem)
def test_benchmark_runs_quick(path, tmp_path):
    mod = run_all.load(path)
    kwargs = run_all.quick_kwargs(mod)
    assert kwargs, f"{path.name}: no quick size (define QUICK in the module or in run_all.QUICK)"
    if "workdir" in mod.run.__code__.co_varnames:
        kwargs["workdir"] = str(tmp_path)
    rows = mod.run(**kwargs)
    assert rows
    for r in rows:
        assert KEYS <= set(r), r
        assert isinstance(r["name"], str) and r["name"]
        assert isinstance(r["measured"], (int, float)) and math.isfinite(r["measured"]), r
        assert isinstance(r["pass"], bool), r


def test_run_all_quick_prints_one_table_and_exits_0(monkeypatch, capsys):
    rows = [{"name": "x", "measured": 1.5, "unit": "s", "target": "<= 2", "pass": True},
            {"name": "y", "measured": float("nan"), "unit": "", "target": "-", "pass": True}]

    def fake_run_one(path, quick):
        assert quick
        return [dict(r, benchmark=path.stem.removeprefix("bench_"), seconds=0.0) for r in rows]
    monkeypatch.setattr(run_all, "run_one", fake_run_one)
    assert run_all.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["benchmark", "name"]
    for p in run_all.modules():
        assert p.stem.removeprefix("bench_") in out
