#!/usr/bin/env python3
"""Chaos soak for the supervisor: many injected trainer faults, `kill -9` of the supervisor at awkward
moments, interrupted syncs, and the reliability invariants checked all along.

    python tests/support/chaos.py --faults 200 --supervisor-kills 20 --sync-kills 20 --seed N   # or --full
    python tests/support/chaos.py                                                              # the CI counts

How it works
  * A *long run* is one supervised run of the fake trainer (tests/support/fake_trainer.py, megatron flavour,
    checkpoint every 10 steps) with many faults in FAKE_FAULTS, each firing once (FAKE_STATE). Faults sit in
    clusters at step c+1 right after a checkpoint step c: the *primary* fires mid-training in the attempt that
    reached c+1 (it resumed from <= c-10, so it made checkpoint progress), then each *follower* fires at
    start-up of one relaunch from c (the only way to get cold_start_oom / port_in_use more than once per
    run). At most one follower per cluster counts against max_relaunches_without_progress (port_in_use
    does not count), so the no-progress guard never trips; max_crashes_per_hour is set out of reach and
    the waits are tiny, so the soak exercises classification and recovery, not back-off.
    Long runs alternate FAKE_HANG_MODE=silent (hang found by hang_timeout_s) and watchdog (NCCL watchdog
    text + SIGABRT). One nan_loss cluster per run (twice in a row gives up by design), anywhere, NAN_GAP save
    intervals before the next one. `other` gives up by design: it gets its own short runs that must end with
    exit 3.
  * The supervisor runs as `python -m orchestrator run recipe.toml` (own session). Scheduled *events*,
    armed when training reaches a random step, kill it with SIGKILL at a chosen kind of moment and restart it:
      running      while an attempt runs
      launching    while the state is launching/relaunching (between picking the resume point and the row)
      attempt_row  right after a new attempt row appears in the journal (the trainer was just started)
      recovery     while crashed/cleaning/waiting/backoff/verifying
      sync         while a `.partial-*` staging dir exists in persistent_dir AND its rsync is copying
    and *standalone syncs* (`python -m orchestrator sync recipe.toml --once`, or a worker calling
    sync.sync_once(bwlimit_kib=...)) are killed with SIGKILL mid-copy (pid only: the orphaned rsync keeps the
    lock and finishes into the staging dir; or the process group: the copy stops half-way).
    Copies are made slow with an `rsync` wrapper first on PATH that adds --bwlimit (slow storage), so a
    checkpoint takes ~0.4 s to publish and the staging window is real. No sleeps for synchronisation: every
    wait polls for a condition (journal rows, files, processes) with a deadline.
  * A sampler thread checks, every SAMPLE_S during the whole run:
      - never two trainings at once: at most one process tree carrying this run's ORCHESTRATOR_RUN marker;
      - never a partial checkpoint visible in persistent_dir: every entry not starting with "." is a
        checkpoint-N(-merged) dir with a manifest of this recipe hash and step, verifies ok and matches its
        manifest (sizes + sha256), nothing extra (an entry replaced or removed while being checked is re-read);
      - every new attempt's resumed_from verifies ok (and its manifest, if any, is of this recipe hash);
      - which local checkpoints are *finished* (last-checkpoint points at or past them and they verify ok),
        one entry per version (latest_checkpointed_iteration.txt mtime), for the resume checks below.
  * After each run: the exit code; every attempt resumed from the newest finished checkpoint version that
    existed at its launch (minus versions written by a NaN attempt at or after its NaN), never from a poisoned
    one, and start steps never decrease; each attempt's first logged step is its start step + 1; every fault
    fired exactly once and every classified attempt matches, in order, an injected fault of the same class
    (an attempt ended by a supervisor kill may or may not have consumed a fault: an alignment over the fired
    sequence decides); every trainer seen had an attempt row and every attempt log holds one trainer's output;
    silent hangs were found by the hang timeout, port_in_use relaunched on another port; logged steps cover
    1..max; no trainer is left; the final checkpoint is published and no staging dir is left.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from supervised import fake_recipe, wait_for  # noqa: E402

from orchestrator.store import checkpoints as ck  # noqa: E402
from orchestrator.store import manifest as mf  # noqa: E402
from orchestrator.host.journal import Journal, journal_path  # noqa: E402
from orchestrator.host.launch.local import RUN_MARKER  # noqa: E402
from orchestrator.store.published import publish_dir  # noqa: E402
from orchestrator.config.recipe import load, recipe_hash  # noqa: E402
from orchestrator.store.rundir import run_id, state_dir  # noqa: E402
from orchestrator.types import Attempt, CrashClass as C, ExitCode  # noqa: E402

HERE = Path(__file__).resolve()
SAVE = 10                      # checkpoint.save_steps of every soak run
SAMPLE_S = 0.04                # sampler period
POLL_S = 0.01                  # harness poll period while an event is armed
EVENT_DEADLINE_S = 30.0        # an armed kill whose moment never comes is done anyway (kind + "/late")
CLI_TRIES_S = 3.0              # then a standalone-sync event uses the sync_once worker instead of the CLI
RUN_DEADLINE_S = 600.0
# Known bug (test_chaos.py test_final_sync_waits_for_a_sync_lock_held_briefly): the final sync skips its round
# when another sync holds the lock, e.g. the orphaned rsync of a standalone sync killed by pid shortly before the
# run completes. Tolerated while it stands: the final checkpoint missing from persistent_dir (and a staging dir
# left) is reported, not a violation, when the journal shows that the final round was skipped for the lock.
FINAL_SYNC_SKIP_TOLERATED = False
NAN_GAP = 6                    # save intervals after a nan_loss cluster (see plan_long_run)
START_LINE = "Start time of running main"  # the fake trainer's first line: one per trainer in an attempt log

PRIMARY = (C.FLA_BACKWARD_OOM, C.OOM_DURING_TRAINING, C.NCCL_ERROR, C.NCCL_TIMEOUT_HANG, C.HOST_OOM_KILLED,
           C.DISK_FULL, C.CUDA_FATAL)
# At start-up of a relaunch: oom_during_training would (rightly) be cold_start_oom there, a silent hang
# would wait for startup_timeout_s; port_in_use only here (not after a completed step).
FOLLOWER = (C.COLD_START_OOM, C.NCCL_ERROR, C.CUDA_FATAL, C.HOST_OOM_KILLED, C.FLA_BACKWARD_OOM)
SUP_KINDS = ("sync", "attempt_row", "launching", "recovery", "running")
RECOVERY_STATES = {"crashed", "cleaning", "waiting", "backoff", "verifying"}
STEP_RE = re.compile(r"""['"](?:iteration|global_step/max_steps)['"]\s*:\s*['"](\d+)/\d+""")
NAN_RE = re.compile(r"""['"]loss['"]\s*:\s*['"]?nan""")


# ------------------------------------------------------------------------------------------ planning

@dataclass(frozen=True)
class Fault:
    cls: C
    step: int
    role: str                  # primary | follower | nan | other

    @property
    def key(self) -> str:      # how fake_trainer.py records it in FAKE_STATE
        return f"{self.cls.value}@{self.step}"


@dataclass(frozen=True)
class Event:
    arm_step: int
    what: str                  # supervisor | sync
    kind: str                  # supervisor: SUP_KINDS; sync: cli | worker
    group: bool = False        # SIGKILL the process group (with its rsync) instead of the pid


@dataclass
class RunPlan:
    name: str
    hang_mode: str
    faults: list[Fault]
    iterations: int
    events: list[Event]
    expect_exit: ExitCode = ExitCode.OK

    @property
    def nan_step(self) -> int | None:
        return min((f.step for f in self.faults if f.cls is C.NAN_LOSS), default=None)


@dataclass
class Config:
    seed: int
    faults: int = 24                 # injected in the long runs (class `other` comes on top, one per other run)
    supervisor_kills: int = 3
    sync_kills: int = 3
    spare_sync_kills: int = 2        # scheduled on top: a standalone sync can find nothing left to copy
    runs: int = 2                    # long runs; hang mode alternates silent / watchdog
    other_runs: int = 1
    nan_anywhere: bool = True        # False: nan_loss is each run's last cluster, no kill after it fired
    bwlimit_kib: int = 128           # rsync --bwlimit for every copy (the wrapper on PATH)
    hang_timeout_s: float = 4.0      # silent-hang runs; generous: a false hang verdict fails the soak
    step_s: float = 0.01
    verbose: bool = False

    @classmethod
    def ci(cls, seed: int) -> Config:
        return cls(seed)

    @classmethod
    def full(cls, seed: int) -> Config:
        return cls(seed, faults=200, supervisor_kills=20, sync_kills=20, runs=4, other_runs=4)


def _split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def plan_long_run(rng: random.Random, name: str, n: int, hang_mode: str, sup_kinds: list[str], n_sync: int,
                  sync_offset: int, nan: bool, nan_anywhere: bool) -> RunPlan:
    followers = FOLLOWER + ((C.NCCL_TIMEOUT_HANG,) if hang_mode == "watchdog" else ())
    cover_p = list(PRIMARY)
    rng.shuffle(cover_p)
    cover_f = [C.COLD_START_OOM, C.PORT_IN_USE]
    budget = n - nan
    clusters: list[list[tuple[C, str]]] = []
    while budget > 0:
        prim = cover_p.pop() if cover_p else rng.choice(PRIMARY)
        cl, budget = [(prim, "primary")], budget - 1
        if prim is not C.DISK_FULL:  # disk_full's attempt runs through c+1: a follower would fire mid-training
            extra = []
            spare = lambda: budget - len(cover_p) - len(cover_f) > 0  # noqa: E731, B023 - coverage first, read now
            if budget > len(cover_p) and (C.PORT_IN_USE in cover_f or rng.random() < 0.3 and spare()):
                extra.append(C.PORT_IN_USE)
                budget -= 1
            if budget > len(cover_p) and (C.COLD_START_OOM in cover_f or rng.random() < 0.45 and spare()):
                f = C.COLD_START_OOM if C.COLD_START_OOM in cover_f else rng.choice([c for c in followers if c != prim])
                extra.append(f)
                budget -= 1
            for f in extra:
                if f in cover_f:
                    cover_f.remove(f)
            rng.shuffle(extra)
            cl += [(f, "follower") for f in extra]
        clusters.append(cl)
    if nan:  # one per run: nan_loss twice in a row gives up by design
        nan_cl = [(C.NAN_LOSS, "nan")]
        if nan_anywhere and clusters:
            clusters.insert(rng.randrange(len(clusters) + 1), nan_cl)
        else:
            clusters.append(nan_cl)
    faults, c = [], SAVE * rng.randint(1, 2)
    for i, cl in enumerate(clusters):
        faults += [Fault(cls, c + 1, role) for cls, role in cl]
        if i + 1 < len(clusters):
            # The NaN attempt trains on until the supervisor sees the NaN and stops it: the next fault is far
            # enough that it does not fire in that attempt too (test_nan_logged_just_before_a_crash_...).
            c += SAVE * (NAN_GAP if cl[0][0] is C.NAN_LOSS else rng.choice((1, 1, 2, 3)))
    iterations = c + SAVE * rng.randint(2, 3)
    # Supervisor kills are armed in the first 60 % of the faults, standalone-sync kills in the first 40 % (the
    # sync falls behind most then), before the nan cluster with nan_last: so that the
    # moment each kind waits for (a relaunch, a crash, a copy) still comes.
    last = faults[-1].step if nan_anywhere or not nan else min(f.step for f in faults if f.cls is C.NAN_LOSS)
    hi = max(SAVE + 1, int(last * 0.6))
    events = [Event(rng.randint(SAVE, hi), "supervisor", k, group=(k == "sync" and rng.random() < 0.5))
              for k in sup_kinds]
    events += [Event(rng.randint(SAVE, max(SAVE + 1, int(last * 0.4))), "sync",
                     "cli" if (sync_offset + i) % 2 == 0 else "worker",
                     group=(sync_offset + i) % 4 >= 2) for i in range(n_sync)]
    events.sort(key=lambda e: e.arm_step)
    return RunPlan(name, hang_mode, faults, iterations, events)


def plan_other_run(rng: random.Random, name: str) -> RunPlan:
    """Zero to two recoverable faults, then `other`: at start-up (@0), at start-up of a relaunch, or mid-training."""
    before = rng.randint(0, 2)
    faults, c = [], SAVE * rng.randint(1, 2)
    for _ in range(before):
        faults.append(Fault(rng.choice((C.FLA_BACKWARD_OOM, C.NCCL_ERROR, C.CUDA_FATAL, C.HOST_OOM_KILLED)), c + 1,
                            "primary"))
        c += SAVE
    where = "start" if not faults else rng.choice(("relaunch", "mid"))
    if where == "start":
        faults.append(Fault(C.OTHER, 0, "other"))
    elif where == "relaunch":  # a follower of the last cluster
        faults.append(Fault(C.OTHER, faults[-1].step, "other"))
    else:
        faults.append(Fault(C.OTHER, c + rng.randint(2, SAVE), "other"))
    return RunPlan(name, "silent", faults, c + 3 * SAVE, [], ExitCode.GAVE_UP)


def plan_soak(cfg: Config) -> list[RunPlan]:
    rng = random.Random(cfg.seed)
    kinds = [SUP_KINDS[i % len(SUP_KINDS)] for i in range(cfg.supervisor_kills)]
    per_run_kinds: list[list[str]] = [[] for _ in range(cfg.runs)]
    for i, k in enumerate(kinds):
        per_run_kinds[i % cfg.runs].append(k)
    plans, offset = [], 0
    for i, (n, ns) in enumerate(zip(_split(cfg.faults, cfg.runs), _split(cfg.sync_kills + cfg.spare_sync_kills, cfg.runs))):
        mode = "silent" if i % 2 == 0 else "watchdog"
        plans.append(plan_long_run(rng, f"long{i + 1}-{mode}", n, mode, per_run_kinds[i], ns, offset,
                                   nan=n >= 2, nan_anywhere=cfg.nan_anywhere))
        offset += ns
    plans += [plan_other_run(rng, f"other{i + 1}") for i in range(cfg.other_runs)]
    return plans


# ------------------------------------------------------------------------------------------ helpers

def read_journal(out: Path) -> tuple[list[Attempt], dict] | None:
    """(attempts, kv) or None while the journal is not there or not readable (a writer just died, say)."""
    path = journal_path(state_dir(out))
    if not path.exists():
        return None
    try:
        j = Journal(path, readonly=True)
        try:
            return j.attempts(), j.get_all()
        finally:
            j.close()
    except sqlite3.Error:
        return None


def journal_events(out: Path, kind: str | None = None) -> list[dict]:
    j = Journal(journal_path(state_dir(out)), readonly=True)
    try:
        return [e for e in j.events(1_000_000) if kind is None or e["kind"] == kind]
    finally:
        j.close()


def fired_faults(state_file: Path) -> list[str]:
    try:
        return json.loads(state_file.read_text()).get("fired", [])
    except (OSError, ValueError):
        return []


def link_step(out: Path) -> int | None:
    try:
        return int(ck.CKPT_RE.fullmatch(os.readlink(out / "last-checkpoint")).group(1))
    except (OSError, AttributeError, ValueError):
        return None


def partials(persist: Path) -> list[str]:
    try:
        return [e.name for e in os.scandir(persist) if e.name.startswith(".partial-") and "deleting" not in e.name]
    except OSError:
        return []


def rsync_children(pid: int) -> list[psutil.Process]:
    try:
        return [c for c in psutil.Process(pid).children(recursive=True) if c.name() == "rsync"]
    except psutil.Error:
        return []


def attempt_log(log_path: str | None) -> tuple[str, int]:
    """(the output of the attempt's own trainer, how many trainers wrote the log)."""
    try:
        text = Path(log_path).read_text(errors="replace") if log_path else ""
    except OSError:
        return "", 0
    starts = text.count(START_LINE)
    if starts > 1:
        text = text[text.rfind("\n", 0, text.rfind(START_LINE)) + 1:]
    return text, starts


def attempt_steps(log_path: str | None) -> tuple[list[int], int | None]:
    """(steps printed by one attempt's own trainer, first step printed with a NaN loss)."""
    steps, nan = [], None
    for line in attempt_log(log_path)[0].splitlines():
        m = STEP_RE.search(line)
        if m:
            steps.append(int(m.group(1)))
            if nan is None and NAN_RE.search(line):
                nan = int(m.group(1))
    return steps, nan


class StepTail:
    """Highest step logged so far in <output_dir>/logging.jsonl, read incrementally."""

    def __init__(self, path: Path):
        self.path, self.pos, self.rest, self.max = path, 0, b"", 0

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return self.max
        self.pos += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        for line in lines:
            m = STEP_RE.search(line.decode(errors="replace"))
            if m:
                self.max = max(self.max, int(m.group(1)))
        return self.max


def logged_steps(out: Path) -> set[int]:
    steps = set()
    for line in (out / "logging.jsonl").read_text().splitlines():
        m = STEP_RE.search(line)
        if m:
            steps.add(int(m.group(1)))
    return steps


def make_rsync_wrapper(directory: Path, bwlimit_kib: int) -> Path | None:
    """A directory holding an `rsync` that adds --bwlimit: slow persistent storage, so copies have a window.
    A later --bwlimit (sync_once(bwlimit_kib=...)) wins. None when there is no rsync (pure-Python copies)."""
    real = shutil.which("rsync")
    if real is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    w = directory / "rsync"
    w.write_text(f"#!/bin/sh\nexec {real} --bwlimit={bwlimit_kib} \"$@\"\n")
    w.chmod(0o755)
    return directory


# ------------------------------------------------------------------------------------------ the sampler

@dataclass
class Version:
    step: int
    mtime_ns: int              # latest_checkpointed_iteration.txt: a re-save rewrites it
    seen_at: float             # first sample that found it finished


class Sampler(threading.Thread):
    """Checks the continuous invariants every SAMPLE_S (see the module docstring); collects violations."""

    def __init__(self, out: Path, persist: Path, rid: str, h: str, expect: ck.LoraExpect, backend: str):
        super().__init__(name="chaos-sampler", daemon=True)
        self.out, self.persist, self.rid, self.hash, self.expect, self.backend = out, persist, rid, h, expect, backend
        self.violations: list[str] = []
        self.samples = self.partial_samples = self.max_trainers = 0
        self.trainers: dict[tuple[int, float], float] = {}      # (pid, create_time) -> first seen
        self.versions: dict[tuple[int, int], Version] = {}     # (step, mtime_ns) -> finished version
        self.published_ok: dict[tuple[str, int, int], bool] = {}
        self.resumes: dict[int, tuple[int, int | None]] = {}    # attempt n -> (step, mtime_ns) of its resume dir
        self._halt = threading.Event()
        self.lock = threading.Lock()

    def violation(self, msg: str) -> None:
        with self.lock:
            if msg not in self.violations:
                self.violations.append(msg)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(SAMPLE_S)
        self.sample()

    def sample(self) -> None:
        for part in (self._trainers, self._persistent, self._local, self._attempts):
            try:
                part()
            except Exception:  # noqa: BLE001 - a bug in the sampler must not pass silently
                self.violation(f"sampler error in {part.__name__}: {traceback.format_exc(limit=3)}")
        self.samples += 1

    # never two trainings at once
    def _trainers(self) -> None:
        found = {}
        for pid in marked_pids(self.rid):  # /proc/*/environ read raw: 20x faster than psutil.environ()
            try:
                p = psutil.Process(pid)
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                found[pid] = (p.ppid(), p.create_time(), " ".join(p.cmdline())[:160])
            except psutil.Error:
                continue
        roots = {pid: v for pid, v in found.items() if v[0] not in found}
        self.max_trainers = max(self.max_trainers, len(roots))
        if len(roots) > 1:
            self.violation(f"{len(roots)} trainings at once: " + "; ".join(f"pid {pid}: {v[2]}" for pid, v in roots.items()))
        now = time.time()
        for pid, v in roots.items():
            self.trainers.setdefault((pid, v[1]), now)

    # never a partial checkpoint visible in persistent_dir
    def _persistent(self) -> None:
        try:
            entries = list(os.scandir(self.persist))
        except FileNotFoundError:
            return
        if any(e.name.startswith(".partial-") for e in entries):
            self.partial_samples += 1
        for e in entries:
            if e.name.startswith("."):
                continue
            path = Path(e.path)
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            m = ck.CKPT_RE.fullmatch(e.name) or ck.MERGED_RE.fullmatch(e.name)
            key = (e.name, st.st_ino, st.st_mtime_ns)
            if key in self.published_ok:
                continue
            problems = check_published(path, self.hash, self.expect, self.backend) if m and path.is_dir() else \
                [f"unexpected entry {e.name} in persistent_dir"]
            if problems:
                try:  # replaced (republished) or removed while it was read: both are atomic renames
                    st2 = path.stat()
                    if (st2.st_ino, st2.st_mtime_ns) != (st.st_ino, st.st_mtime_ns):
                        continue
                except FileNotFoundError:
                    continue
                self.violation(f"persistent_dir/{e.name} visible but not a whole verified copy: {problems[:3]}")
            self.published_ok[key] = not problems

    # which local checkpoint versions are finished
    def _local(self) -> None:
        try:
            names = [e.name for e in os.scandir(self.out) if ck.CKPT_RE.fullmatch(e.name)]
        except FileNotFoundError:
            return
        link = link_step(self.out)
        for name in names:
            step = int(name.split("-")[1])
            try:
                mt = (self.out / name / ck.ITER_FILE).stat().st_mtime_ns
            except OSError:
                continue
            if (step, mt) in self.versions or link is None or link < step:
                continue
            if ck.verify(self.out / name, self.expect, backend=self.backend).ok:
                try:
                    if (self.out / name / ck.ITER_FILE).stat().st_mtime_ns != mt:
                        continue  # rewritten while verified: next sample
                except OSError:
                    continue
                self.versions[(step, mt)] = Version(step, mt, time.time())

    # never a resume from an invalid checkpoint
    def _attempts(self) -> None:
        got = read_journal(self.out)
        if got is None:
            return
        for a in got[0]:
            if a.n in self.resumes:
                continue
            if not a.resumed_from:
                self.resumes[a.n] = (0, None)
                continue
            p = Path(a.resumed_from)
            v = ck.verify(p, self.expect, backend=self.backend)
            if not v.ok:
                self.violation(f"attempt {a.n} resumed from {p.name}, which does not verify: {v.problems[:2]}")
            if v.step != a.start_step:
                self.violation(f"attempt {a.n}: start_step {a.start_step} but resumed_from is {p.name}")
            if p.parent != self.out:
                self.violation(f"attempt {a.n} resumed from {p}, outside output_dir {self.out}")
            m = mf.read_manifest(p)
            if m is not None and m.get("recipe_hash") != self.hash:
                self.violation(f"attempt {a.n} resumed from {p.name} of recipe {m.get('recipe_hash')}")
            try:
                mt = (p / ck.ITER_FILE).stat().st_mtime_ns
            except OSError:
                mt = None
            self.resumes[a.n] = (v.step if v.step is not None else -1, mt)


def check_published(path: Path, h: str, expect: ck.LoraExpect, backend: str) -> list[str]:
    m = mf.read_manifest(path)
    if m is None:
        return ["no readable manifest"]
    step = int(path.name.split("-")[1])
    problems = []
    if m.get("step") != step:
        problems.append(f"manifest step {m.get('step')}")
    if m.get("recipe_hash") != h:
        problems.append(f"manifest recipe_hash {m.get('recipe_hash')}")
    merged = ck.MERGED_RE.fullmatch(path.name) is not None
    v = ck.verify(path, None if merged else expect, backend=backend)
    problems += list(v.problems)
    problems += mf.manifest_matches(path, m)
    extra = set(mf.list_files(path)) - {f["path"] for f in m["files"]}
    problems += [f"{r}: not in the manifest" for r in sorted(extra)[:3]]
    return problems


# ------------------------------------------------------------------------------------------ one run

@dataclass
class Kill:
    what: str                  # supervisor | sync-cli | sync-worker
    kind: str
    group: bool
    state: str | None
    partial: bool              # a .partial-* staging dir existed at the kill
    copying: bool              # ... and the killed process (group) had an rsync running
    step: int
    at: float


@dataclass
class RunResult:
    plan: RunPlan
    exit_code: int | None = None
    duration_s: float = 0.0
    violations: list[str] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    attempts: int = 0
    fired: list[str] = field(default_factory=list)
    classified: Counter = field(default_factory=Counter)
    excused: Counter = field(default_factory=Counter)  # faults consumed by attempts a kill ended (unclassified)
    phantoms: int = 0
    shared_logs: int = 0       # attempts whose log also holds another trainer's output
    final_sync_skipped: bool = False  # FINAL_SYNC_SKIP_TOLERATED
    samples: int = 0
    partial_samples: int = 0
    max_trainers: int = 0
    sync_spawns: int = 0
    invalid_events: int = 0
    missed_events: list[Event] = field(default_factory=list)

    @property
    def interrupted_syncs(self) -> int:
        return sum(1 for k in self.kills if k.partial and k.copying)


class Run:
    def __init__(self, cfg: Config, plan: RunPlan, root: Path, wrapper: Path | None):
        self.cfg, self.plan, self.wrapper = cfg, plan, wrapper
        self.dir = root / plan.name
        self.dir.mkdir(parents=True)
        faults = ",".join(f.key for f in plan.faults)
        sup = {"wait_s": 0.01, "force_wait_s": 0.01, "nccl_settle_s": 0.01, "grace_s": 2, "poll_s": 0.05,
               "hang_timeout_s": cfg.hang_timeout_s if plan.hang_mode == "silent" else 30,
               "startup_timeout_s": 60, "max_crashes_per_hour": 10000, "max_relaunches_without_progress": 3}
        self.recipe = fake_recipe(self.dir, iterations=plan.iterations, save_steps=SAVE, faults=faults,
                                  supervisor=sup, extra_env={"FAKE_HANG_MODE": plan.hang_mode,
                                                             "FAKE_STEP_S": str(cfg.step_s)})
        r = load(self.recipe)
        self.hash = recipe_hash(r)
        self.out, self.persist = Path(r.run.output_dir), publish_dir(r.run.persistent_dir, r.run.name, self.hash)
        self.state_file = self.dir / "fake-state.json"
        self.expect = ck.LoraExpect(r.lora.rank, r.lora.alpha, tuple(r.lora.target_modules))
        self.env = dict(os.environ)
        if wrapper is not None:
            self.env["PATH"] = f"{wrapper}{os.pathsep}{self.env.get('PATH', '')}"
        self.res = RunResult(plan)
        self.sup: subprocess.Popen | None = None
        self.syncer: subprocess.Popen | None = None
        self.syncer_mode = ""
        self.starts = 0
        self.restarts: list[float] = []
        self.tail = StepTail(self.out / "logging.jsonl")
        self.log(f"plan: {len(plan.faults)} faults, {plan.iterations} steps, hang {plan.hang_mode}: "
                 + ",".join(f.key for f in plan.faults))
        self.log("events: " + ", ".join(f"{e.what}:{e.kind}{'/pg' if e.group else ''}@{e.arm_step}" for e in plan.events))

    def log(self, msg: str) -> None:
        if self.cfg.verbose:
            print(f"[{time.strftime('%H:%M:%S')}] {self.plan.name}: {msg}", flush=True)

    # --- processes
    def start_supervisor(self) -> None:
        self.starts += 1
        log = open(self.dir / f"supervisor-{self.starts:02d}.log", "wb")
        self.sup = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(self.recipe)], cwd=self.dir,
                                    env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        log.close()

    def kill(self, proc: subprocess.Popen, group: bool) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def spawn_sync(self, mode: str) -> subprocess.Popen:
        self.res.sync_spawns += 1
        if mode == "cli":
            argv = [sys.executable, "-m", "orchestrator", "sync", str(self.recipe), "--once"]
        else:
            argv = [sys.executable, str(HERE), "--sync-worker", str(self.recipe), "--bwlimit", str(self.cfg.bwlimit_kib)]
        return subprocess.Popen(argv, cwd=self.dir, env=self.env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    # --- the loop
    def execute(self) -> RunResult:
        t0 = time.monotonic()
        sampler = Sampler(self.out, self.persist, run_id(self.out), self.hash, self.expect, "megatron")
        sampler.start()
        # Two lanes, each with at most one armed event: supervisor kills and standalone-sync kills.
        queues = {lane: [e for e in self.plan.events if e.what == lane] for lane in ("supervisor", "sync")}
        armed: dict[str, tuple[Event, float, int]] = {}  # lane -> (event, armed at, attempt rows then)
        self.start_supervisor()
        try:
            while True:
                code = self.sup.poll()
                if code is not None:
                    self.res.exit_code = code
                    break
                if time.monotonic() - t0 > RUN_DEADLINE_S:
                    self.res.violations.append(f"run not finished after {RUN_DEADLINE_S:.0f} s")
                    self.kill(self.sup, group=True)
                    break
                step = self.tail.poll()
                for lane, queue in queues.items():
                    if lane not in armed and queue and step >= queue[0].arm_step:
                        ev = queue.pop(0)
                        if self._nan_fired() and not self.cfg.nan_anywhere:
                            self.res.missed_events.append(ev)
                            continue
                        got = read_journal(self.out)
                        armed[lane] = (ev, time.monotonic(), len(got[0]) if got else 0)
                        self.log(f"armed {ev.what}:{ev.kind} at step {step}")
                if not armed:
                    time.sleep(0.05)
                    continue
                if "supervisor" in armed:
                    ev, at, base = armed["supervisor"]
                    if self._supervisor_event(ev, base, time.monotonic() - at > EVENT_DEADLINE_S, step):
                        del armed["supervisor"]
                if "sync" in armed and self._sync_event(*armed["sync"][:2], step):
                    del armed["sync"]
                time.sleep(POLL_S)
        finally:
            if self.syncer is not None and self.syncer.poll() is None:
                self.kill(self.syncer, True)
            if self.sup.poll() is None:
                self.kill(self.sup, True)
            sampler.stop()
        self.res.missed_events += [a[0] for a in armed.values()] + [e for q in queues.values() for e in q]
        self.res.duration_s = time.monotonic() - t0
        self.res.violations += sampler.violations
        self.res.samples, self.res.partial_samples = sampler.samples, sampler.partial_samples
        self.res.max_trainers = sampler.max_trainers
        self._final_checks(sampler)
        return self.res

    def _sync_event(self, ev: Event, armed_at: float, step: int) -> bool:
        """Run a standalone sync until it copies into a staging dir, then SIGKILL it. True when done."""
        if self.syncer is None or self.syncer.poll() is not None:
            if time.monotonic() - armed_at > EVENT_DEADLINE_S:  # nothing left to copy, or the lock always taken
                self.res.missed_events.append(ev)
                self.syncer = None
                return True
            # A CLI sync that keeps finding the supervisor's sync holding the lock (it tries once and exits)
            # hands over to the worker, which retries the lock from one process.
            self.syncer_mode = ev.kind if time.monotonic() - armed_at < CLI_TRIES_S else "worker"
            self.syncer = self.spawn_sync(self.syncer_mode)
        if not (partials(self.persist) and rsync_children(self.syncer.pid) and partials(self.persist)):
            return False
        state = (read_journal(self.out) or ([], {}))[1].get("state")
        self.res.kills.append(Kill(f"sync-{self.syncer_mode}", "mid-copy", ev.group, state, True, True, step,
                                   time.time()))
        self.kill(self.syncer, ev.group)
        self.log(f"killed standalone sync ({self.syncer_mode}, {'group' if ev.group else 'pid'}) mid-copy: "
                 f"{partials(self.persist)}")
        self.syncer = None
        return True

    def _nan_fired(self) -> bool:
        return any(k.startswith("nan_loss@") for k in fired_faults(self.state_file))

    def _supervisor_event(self, ev: Event, base_attempts: int, late: bool, step: int) -> bool:
        got = read_journal(self.out)
        attempts, kv = got if got else ([], {})
        state = kv.get("state")
        part = partials(self.persist)
        copying = bool(part) and bool(rsync_children(self.sup.pid))
        if ev.kind == "running":
            now = state == "running"
        elif ev.kind == "launching":
            now = state in ("launching", "relaunching")
        elif ev.kind == "attempt_row":
            now = len(attempts) > base_attempts and attempts[-1].ended_at is None
        elif ev.kind == "recovery":
            now = state in RECOVERY_STATES
        else:
            now = copying
        if not (now or late):
            return False
        if self._nan_fired() and not self.cfg.nan_anywhere:
            self.res.missed_events.append(ev)
            return True
        kind = ev.kind + ("" if now else "/late")
        self.res.kills.append(Kill("supervisor", kind, ev.group, state, bool(part), copying, step, time.time()))
        self.kill(self.sup, ev.group)
        self.log(f"killed supervisor ({kind}{', group' if ev.group else ''}) in state {state}, "
                 f"attempts {len(attempts)}, partial {part}")
        self.restarts.append(time.time())
        self.start_supervisor()
        return True

    # --- after the run
    def _final_checks(self, sampler: Sampler) -> None:
        v, plan = self.res.violations, self.plan
        if self.res.exit_code != plan.expect_exit:
            v.append(f"supervisor exit {self.res.exit_code}, expected {int(plan.expect_exit)}")
        left = wait_for(lambda: not live_pids(marked_pids(run_id(self.out))), 10)
        if not left:
            v.append("trainer processes left after the supervisor exited")
        got = read_journal(self.out)
        if got is None:
            v.append("journal unreadable after the run")
            return
        attempts, kv = got
        self.res.attempts = len(attempts)
        self.res.fired = fired = fired_faults(self.state_file)
        self.res.invalid_events = len(journal_events(self.out, "checkpoint_invalid"))
        want = {f.key for f in plan.faults}
        if plan.expect_exit == ExitCode.GAVE_UP:  # nothing after `other` fires
            want = {f.key for f in plan.faults[:[f.cls for f in plan.faults].index(C.OTHER) + 1]}
        if set(fired) != want or len(fired) != len(set(fired)):
            v.append(f"faults fired {fired}, planned {sorted(want)}")
        self._check_classes(attempts, fired, sampler)
        self._check_resumes(attempts, sampler)
        if plan.expect_exit == ExitCode.OK:
            missing = set(range(1, plan.iterations + 1)) - logged_steps(self.out)
            if missing:
                v.append(f"logged steps miss {sorted(missing)[:10]}")
            if kv.get("state") != "completed":
                v.append(f"journal state {kv.get('state')} after exit 0")
            final = self.persist / f"checkpoint-{plan.iterations}"
            if not final.is_dir():
                probs = [e["message"] for e in journal_events(self.out, "sync_problem")][-3:]
                if FINAL_SYNC_SKIP_TOLERATED and probs and "another sync holds" in probs[-1]:
                    self.res.final_sync_skipped = True
                else:
                    v.append(f"final checkpoint-{plan.iterations} not published (sync problems: {probs})")
        else:
            last = attempts[-1] if attempts else None
            if not last or last.cls is not C.OTHER or kv.get("state") != "gave_up":
                v.append(f"expected to give up on `other`: last attempt {last and last.cls}, state {kv.get('state')}")
            elif "other" not in (kv.get("exit_reason") or ""):
                v.append(f"exit_reason {kv.get('exit_reason')!r} does not name class other")
        # whole-copy check of what is published now (the sampler checked each entry when it appeared)
        orphans_done = wait_for(lambda: not _rsyncs_into(self.persist), 30, 0.05)
        if orphans_done and plan.expect_exit == ExitCode.OK and partials(self.persist) and \
                not self.res.final_sync_skipped:
            v.append(f"staging dirs left in persistent_dir after the final sync: {partials(self.persist)}")
        for d in sorted(self.persist.iterdir()) if self.persist.exists() else []:
            if not d.name.startswith("."):
                probs = check_published(d, self.hash, self.expect, "megatron")
                if probs:
                    v.append(f"published {d.name} after the run: {probs[:3]}")

    def _check_classes(self, attempts: list[Attempt], fired: list[str], sampler: Sampler) -> None:
        """Align the attempts (in launch order, with trainers no attempt row knows about) with the faults in the
        order they fired: a classified attempt consumes exactly one fault of its class; an attempt ended by a
        supervisor kill, or an unrecorded trainer, consumes at most one; a completed attempt none."""
        v = self.res.violations
        known = {(a.pid, round(a.pid_start_time or 0)) for a in attempts}
        slots: list[tuple[float, str, C | None, int]] = []
        for a in attempts:
            restarted = any("supervisor restarted" in e for e in a.evidence)
            if attempt_log(a.log_path)[1] > 1:
                self.res.shared_logs += 1
                v.append(f"attempt {a.n}: its log {a.log_path} holds the output of more than one trainer")
            if a.cls is not None:
                slots.append((a.started_at, "classified", a.cls, a.n))
                if not a.evidence:
                    v.append(f"attempt {a.n} ({a.cls.value}) recorded no evidence")
            elif restarted or a.ended_at is None:
                slots.append((a.started_at, "excused", None, a.n))
            elif a.exit_code == 0:
                slots.append((a.started_at, "completed", None, a.n))
            else:
                v.append(f"attempt {a.n} ended (exit {a.exit_code}, signal {a.signal}) without a class")
        for pid, ctime in sampler.trainers:
            if (pid, round(ctime)) in known or any(pid == a.pid for a in attempts):
                continue
            # the row is written before the trainer starts: a supervisor killed in between leaves it without a pid
            if any(a.pid is None and a.started_at - 1 <= ctime <= (a.ended_at or float("inf")) for a in attempts):
                continue
            slots.append((ctime, "phantom", None, -pid))
            self.res.phantoms += 1
            v.append(f"trainer pid {pid} (started {time.strftime('%H:%M:%S', time.localtime(ctime))}) ran without "
                     f"an attempt row")
        slots.sort(key=lambda s: s[0])
        classes = [C(k.split("@")[0]) for k in fired]
        n, m = len(slots), len(classes)

        def reach(j: int) -> list[int]:
            """Where an excused attempt can leave the fault list, fewest faults first: a trainer orphaned by a
            killed supervisor trains on through NaNs (nobody stops it) until one more fault or its successor."""
            out, k = [j], j
            while k < m:
                out.append(k + 1)
                if classes[k] is not C.NAN_LOSS:
                    break
                k += 1
            return out

        ok = [[False] * (m + 1) for _ in range(n + 1)]
        ok[n][m] = True
        for i in range(n - 1, -1, -1):
            kind, cls = slots[i][1], slots[i][2]
            for j in range(m, -1, -1):
                if kind == "classified":
                    ok[i][j] = j < m and classes[j] is cls and ok[i + 1][j + 1]
                elif kind == "completed":
                    ok[i][j] = ok[i + 1][j]
                else:
                    ok[i][j] = any(ok[i + 1][t] for t in reach(j))
        if not ok[0][0]:
            rows = [f"{s[1]}:{s[2].value if s[2] else '-'}(#{s[3]})" for s in slots]
            v.append(f"classified attempts do not match the injected faults in order:\n    attempts {rows}\n"
                     f"    fired    {fired}")
            return
        i = j = 0  # walk one alignment for the counts (classified first, so excused consume as little as needed)
        while i < n:
            kind = slots[i][1]
            if kind == "classified":
                self.res.classified[slots[i][2].value] += 1
                j += 1
            elif kind != "completed":
                t = next(t for t in reach(j) if ok[i + 1][t])
                for c in classes[j:t]:
                    self.res.excused[c.value] += 1
                j = t
            i += 1
        # how the hangs and port clashes were handled
        by_n = {a.n: a for a in attempts}
        for a in attempts:
            if a.cls is C.NCCL_TIMEOUT_HANG:
                ev = " ".join(a.evidence)
                if self.plan.hang_mode == "silent" and not (a.hang_detected_at and "no new training step" in ev):
                    v.append(f"attempt {a.n}: silent hang not found by hang_timeout_s ({ev[:120]})")
                if self.plan.hang_mode == "watchdog" and "atchdog" not in ev:
                    v.append(f"attempt {a.n}: watchdog hang classified without the watchdog line ({ev[:120]})")
            nxt = by_n.get(a.n + 1)
            if a.cls is C.PORT_IN_USE and nxt and a.port == nxt.port and \
                    not any(a.started_at < t < nxt.started_at for t in self.restarts):
                v.append(f"attempt {a.n + 1} relaunched on the taken port {a.port}")

    def _check_resumes(self, attempts: list[Attempt], sampler: Sampler) -> None:
        """Each attempt starts from the newest finished checkpoint version that existed at its launch, minus the
        versions a NaN attempt wrote at or after its NaN; never from such a version; start steps never decrease;
        the first step an attempt logs is start_step + 1."""
        v = self.res.violations
        poisoned: list[tuple[int, float, float]] = []  # (nan step, attempt started_at, ended_at)
        quarantined = " ".join(e["message"] for e in journal_events(self.out, "quarantine"))
        prev_start = -1
        for a in attempts:
            steps, nan = attempt_steps(a.log_path)
            # a NaN attempt whose supervisor was killed before classifying it is quarantined by the successor
            if nan is not None and (a.cls is C.NAN_LOSS or f"nan-attempt-{a.n}" in quarantined):
                poisoned.append((nan, a.started_at, a.ended_at or time.time()))
            if steps and steps[0] != (a.start_step or 0) + 1:
                v.append(f"attempt {a.n} started at step {a.start_step} but first logged step {steps[0]}")
            start = a.start_step or 0
            if start < prev_start:
                v.append(f"attempt {a.n} went back to step {start} (attempt {a.n - 1} had started at {prev_start})")
            prev_start = max(prev_start, start)

            def bad(step: int, mtime_ns: int | None) -> bool:
                return mtime_ns is not None and any(step >= s and t0 * 1e9 <= mtime_ns <= t1 * 1e9
                                                    for s, t0, t1 in poisoned)
            latest: dict[int, Version] = {}
            for ver in sampler.versions.values():
                if ver.seen_at < a.started_at and (ver.step not in latest or ver.seen_at > latest[ver.step].seen_at):
                    latest[ver.step] = ver
            good = [s for s, ver in latest.items() if not bad(s, ver.mtime_ns)]
            lb = max(good, default=0)
            if start < lb:
                skipped = sorted(s for s, ver in latest.items() if bad(s, ver.mtime_ns))
                v.append(f"attempt {a.n} resumed from step {start} but checkpoint-{lb} was finished and verified "
                         f"before its launch" + (f" (versions poisoned by a NaN: {skipped})" if skipped else ""))
            step_mt = sampler.resumes.get(a.n)
            if step_mt and bad(*step_mt):
                v.append(f"attempt {a.n} resumed from checkpoint-{step_mt[0]}, written after the NaN of an earlier attempt")


def marked_pids(rid: str) -> list[int]:
    """Pids whose environment carries ORCHESTRATOR_RUN=<rid> (a zombie's environment reads empty)."""
    needle = f"{RUN_MARKER}={rid}\0".encode()
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if env.startswith(needle) or b"\0" + needle in env:
                found.append(int(d))
    return found


def live_pids(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


def _rsyncs_into(persist: Path) -> list[int]:
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "rsync" and any(str(persist) in c for c in p.info["cmdline"] or []):
            found.append(p.pid)
    return found


# ------------------------------------------------------------------------------------------ the soak

@dataclass
class Report:
    cfg: Config
    runs: list[RunResult]
    duration_s: float
    rsync: bool

    @property
    def violations(self) -> list[str]:
        return [f"{r.plan.name}: {v}" for r in self.runs for v in r.violations]

    @property
    def faults_injected(self) -> int:
        return sum(len(r.fired) for r in self.runs)

    @property
    def faults_classified(self) -> int:
        return sum(sum(r.classified.values()) for r in self.runs)

    @property
    def classes(self) -> Counter:
        return sum((r.classified for r in self.runs), Counter())

    @property
    def excused(self) -> Counter:
        return sum((r.excused for r in self.runs), Counter())

    @property
    def injected_classes(self) -> set[str]:
        return {k.split("@")[0] for r in self.runs for k in r.fired}

    @property
    def supervisor_kills(self) -> list[Kill]:
        return [k for r in self.runs for k in r.kills if k.what == "supervisor"]

    @property
    def sync_kills(self) -> list[Kill]:
        return [k for r in self.runs for k in r.kills if k.what != "supervisor"]

    @property
    def interrupted_syncs(self) -> int:
        return sum(r.interrupted_syncs for r in self.runs)

    def table(self) -> str:
        head = (f"{'run':<16}{'exit':>5}{'secs':>7}{'steps':>6}{'att':>5}{'fired':>6}{'class':>6}{'excsd':>6}"
                f"{'kill9':>6}{'synck':>6}{'intr':>5}{'samples':>8}{'partial':>8}{'maxtr':>6}  violations")
        lines = [f"chaos soak seed {self.cfg.seed}: {len(self.runs)} runs in {self.duration_s:.1f} s"
                 + ("" if self.rsync else " (no rsync: no slow copies)"), head, "-" * len(head)]
        for r in self.runs:
            sk = sum(1 for k in r.kills if k.what == "supervisor")
            lines.append(f"{r.plan.name:<16}{r.exit_code if r.exit_code is not None else '-':>5}{r.duration_s:>7.1f}"
                         f"{r.plan.iterations:>6}{r.attempts:>5}{len(r.fired):>6}{sum(r.classified.values()):>6}"
                         f"{sum(r.excused.values()):>6}{sk:>6}{len(r.kills) - sk:>6}{r.interrupted_syncs:>5}{r.samples:>8}"
                         f"{r.partial_samples:>8}{r.max_trainers:>6}  {len(r.violations)}")
        lines.append("-" * len(head))
        lines.append(f"faults injected {self.faults_injected}, classified as injected {self.faults_classified}, "
                     f"consumed by killed attempts {sum(sum(r.excused.values()) for r in self.runs)}, "
                     f"unrecorded trainers {sum(r.phantoms for r in self.runs)}, attempts sharing their log with one "
                     f"{sum(r.shared_logs for r in self.runs)}")
        lines.append("by class: " + ", ".join(f"{c} {n}" for c, n in sorted(self.classes.items())))
        kinds = Counter(k.kind for k in self.supervisor_kills)
        lines.append(f"supervisor kill -9: {len(self.supervisor_kills)} (" + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
                     + f"); standalone syncs killed mid-copy: {len(self.sync_kills)} "
                     f"(group {sum(k.group for k in self.sync_kills)}); interrupted syncs (partial + rsync copying "
                     f"at the kill): {self.interrupted_syncs}")
        skipped = [r.plan.name for r in self.runs if r.final_sync_skipped]
        if skipped:
            lines.append(f"final sync skipped for the lock (known bug, tolerated): {skipped}")
        missed = [e for r in self.runs for e in r.missed_events]
        if missed:
            lines.append(f"events not done: {[(e.what, e.kind, e.arm_step) for e in missed]}")
        inv = sum(r.invalid_events for r in self.runs)
        if inv:
            lines.append(f"checkpoint_invalid events (checkpoints cut short by a kill mid-save): {inv}")
        for msg in self.violations:
            lines.append(f"VIOLATION {msg}")
        return "\n".join(lines)


def soak(cfg: Config, workdir: Path) -> Report:
    t0 = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    wrapper = make_rsync_wrapper(workdir / "bin", cfg.bwlimit_kib)
    results = []
    for plan in plan_soak(cfg):
        results.append(Run(cfg, plan, workdir, wrapper).execute())
    return Report(cfg, results, time.monotonic() - t0, wrapper is not None)


# ------------------------------------------------------------------------------------------ CLI

def sync_worker(recipe: str, bwlimit: int, deadline_s: float = 120) -> None:
    """Publish with sync.sync_once(bwlimit_kib=...) until killed: what the harness interrupts mid-copy."""
    from orchestrator.store import sync
    from orchestrator.store.publisher import _sync_args
    r = load(Path(recipe))
    args = _sync_args(r, recipe_hash(r))
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        res = sync.sync_once(**args, bwlimit_kib=bwlimit)
        if not res.copied:
            time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=textwrap.dedent(__doc__.split("\n\n", 2)[2]))
    ap.add_argument("--full", action="store_true", help="the full soak: 200 faults, 20 + 20 kills, 4 + 4 runs")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--faults", type=int)
    ap.add_argument("--supervisor-kills", type=int)
    ap.add_argument("--sync-kills", type=int)
    ap.add_argument("--runs", type=int)
    ap.add_argument("--other-runs", type=int)
    ap.add_argument("--nan-last", action="store_true", help="nan_loss as each run's last cluster, no kill after it")
    ap.add_argument("--workdir", type=Path, help="keep the runs here (default: a temp dir, removed if all is well)")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--sync-worker", metavar="RECIPE", help=argparse.SUPPRESS)
    ap.add_argument("--bwlimit", type=int, default=128, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.sync_worker:
        sync_worker(a.sync_worker, a.bwlimit)
        return 0
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    cfg = Config.full(seed) if a.full or os.environ.get("ORCH_CHAOS_FULL") == "1" else Config.ci(seed)
    over = {"faults": a.faults, "supervisor_kills": a.supervisor_kills, "sync_kills": a.sync_kills, "runs": a.runs,
            "other_runs": a.other_runs}
    cfg = replace(cfg, **{k: v for k, v in over.items() if v is not None}, nan_anywhere=not a.nan_last,
                  verbose=a.verbose)
    work = a.workdir or Path(tempfile.mkdtemp(prefix=f"chaos-{seed}-"))
    print(f"chaos soak: seed {seed}, workdir {work}", flush=True)
    rep = soak(cfg, work)
    print(rep.table())
    if rep.violations:
        print(f"FAILED (seed {seed}); runs kept in {work}")
        return 1
    if a.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
