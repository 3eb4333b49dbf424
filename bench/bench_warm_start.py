"""Benchmark: launch -> first step of the real `swift sft` demo, cold vs with the page cache warmed.

    python bench/bench_warm_start.py [--quick] [--repeat 2] [--json]

Before each start the caches are dropped: `echo 3 > /proc/sys/vm/drop_caches` where this process may
(root on a host); where it may not (a container: /proc/sys is read-only), the model's own files are
evicted with posix_fadvise(DONTNEED), which needs no privilege, and the row says so. "warm" then runs
the supervisor's warm-up (orchestrator/host/pagecache.py, as LocalHost.warm_page_cache does during the wait
before a relaunch) to its end before launching; "cold" launches at once. Both take the second start's
path (--load_from_cache_file true with the datasets cache already built, as a relaunch finds it).
Reported: median cold / median warm launch -> first step (> 1 = the warm-up saves time).
--quick: the fake trainer (tests/support/fake_trainer.py), one start each: proves the script runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))

from orchestrator.host import pagecache  # noqa: E402
from orchestrator.host.launch import local as launcher
from orchestrator.config.recipe import load  # noqa: E402
from orchestrator.config.render.command import render_command  # noqa: E402

QUICK = {"quick": True}
DEMO = REPO / "orchestrator" / "data" / "demo-cpu.toml"


def drop_caches(files: list[Path]) -> str:
    """Drop the page cache; returns how."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError as e:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return f"fadvise DONTNEED on the model's files (drop_caches refused: {e.strerror})"


def first_step_s(argv: list[str], env: dict, out: Path, timeout: float = 300) -> float:
    """Seconds from Popen to the first progress record in the trainer's output."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "start.log"
    t0 = time.monotonic()
    with open(log, "wb") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=out)
    try:
        while time.monotonic() - t0 < timeout:
            if "global_step/max_steps" in log.read_text(errors="replace"):
                return time.monotonic() - t0
            if p.poll() is not None:
                raise RuntimeError(f"the trainer exited {p.returncode} before its first step; see {log}")
            time.sleep(0.02)
        raise RuntimeError(f"no first step within {timeout} s; see {log}")
    finally:
        p.kill()
        p.wait()


def run(quick: bool = False, repeat: int = 2, workdir: str | None = None) -> list[dict]:
    work = Path(workdir or tempfile.mkdtemp(prefix="bench-warm-"))
    repeat = 1 if quick else repeat
    try:
        if quick:
            from recipes import make_model
            model = {"model": str(work / "model"), "data": str(work / "data.jsonl")}
            make_model(Path(model["model"]))
            (Path(model["model"]) / "model.safetensors").write_bytes(os.urandom(1 << 20))
            Path(model["data"]).write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
        else:
            from orchestrator.ops import tiny
            model = tiny.build(work / "tiny")
        over = [f"model.path={json.dumps(model['model'])}", f"data.dataset=[{json.dumps(model['data'])}]",
                f"run.output_dir={json.dumps(str(work / 'out'))}", "optim.iterations=3",
                f"env.vars.MODELSCOPE_CACHE={json.dumps(str(work / 'modelscope'))}"]
        if quick:
            from supervised import FAKE
            over += [f"run.entrypoint={json.dumps([sys.executable, FAKE])}", "env.vars.FAKE_BACKEND=\"swift\""]
        cmd = render_command(load(DEMO, over), None, 29690)
        argv, env = launcher.resolve(cmd.argv), {**os.environ, **cmd.env}
        files = pagecache.weight_files(model["model"])
        size = sum(f.stat().st_size for f in files)
        first_step_s(argv, env, work / "prime")  # builds the datasets cache, as the first attempt does
        times: dict[str, list[float]] = {"cold": [], "warm": []}
        how = ""
        for i in range(repeat):
            for mode in ("cold", "warm"):
                how = drop_caches(files)
                if mode == "warm":
                    w = pagecache.Warmer(files)
                    w.start()
                    w.thread.join(120)  # the wait before the relaunch, long enough for the warm-up
                    w.stop()
                times[mode].append(first_step_s(argv, env, work / f"{mode}-{i}"))
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
    return [{"name": "launch -> first step, cold / page cache warmed (ratio of medians)",
             "measured": round(cold / warm, 3), "unit": "x", "target": "-", "pass": True,
             "detail": {"cold_s": [round(t, 2) for t in times["cold"]], "warm_s": [round(t, 2) for t in times["warm"]],
                        "weights_bytes": size, "cache_drop": how, "trainer": "fake" if quick else "swift"}}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = run(quick=a.quick, repeat=a.repeat)
    print(json.dumps(rows, indent=1) if a.json else "\n".join(f"{r['name']}: {r['measured']} {r['unit']} {r['detail']}"
                                                               for r in rows))


if __name__ == "__main__":
    main()
