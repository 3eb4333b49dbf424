"""Run every benchmark (bench/bench_*.py) and print one table: benchmark, measured, target, pass.

    python bench/run_all.py [--quick] [--only NAME ...] [--json]

Each bench_*.py exposes `run(**kwargs) -> list[dict]` (rows with name, measured, unit, target, pass).
--quick runs each at its smallest size (the module's QUICK kwargs, else the table below): it proves the
scripts work; its numbers are rough. Benchmarks report, they do not gate: the exit code is always 0.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent

# --quick sizes for modules that do not define QUICK themselves.
QUICK = {
    "bench_verify": {"size_gib": 0.0625, "repeat": 3},
    "bench_sync": {"size_mib": 8, "files": 20, "repeat": 1, "rounds": 1},
}


def modules() -> list[Path]:
    return sorted(BENCH.glob("bench_*.py"))


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(mod)
    return mod


def quick_kwargs(mod) -> dict:
    return dict(getattr(mod, "QUICK", None) or QUICK.get(mod.__name__, {}))


def run_one(path: Path, quick: bool) -> list[dict]:
    """One module's rows, each tagged with its benchmark; a failing module yields one row saying so."""
    t = time.perf_counter()
    try:
        mod = load(path)
        rows = mod.run(**(quick_kwargs(mod) if quick else {}))
    except Exception as e:  # noqa: BLE001 - report it and go on with the next benchmark
        traceback.print_exc()
        rows = [{"name": f"FAILED: {type(e).__name__}: {e}"[:160], "measured": float("nan"), "unit": "",
                 "target": "-", "pass": False}]
    took = time.perf_counter() - t
    for r in rows:
        r["benchmark"] = path.stem.removeprefix("bench_")
        r["seconds"] = round(took, 1)
    return rows


def fmt(v) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan"
    return f"{v:,}" if isinstance(v, int) else f"{v:g}" if isinstance(v, float) else str(v)


def print_table(rows: list[dict]) -> None:
    """The table of every bench_*.py (run alone, or tagged with "benchmark" by run_one)."""
    tagged = "benchmark" in rows[0]
    wb = max(len("benchmark"), *(len(r.get("benchmark", "")) for r in rows))
    wn = max(len(r["name"]) for r in rows)

    def line(bench: str, name: str, measured: str, target: str, ok: str) -> str:
        return (f"{bench:<{wb}}  " if tagged else "") + f"{name:<{wn}}  {measured:>14}  {target:>9}  {ok}"

    print(line("benchmark", "name", "measured", "target", "pass"))
    for r in rows:
        m = f"{fmt(r['measured'])} {r.get('unit', '')}".rstrip()
        ok = "-" if r["target"] == "-" else ("yes" if r["pass"] else "NO")
        print(line(r.get("benchmark", ""), r["name"], m, r["target"], ok))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smallest sizes: proves the benchmarks run")
    ap.add_argument("--only", nargs="*", default=None, help="benchmark names, e.g. supervisor sync")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    paths = [p for p in modules() if a.only is None or p.stem.removeprefix("bench_") in a.only]
    rows = []
    for p in paths:  # one at a time: on a small machine, benchmarks must not measure each other
        print(f"running {p.name}{' (quick)' if a.quick else ''} ...", file=sys.stderr, flush=True)
        rows += run_one(p, a.quick)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)
        bad = [r for r in rows if r["target"] != "-" and not r["pass"]]
        print(f"\n{len(rows) - len(bad)} of {len(rows)} rows within target" + (f"; {len(bad)} not" if bad else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
