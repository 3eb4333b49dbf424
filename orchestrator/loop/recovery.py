"""The states between two attempts, and what the loop does the moment it sees one fail:

    VERIFYING        GPUs clear? else own leftovers (+ kill_patterns) stopped, force_wait_s, again; a node
                     that stays bad is excluded (Slurm); still not clear -> stay with backoff
    (a failure)      crashed(): classify the log unless the loop saw the cause itself, then what the machine
                     says (verdict.combine)                                   -> CRASHED
    CRASHED          policy.decide on the classified crash                    -> CLEANING
    CLEANING         SIGTERM the group, grace, SIGKILL leftovers; the set-asides the verdict requested (a NaN's:
                     the checkpoints written at or after it) moved                                             -> WAITING | BACKOFF | GAVE_UP
    WAITING/BACKOFF  verified-ready (processes, GPU memory, NCCL segments, a port; wait_s the bound) or the
                     fixed wait; disk_full waits for space                    -> VERIFYING
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, replace

from orchestrator.domain import classify, policy, verdict
from orchestrator.host import pagecache
from orchestrator.host.base import Host
from orchestrator.host.metrics import Metrics
from orchestrator.host.probe import first_free_port
from orchestrator.loop.attempt import AttemptWatch
from orchestrator.loop.gpu_gate import GpuGate
from orchestrator.loop.run import RunContext
from orchestrator.loop.ticker import Ticker
from orchestrator.types import GIB, Action, Alert, Crash, CrashClass, State


class Recovery:
    def __init__(self, ctx: RunContext, host: Host, gpus: GpuGate, metrics: Metrics, ticker: Ticker,
                 stop_event: threading.Event, request_stop: Callable[[str], None]):
        self.ctx, self.recipe, self.host, self.gpus, self.metrics = ctx, ctx.recipe, host, gpus, metrics
        self.ticker, self.stop_event, self.request_stop = ticker, stop_event, request_stop
        self.journal = ctx.journal
        self.history = ctx.history          # the crash policy's memory, one crash more after each decision
        self.gpu_backoff_s = 0.0

    def verify_gpus(self, relaunch: bool) -> State:
        """VERIFYING: the run's GPUs clear -> (RE)LAUNCHING; else clear what may be cleared, and stay."""
        if self.stop_event.is_set():
            return State.STOPPED
        if self.gpus.exclude_stuck_node(self.journal):  # multi-node: the job was requeued without a bad node
            self.request_stop("a bad node was excluded and the Slurm job requeued")
            return State.STOPPED
        launch = State.RELAUNCHING if relaunch else State.LAUNCHING
        if not self.recipe.gpu.check:
            return launch
        with self.ticker.span("verify"):
            snap = self.host.gpu_snapshot()
            clear, problems = self.gpus.verdict(snap)
            if not clear:
                self.gpus.clear(snap, problems, self.ctx.run_id, self.journal)
                self.ticker.sleep(self.recipe.supervisor.force_wait_s)
                clear, problems = self.gpus.verdict(self.host.gpu_snapshot())
        if clear:
            self.gpu_backoff_s = 0.0
            return launch
        s = self.recipe.supervisor
        self.gpu_backoff_s = min(s.backoff_max_s, max(self.gpu_backoff_s * 2, s.force_wait_s, 1.0))
        self.journal.event("gpus_not_clear", "; ".join(problems), retry_in_s=self.gpu_backoff_s)
        with self.ticker.span("verify"):  # waiting for the GPUs to clear is verification time, not `other`
            self.ticker.sleep(self.gpu_backoff_s)
        return State.VERIFYING

    def crashed(self, a: AttemptWatch, found: Crash | None) -> State:
        """Names the attempt's failure: `found` when the loop saw it itself (hang, NaN, a full disk), else the
        classified log; then what the machine says (verdict.combine): a disk full at the crash, a GPU fault, a
        kernel OOM kill outrank the log."""
        r = self.recipe
        if found is None:
            text, node = self.host.failure_log(a.launched)  # multi-node: the node srun saw fail first
            if node:
                a.row = replace(a.row, node=node)
            status = a.launched.status
            assert status is not None, "only an exited attempt's log is classified"
            found = classify.classify(text, status, a.phase)
            if status.code == 0 and found.cls is CrashClass.OTHER:
                last = a.last.step if a.last else None
                found = Crash(CrashClass.OTHER, (f"trainer exited 0 at step {last} before max steps",) + found.evidence,
                              found.phase)
        paths = {"output_dir": r.run.output_dir, "/dev/shm": "/dev/shm"} | (
            {"persistent_dir": r.run.persistent_dir} if r.run.persistent_dir else {})
        system = self.host.evidence(a.launched, paths, a.port if found.cls is CrashClass.PORT_IN_USE else None)
        crash = verdict.combine(found, a.launched.status, system, min(r.supervisor.min_free_gib, 1.0))
        if facts := crash.evidence[:len(crash.evidence) - len(found.evidence)]:
            self.journal.event("evidence", f"attempt {a.n}: " + "; ".join(facts))
        a.row = replace(a.row, system=asdict(system))  # kept by the row's finish
        a.crash = crash
        return State.CRASHED

    def decide(self, a: AttemptWatch) -> State:
        """CRASHED: the policy's decision on the classified crash, recorded and counted."""
        assert a.crash is not None
        now = self.host.now()
        progressed = self.ctx.checkpoints.newest_good_step() > a.good_step_at_launch
        shm_total = next((d["total_bytes"] / GIB for d in (a.row.system or {}).get("disks", []) if d["role"] == "/dev/shm"),
                         None)
        a.decision = policy.decide(a.crash, self.history, self.recipe.supervisor, now, progressed, shm_total)
        self.history = policy.next_history(self.history, a.crash, now, progressed)
        self.metrics.crash(a.crash.cls)
        self.journal.event("crash", f"attempt {a.n}: {a.crash.cls.value} -> {a.decision.action.value}:"
                           f" {a.decision.reason}", evidence=list(a.crash.evidence))
        if a.decision.alert:
            self.metrics.alert(a.decision.alert, True)
        return State.CLEANING

    def clean(self, a: AttemptWatch) -> State:
        """CLEANING: the attempt's processes stopped and its row finished; what the verdict set aside (a NaN's
        checkpoints) moved, now that no trainer writes them."""
        assert a.crash is not None and a.decision is not None
        with self.ticker.span("cleanup"):
            killed = self.host.terminate(self.ctx.run_id, {a.launched.pid}, self.recipe.supervisor.grace_s)
            if killed:
                self.journal.event("cleanup", f"SIGKILLed {len(killed)} process(es) that ignored SIGTERM", pids=killed)
            a.finish(self.journal, self.host, a.crash)
            self.ctx.apply_set_asides()
        if a.decision.action is Action.GIVE_UP:
            return State.GAVE_UP
        return State.BACKOFF if a.decision.backoff_s else State.WAITING

    def wait(self, a: AttemptWatch) -> State:
        """WAITING/BACKOFF. `supervisor.wait = "verified"`: relaunch as soon as the run's processes, GPU memory,
        NCCL segments and a port are clear (wait_s the upper bound, nccl_settle_s the floor after nccl_*);
        "fixed": wait_s, the field's blind wait. A crash-loop backoff is always waited in full. The weight
        files are read into the page cache meanwhile. The whole wait is one goodput span, however it ends."""
        assert a.crash is not None and a.decision is not None
        s, d = self.recipe.supervisor, a.decision
        with self.ticker.span("backoff" if d.backoff_s else "wait"):
            mono = self.host.monotonic()
            verified = s.wait == "verified" and d.action is Action.RELAUNCH
            self.host.warm_page_cache(pagecache.weight_files(self.recipe.model.path))
            if self.ticker.sleep(d.backoff_s if verified else d.wait_s + d.backoff_s):
                return State.STOPPED
            waited_for: tuple[str, ...] = ()
            if verified:
                ready = self._await_ready(policy.settle_floor(a.crash.cls, s), d.wait_s)
                if ready is None:
                    return State.STOPPED
                waited_for = ready.waiting_for
            if d.action is Action.WAIT_FOR_SPACE and not self._space_back(a.crash):
                return State.WAITING
            took = self.host.monotonic() - mono
        self.journal.event("wait", f"{'verified' if verified else 'fixed'} wait {took:.2f} s"
                           + (f" (upper bound reached; still: {'; '.join(waited_for)})" if waited_for else ""),
                           mode="verified" if verified else "fixed", seconds=round(took, 3),
                           bound_s=d.wait_s, backoff_s=d.backoff_s, not_clear=list(waited_for))
        self.ticker.housekeeping()
        return State.VERIFYING

    def _space_back(self, crash: Crash) -> bool:
        """disk_full: frees what the run may free and tells whether enough is free again: on /dev/shm, the run's
        NCCL segments nobody maps are removed and SHM_MIN_GIB must be free; on output_dir, the manifests a full
        disk refused are retried, checkpoints pruned, and min_free_gib must be free."""
        if policy.shared_memory_full(crash):
            self._remove_orphan_segments()
            out, need = "/dev/shm", policy.SHM_MIN_GIB
        else:
            checkpoints, out = self.ctx.checkpoints, self.recipe.run.output_dir
            checkpoints.retry_manifests()  # a full disk refused them; unpublished copies wait for them
            checkpoints.prune(self.ctx.keep_local, pressure=True, writing=False)  # torn saves, what was published
            need = self.recipe.supervisor.min_free_gib
        free = self.host.free_gib(out)
        if free < need:
            self.journal.event("disk_full", f"{out}: {free:.1f} GiB free, waiting for {need:g}")
            self.ticker.housekeeping()
            return False
        self.metrics.alert(Alert.DISK_FULL, False)
        return True

    def _remove_orphan_segments(self) -> dict[str, list[int]]:
        """Removes the run's NCCL shm segments nobody maps (a SIGKILLed rank's: no wait frees them) and returns
        the rest with the pids that map them."""
        shm = self.host.shm_segments(self.ctx.run_id)
        if orphans := sorted(n for n, pids in shm.items() if not pids):
            self.host.remove_shm(orphans)
            self.journal.event("cleanup", f"removed {len(orphans)} NCCL shm segment(s) nobody maps", names=orphans)
        return {n: pids for n, pids in shm.items() if pids}

    def _await_ready(self, floor_s: float, bound_s: float) -> policy.Readiness | None:
        """Polls the host until policy.readiness_verdict says go; None when a stop cut it short."""
        run = self.ctx.run_id
        begun, lo, hi = self.host.monotonic(), *self.recipe.supervisor.port_range
        while True:
            shm = self._remove_orphan_segments()
            gpu_problems = self.gpus.verdict(self.host.gpu_snapshot())[1] if self.recipe.gpu.check else []
            ready = policy.readiness_verdict(
                self.host.monotonic() - begun, floor_s, bound_s, self.host.leftovers(run), gpu_problems, shm,
                first_free_port(lo, hi, is_free=self.host.port_free) is not None)
            if ready.go:
                return ready
            if self.ticker.sleep(ready.recheck_s):
                return None
