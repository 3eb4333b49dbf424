"""Benchmark: the supervisor's own costs while it watches a trainer.

    python bench/bench_supervisor.py [--quick] [--no-variants] [--lines 1000000] [--repeat 5] [--json]

1. log pass-through   a trainer printing 1M lines (~120 B, a progress dict every 100th) as fast as it can:
                      its own elapsed time with stdout to a file alone vs launched and tailed by the real
                      Supervisor (default poll_s = 0.5). Speed ratio = alone / supervised, target >= 0.95.
2. exit detection     the trainer's time.time() right before os._exit -> the journal's
                      `state running -> crashed` event. Target <= 0.2 s.
3. recovery overhead  `state running -> crashed` -> the next `launch` event, minus the configured waits
                      (wait_s = force_wait_s = 0, gpu.check = false). Target <= 1 s.
4. footprint          `python -m orchestrator run` as a subprocess watching a trainer that logs one step
                      a second: the supervisor process's max RSS (<= 100 MB) and its CPU over a steady
                      ~22 s window (<= 1 % of a core).

2 and 3 come from the same runs: the fake trainer (tests/support/fake_trainer.py) crashing with fla_backward_oom
every 6 steps, resumed from its newest checkpoint each time. Unless --quick/--no-variants, 2-4 are also
run in the situations that used to cost more: 100 checkpoints on disk, a crash 0.3 s after a 1 GiB save,
and a checkpoint saved every 10 s; see bench/README.md.
`run()` returns rows {name, measured, unit, target, pass}; bench/run_all.py runs every bench_*.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The benchmark's injected crashes are not this node's failure history (node_history.py): kept apart.
os.environ.setdefault("ORCHESTRATOR_NODE_STATE_DIR", tempfile.mkdtemp(prefix="bench-node-state-"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))
import psutil  # noqa: E402

from orchestrator.domain import policy  # noqa: E402
from orchestrator.loop import supervisor as supmod  # noqa: E402
from orchestrator.config.recipe import load  # noqa: E402
from orchestrator.types import ExitCode  # noqa: E402
from supervised import FAKE, events, fake_recipe  # noqa: E402


def write_recipe(work: Path, persistent: bool = True, backend: str = "megatron", **kw) -> Path:
    """The fake-trainer recipe, optionally without a persistent_dir, or for the swift backend (1 rank)."""
    sections = {"run": {"backend": backend, **({} if persistent else {"persistent_dir": ""})}}
    if backend == "swift":
        sections["parallel"] = {"nproc_per_node": 1, "expert": 1}
    return fake_recipe(work, **kw, **sections)

# `bench/run_all.py --quick` and tests/test_bench_smoke.py call run(**QUICK).
QUICK = {"quick": True}

RATIO_TARGET, EXIT_TARGET_S, RECOVERY_TARGET_S = 0.95, 0.2, 1.0
RSS_TARGET_MB, CPU_TARGET_PCT = 100.0, 1.0

# A trainer that only prints. It ignores its `sft ...` arguments; at the end it writes ms-swift's
# closing logging.jsonl record (into its cwd, the run's output_dir) so the supervisor sees a completion,
# and appends its own elapsed time (first line to flushed last line) to $BENCH_TIMING.
FIREHOSE = textwrap.dedent('''\
    import json, os, sys, time
    n = int(os.environ.get("BENCH_LINES", "1000000"))
    every = int(os.environ.get("BENCH_PROGRESS_EVERY", "100"))
    m = n // every
    pad = "x" * 48
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        if i % every == 0:  # ms-swift prints str(dict) per logged step, flushed
            k = i // every
            print(f"{{'loss': {0.5 + 1.0 / k:.4f}, 'grad_norm': 0.4213, 'learning_rate': 9.9e-05, "
                  f"'iteration': '{k}/{m}', 'elapsed_time': '1m 2s', 'memory(GiB)': 70.12}}", flush=True)
        else:
            print(f"[INFO:swift] rank 0 micro-step {i:>9} tokens/s 4521.7 seq_len 2048 {pad}")
    sys.stdout.flush()
    elapsed = time.perf_counter() - t0
    with open("logging.jsonl", "a") as f:
        f.write(json.dumps({"last_model_checkpoint": None, "best_model_checkpoint": None}) + "\\n")
    with open(os.environ["BENCH_TIMING"], "a") as f:
        f.write(f"{elapsed!r}\\n")
    ''')

# The fake trainer, ending through os._exit right after it stamps time.time(): the stamp is the
# process's end, not the start of a (numpy-sized) interpreter teardown.
STAMPED_FAKE = textwrap.dedent(f'''\
    import os, runpy, sys, time
    def _exit(code=0):
        sys.stdout.flush()
        sys.stderr.flush()
        code = code if isinstance(code, int) else (0 if code is None else 1)
        with open(os.environ["BENCH_EXIT_STAMPS"], "a") as f:
            f.write(f"{{time.time()!r}}\\n")
        os._exit(code)
    sys.exit = _exit
    sys.argv = [{str(FAKE)!r}] + sys.argv[1:]
    runpy.run_path({str(FAKE)!r}, run_name="__main__")
    ''')


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _supervise(recipe: Path, *overrides: str):
    sup = supmod.Supervisor(load(recipe, list(overrides)), install_signals=False)
    return sup.run(), sup


# ------------------------------------------------------------------ 1. log pass-through

def _alone(script: Path, work: Path, lines: int, timing: Path) -> float:
    log = work / "alone.log"
    env = {**os.environ, "BENCH_LINES": str(lines), "BENCH_TIMING": str(timing)}
    with open(log, "ab", buffering=0) as f:  # opened like launcher.launch opens the attempt log
        subprocess.run([sys.executable, str(script), "sft"], stdout=f, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL, env=env, cwd=work, check=True)
    log.unlink()
    return float(timing.read_text().split()[-1])


def _supervised(script: Path, work: Path, lines: int, timing: Path, poll_s: float) -> tuple[float, float, dict]:
    run_dir = work / f"sup-{time.monotonic_ns()}"
    run_dir.mkdir()
    env = {"BENCH_LINES": str(lines), "BENCH_TIMING": str(timing)}
    recipe = write_recipe(run_dir, persistent=False, extra_env=env, supervisor={
        "poll_s": poll_s, "hang_timeout_s": 600, "startup_timeout_s": 600, "wait_s": 0, "force_wait_s": 0})
    t, cpu = time.perf_counter(), time.process_time()
    code, sup = _supervise(recipe, f"run.entrypoint={json.dumps([sys.executable, str(script)])}")
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    assert code == ExitCode.OK and sup.state.value == "completed", (code, sup.state, sup.exit_reason)
    a = sup.attempt
    size = a.launched.log_path.stat().st_size
    info = {"read_frac": a.log.pos / size if size else 1.0, "cpu_s": cpu}
    shutil.rmtree(run_dir, ignore_errors=True)
    return float(timing.read_text().split()[-1]), wall, info


def bench_passthrough(lines: int, repeat: int, poll_s: float = 0.5, workdir: str | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        work = Path(tmp)
        script = work / "firehose.py"
        script.write_text(FIREHOSE)
        timing = work / "timing.txt"
        alone, supervised, walls, infos = [], [], [], []
        for _ in range(repeat):  # interleaved, so slow phases of a noisy machine hit both sides
            alone.append(_alone(script, work, lines, timing))
            t, wall, info = _supervised(script, work, lines, timing, poll_s)
            supervised.append(t)
            walls.append(wall)
            infos.append(info)
    a, b = _median(alone), _median(supervised)
    ratio = _median([x / y for x, y in zip(alone, supervised)])  # each pair ran back to back: similar load
    read = min(i["read_frac"] for i in infos)
    return [
        {"name": f"pass-through: trainer alone, {lines:,} lines to a file (median of {repeat})",
         "measured": round(a, 3), "unit": "s", "target": "-", "pass": True},
        {"name": f"pass-through: same trainer under the supervisor, poll_s={poll_s:g} (median)",
         "measured": round(b, 3), "unit": "s", "target": "-", "pass": True},
        {"name": "pass-through: trainer speed supervised / alone (median of paired ratios)",
         "measured": round(ratio, 3), "unit": "x",
         "target": f">= {RATIO_TARGET:g}", "pass": ratio >= RATIO_TARGET},
        {"name": "pass-through: supervisor launch -> completed, wall (median)", "measured": round(_median(walls), 3),
         "unit": "s", "target": "-", "pass": True},
        {"name": "pass-through: supervisor CPU while tailing it, per wall second (median)",
         "measured": round(_median([i["cpu_s"] / w for i, w in zip(infos, walls)]), 3), "unit": "x", "target": "-",
         "pass": True},
        {"name": "pass-through: share of the log the supervisor had read at completion (min)",
         "measured": round(100 * read, 1), "unit": "%", "target": "-", "pass": True},
    ]


# ------------------------------------------------------------------ 2 + 3. exit detection, recovery

def _crash_loop(work: Path, crashes: int, earlier_checkpoints: int = 0, save_steps: int = 4) -> tuple[list[float], list[float]]:
    """One supervised run whose trainer crashes `crashes` times (fla_backward_oom, exit 1), each time
    after a new checkpoint, resumed after `earlier_checkpoints` checkpoints of an earlier attempt.
    Returns (exit -> left RUNNING delays, left RUNNING -> next launch minus configured waits)."""
    work.mkdir(parents=True)
    stamps = work / "exit-stamps.txt"
    wrapper = work / "stamped_fake.py"
    wrapper.write_text(STAMPED_FAKE)
    start = earlier_checkpoints * 10
    every = save_steps + 2
    faults = ",".join(f"fla_backward_oom@{start + every * (i + 1)}" for i in range(crashes))
    sup_cfg = {"wait_s": 0, "force_wait_s": 0, "nccl_settle_s": 0, "poll_s": 0.5, "hang_timeout_s": 60,
               "startup_timeout_s": 60, "max_crashes_per_hour": 1000, "max_relaunches_without_progress": 1000}
    # With checkpoints on disk, start-up takes 1 s: the crash then never overlaps the supervisor's first scan
    # after its own start (which verifies and records everything on disk once); steady state is measured.
    recipe = write_recipe(work, iterations=start + every * crashes + 3, save_steps=save_steps, faults=faults,
                          supervisor=sup_cfg, extra_env={"BENCH_EXIT_STAMPS": str(stamps), "FAKE_STEP_S": "0.02",
                                                         "FAKE_STARTUP_S": "1.0" if start else "0.02"})
    entry = f"run.entrypoint={json.dumps([sys.executable, str(wrapper)])}"
    if start:
        _earlier_attempt(work / "out", start, 10, recipe, entry)
    waits: list[float] = []  # the configured wait of each decision (wait_s + settle + backoff): 0 here
    decide = policy.decide

    def recording(*a, **k):
        d = decide(*a, **k)
        waits.append(d.wait_s + d.backoff_s)
        return d
    policy.decide = recording
    try:
        code, sup = _supervise(recipe, entry)
    finally:
        policy.decide = decide
    assert code == ExitCode.OK, (code, sup.exit_reason)
    exits = [float(x) for x in stamps.read_text().split()]
    evs = events(work / "out")
    noticed = [e["at"] for e in evs if e["kind"] == "state" and e["message"] == "running -> crashed"]
    launches = [e["at"] for e in evs if e["kind"] == "launch"]
    assert len(noticed) == len(waits) == crashes and len(launches) == crashes + 1, (noticed, launches, waits)
    detect = [n - x for n, x in zip(noticed, exits)]
    recover = [launches[i + 1] - noticed[i] - waits[i] for i in range(crashes)]
    return detect, recover


# A trainer that saves one checkpoint with `size` bytes of optimizer state and crashes (fla_backward_oom
# text, exit 1) 0.3 s after the save; the second attempt finishes. The save is written under a staging
# name and renamed, so the supervisor never sees it half-written.
BIG_SAVE = textwrap.dedent('''\
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, os.environ["BENCH_DIR"])
    from bench_sync import make_checkpoint
    out, size, m = Path.cwd(), int(os.environ["BENCH_CKPT_BYTES"]), 20
    counter = Path(os.environ["BENCH_COUNTER"])
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    def step(k):
        print(str({"loss": "1.234", "grad_norm": "0.5", "learning_rate": "1e-04",
                   "global_step/max_steps": f"{k}/{m}"}), flush=True)
        with open("logging.jsonl", "a") as f:
            f.write(json.dumps({"loss": 1.234, "global_step/max_steps": f"{k}/{m}"}) + "\\n")
    if n == 1:
        for k in range(1, 11):
            step(k)
            time.sleep(0.05)
        make_checkpoint(out / ".staging", 10, size)
        os.rename(out / ".staging" / "checkpoint-10", out / "checkpoint-10")
        step(11)
        time.sleep(0.3)
        sys.stderr.write(open(os.environ["BENCH_CRASH_TEXT"]).read())
        sys.stderr.flush()
        with open(os.environ["BENCH_EXIT_STAMPS"], "a") as f:
            f.write(f"{time.time()!r}\\n")
        os._exit(1)
    for k in range(11, m + 1):
        step(k)
    with open("logging.jsonl", "a") as f:
        f.write(json.dumps({"last_model_checkpoint": str(out / "checkpoint-10")}) + "\\n")
    ''')


def _big_save_crash(work: Path, size: int) -> float:
    """Exit detection when the crash comes right after a checkpoint of `size` bytes: exit -> left RUNNING."""
    import crash_texts
    from orchestrator.types import CrashClass
    work.mkdir(parents=True)
    (work / "trainer.py").write_text(BIG_SAVE)
    (work / "crash.txt").write_text(crash_texts.text(CrashClass.FLA_BACKWARD_OOM, step=11, nranks=1, port=29500,
                                                     backend="swift"))
    stamps = work / "exit-stamps.txt"
    recipe = write_recipe(work, backend="swift", persistent=False, supervisor={
        "wait_s": 0, "force_wait_s": 0, "poll_s": 0.5, "hang_timeout_s": 120, "startup_timeout_s": 120},
        extra_env={"BENCH_DIR": str(Path(__file__).resolve().parent), "BENCH_CKPT_BYTES": str(size),
                   "BENCH_COUNTER": str(work / "attempts.txt"), "BENCH_CRASH_TEXT": str(work / "crash.txt"),
                   "BENCH_EXIT_STAMPS": str(stamps)})
    code, sup = _supervise(recipe, f"run.entrypoint={json.dumps([sys.executable, str(work / 'trainer.py')])}",
                           "lora.rank=64", "lora.alpha=128")  # bench_sync.make_checkpoint's adapter
    assert code == ExitCode.OK, (code, sup.exit_reason)
    evs = events(work / "out")
    noticed = [e["at"] for e in evs if e["kind"] == "state" and e["message"] == "running -> crashed"]
    verified = [e for e in evs if e["kind"] == "checkpoint"]
    assert len(noticed) == 1 and verified, (noticed, verified)
    shutil.rmtree(work / "out", ignore_errors=True)
    return noticed[0] - float(stamps.read_text().split()[0])


FIRST_VERIFY = textwrap.dedent('''\
    import sys, time
    import orchestrator.loop.supervisor  # everything the supervisor has imported when it finds its first checkpoint
    from orchestrator.store import checkpoints
    from orchestrator.store import manifest
    times = []
    for _ in range(2):
        t = time.perf_counter()
        checkpoints.discover(sys.argv[1], "megatron")
        times.append(time.perf_counter() - t)
    print(times[0] - times[1])
    ''')


def _first_verify_stall(work: Path) -> float:
    """Extra time of the first checkpoint verification in a fresh supervisor process (one checkpoint)."""
    work.mkdir(parents=True)
    env = {**os.environ, "FAKE_STEP_S": "0", "FAKE_STARTUP_S": "0", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, FAKE, "sft", "--output_dir", str(work / "out"), "--train_iters", "10",
                    "--save_steps", "10"], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = subprocess.run([sys.executable, "-c", FIRST_VERIFY, str(work / "out")], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def bench_recovery(crashes: int, runs: int, variants: bool, earlier: int = 100, big_save_mib: int = 1024,
                   workdir: str | None = None) -> list[dict]:
    cases = [("", 0)]
    if variants:
        cases.append((f", {earlier} checkpoints on disk", earlier))
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for c, (label, earlier_n) in enumerate(cases):
            detect, recover = [], []
            for i in range(runs):
                d, r = _crash_loop(Path(tmp) / f"case{c}-run{i}", crashes, earlier_n)
                detect += d
                recover += r
            n = len(detect)
            for what, xs, target in (("exit detection: trainer exit -> supervisor left RUNNING", detect, EXIT_TARGET_S),
                                     ("recovery: crash noticed -> next launch, minus waits", recover,
                                      RECOVERY_TARGET_S)):
                rows += [{"name": f"{what}{label} (median of {n})", "measured": round(_median(xs), 4), "unit": "s",
                          "target": f"<= {target:g}", "pass": _median(xs) <= target},
                         {"name": f"{what}{label} (max)", "measured": round(max(xs), 4), "unit": "s",
                          "target": f"<= {target:g}", "pass": max(xs) <= target}]
        stall = _median([_first_verify_stall(Path(tmp) / f"first{i}") for i in range(3 if variants else 1)])
        rows.append({"name": "exit detection: one-off loop stall at the first checkpoint verification (median)",
                     "measured": round(stall, 4), "unit": "s", "target": f"<= {EXIT_TARGET_S:g}",
                     "pass": stall <= EXIT_TARGET_S})
        if variants:  # the crash comes 0.3 s after a save, while its manifest (sha256 of all of it) is written
            xs = [_big_save_crash(Path(tmp) / f"big{i}", big_save_mib << 20) for i in range(runs + 1)]
            rows.append({"name": f"exit detection: crash 0.3 s after a {big_save_mib} MiB save "
                                 f"(median of {len(xs)})", "measured": round(_median(xs), 4), "unit": "s",
                         "target": f"<= {EXIT_TARGET_S:g}", "pass": _median(xs) <= EXIT_TARGET_S})
    return rows


# ------------------------------------------------------------------ 4. RSS and idle CPU

def _earlier_attempt(out: Path, steps: int, save_steps: int, recipe: Path, *overrides: str) -> None:
    """Checkpoints left by an earlier attempt under an earlier supervisor: the fake trainer run directly at
    full speed, then each checkpoint given the manifest that supervisor would have written."""
    from orchestrator.store import checkpoints
    from orchestrator.store.manifest import write_manifest
    from orchestrator.config.recipe import recipe_hash
    env = {**os.environ, "FAKE_STEP_S": "0", "FAKE_STARTUP_S": "0"}
    subprocess.run([sys.executable, FAKE, "sft", "--output_dir", str(out), "--train_iters", str(steps),
                    "--save_steps", str(save_steps), "--logging_steps", "1"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    h = recipe_hash(load(recipe, list(overrides)))
    for info in checkpoints.discover(out, "megatron"):
        write_manifest(info.path, info.step, h, info.loss)


def _footprint(work: Path, steps: int, settle_s: float, poll_s: float = 0.5,
               earlier_checkpoints: int = 0, save_steps: int = 10, persistent: bool = True,
               sample_s: float = 0.25) -> dict:
    """The supervisor CLI as a subprocess watching a 1 step/s trainer for `steps` steps (resumed after
    `earlier_checkpoints` checkpoints of an earlier attempt). RSS sampled throughout; CPU over a window
    from settle_s after the start to ~2 s before the trainer ends."""
    work.mkdir(parents=True)
    start = earlier_checkpoints * 10
    recipe = write_recipe(work, iterations=start + steps, save_steps=save_steps, persistent=persistent, extra_env={
        "FAKE_STEP_S": "1", "FAKE_STARTUP_S": "0.5"}, supervisor={
        "poll_s": poll_s, "hang_timeout_s": 120, "startup_timeout_s": 120, "wait_s": 0, "force_wait_s": 0})
    if start:
        _earlier_attempt(work / "out", start, 10, recipe)
    argv = [sys.executable, "-m", "orchestrator", "run", str(recipe)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    errlog = open(work / "supervisor.err", "wb")  # a file, not a pipe nobody reads while it runs
    proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=errlog,
                            stdin=subprocess.DEVNULL)
    p = psutil.Process(proc.pid)
    rss, t_start = [], time.monotonic()
    window_start = window_end = None
    end_at = t_start + settle_s + max(1.0, steps - settle_s - 2.0)  # close before the trainer finishes
    try:
        while proc.poll() is None:
            now = time.monotonic()
            try:
                with p.oneshot():
                    rss.append(p.memory_info().rss)
                    cpu = p.cpu_times()
            except psutil.Error:
                break
            if window_start is None and now - t_start >= settle_s:
                window_start = (now, cpu.user + cpu.system, time.time())
            if window_start is not None and window_end is None and now >= end_at:
                window_end = (now, cpu.user + cpu.system, time.time())
            time.sleep(sample_s)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errlog.close()
    assert proc.returncode == 0, (work / "supervisor.err").read_text(errors="replace")[-2000:]
    assert window_start and window_end, "the trainer finished before the measuring window closed"
    cpu_pct = 100 * (window_end[1] - window_start[1]) / (window_end[0] - window_start[0])
    saves = sum(1 for e in events(work / "out", "checkpoint") if window_start[2] <= e["at"] <= window_end[2])
    return {"rss_mb": max(rss) / 1e6, "cpu_pct": cpu_pct, "window_s": window_end[0] - window_start[0],
            "saves": saves}


def bench_footprint(steps: int, settle_s: float, variants: bool, earlier: int = 100,
                    workdir: str | None = None) -> list[dict]:
    """Idle = no checkpoint saved inside the window (save_steps past the end): the cost of watching. The
    runs with a save every 10 s show the per-checkpoint work (verify, manifest, sync) at ~100x the rate of
    a real run; the runs resumed over `earlier` checkpoints show the per-scan cost of checkpoints on disk."""
    idle = steps + 1000
    cases = [("fresh run, idle (no save in the window)", {"save_steps": idle})]
    if variants:
        cases += [
            ("fresh run, a checkpoint saved + synced every 10 s", {"save_steps": 10}),
            (f"resumed, {earlier} checkpoints on disk, idle", {"save_steps": idle, "earlier_checkpoints": earlier}),
        ]
    rows, rss, idle_pct = [], [], None
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for i, (label, kw) in enumerate(cases):
            v = _footprint(Path(tmp) / f"case{i}", steps, settle_s, **kw)
            rss.append(v["rss_mb"])
            idle_pct = v["cpu_pct"] if idle_pct is None else idle_pct
            saving = kw["save_steps"] < idle  # not idle: checkpoint work at ~100x a real run's save rate
            rows.append({"name": f"footprint: supervisor CPU, 1 step/s trainer, poll_s=0.5, {label} "
                                 f"({v['window_s']:.0f} s window)", "measured": round(v["cpu_pct"], 2), "unit": "%",
                         "target": "-" if saving else f"<= {CPU_TARGET_PCT:g}",
                         "pass": saving or v["cpu_pct"] <= CPU_TARGET_PCT})
            if saving and v["saves"]:
                per = (v["cpu_pct"] - idle_pct) / 100 * v["window_s"] / v["saves"]
                rows.append({"name": f"footprint: supervisor CPU per checkpoint saved (verify, manifest, sync; "
                                     f"{v['saves']} small fake saves)", "measured": round(per, 3), "unit": "s",
                             "target": "-", "pass": True})
    return [{"name": f"footprint: supervisor process RSS while watching (max of {len(rss)} runs)",
             "measured": round(max(rss), 1), "unit": "MB", "target": f"<= {RSS_TARGET_MB:g}",
             "pass": max(rss) <= RSS_TARGET_MB}] + rows


# ------------------------------------------------------------------ all

def run(quick: bool = False, lines: int | None = None, repeat: int | None = None, workdir: str | None = None,
        variants: bool = True) -> list[dict]:
    lines = lines or (20_000 if quick else 1_000_000)
    repeat = repeat or (1 if quick else 5)
    rows = bench_passthrough(lines, repeat, workdir=workdir)
    rows += bench_recovery(crashes=2 if quick else 6, runs=1 if quick else 2, variants=variants and not quick,
                           workdir=workdir)
    rows += bench_footprint(steps=6 if quick else 30, settle_s=2.5 if quick else 6.0, variants=variants and not quick,
                            workdir=workdir)
    for r in rows:
        if isinstance(r["measured"], float) and not math.isfinite(r["measured"]):
            r["pass"] = False
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: proves the benchmark runs, numbers are rough")
    ap.add_argument("--lines", type=int, default=None, help="pass-through lines (default 1,000,000)")
    ap.add_argument("--repeat", type=int, default=None, help="pass-through repetitions (default 5)")
    ap.add_argument("--no-variants", dest="variants", action="store_false",
                    help="skip the runs with 100 checkpoints on disk, the 1 GiB save and the saving footprint (~2 min)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: system temp)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = run(a.quick, a.lines, a.repeat, a.dir, a.variants)
    from run_all import print_table  # bench/ is on sys.path: this file's own folder
    print(json.dumps(rows, indent=1)) if a.json else print_table(rows)
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
