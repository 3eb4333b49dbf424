"""The supervisor's one interface to the world: processes, GPUs, ports, disk and the clock.

The loop (supervisor.py) does nothing to the machine except through a `Host`, so its state machine
is table-tested with an in-memory host and a fake clock (tests/support/fake_host.py). `LocalHost` is the
real thing for one node; a Slurm launcher becomes a second implementation of the launch part.

Time: `now()` is wall-clock time, for what is recorded (journal, metrics); `monotonic()` measures
durations (hang detection, waits), so a wall-clock step never fakes a hang or cuts a wait short.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Protocol

from orchestrator.host import evidence, gpu, pagecache, shm, slowdown_evidence
from orchestrator.host.launch import local as launcher
from orchestrator.host.probe import free_gib, port_free
from orchestrator.types import Command, ExitStatus, GpuSnapshot, SlowdownEvidence, SystemEvidence


class Trainer(Protocol):
    """A launched trainer, as the loop sees it. `status` is set once it has exited."""

    @property
    def pid(self) -> int: ...
    create_time: float
    log_path: Path
    started_at: float        # wall clock
    started_mono: float      # monotonic, for the startup timeout
    status: ExitStatus | None


class Host(Protocol):
    # --- clock
    def now(self) -> float: ...
    def monotonic(self) -> float: ...
    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        """Sleep up to timeout_s, woken early by `event`; returns event.is_set()."""
    def wait_exit(self, trainer: Trainer, timeout_s: float) -> bool:
        """Wait up to timeout_s for the trainer to exit (wakes at once when it does)."""

    # --- processes
    def launch(self, cmd: Command, log_path: Path, run_id: str, cwd: str) -> Trainer:
        """Start the trainer in its own session, output to log_path; launcher.LaunchError if it cannot start."""
    def terminate(self, run_id: str, pgids: set[int], grace_s: float) -> list[int]:
        """SIGTERM the run's processes, grace, SIGKILL what is left; returns the SIGKILLed pids."""
    def leftovers(self, run_id: str) -> list[int]:
        """Live pids carrying this run's marker (re-parented descendants included)."""
    def alive(self, pid: int, create_time: float | None) -> bool: ...
    def cmdline(self, pid: int) -> str: ...
    def kill(self, pids: list[int]) -> None: ...
    def dump_stacks(self, root_pid: int, out: Path) -> None: ...
    def read_tail(self, path: Path) -> str: ...
    def newest_write(self, output_dir: Path) -> float | None:
        """Wall time of the newest file write under output_dir's checkpoint directories (a save in progress)."""
    def failure_log(self, trainer: Trainer) -> tuple[str, str | None]:
        """The text to classify a failed attempt from, and the node that failed first (None: one node)."""

    # --- resources
    def gpu_snapshot(self) -> GpuSnapshot: ...
    # --- the other nodes of a multi-node job (one node: none, {}; SlurmHost: the allocation)
    def nodes(self) -> tuple[str, ...]:
        """The job's nodes an attempt runs on; () on one node."""
    def node_gpu_problems(self, ids: list[int | str], threshold_mib: int) -> dict[str, list[str]]:
        """Every node's GPU verdict in one parallel check: problems per node not clear; {} on one node."""
    def exclude_node(self, node: str) -> str:
        """Requeue this Slurm job without `node`; returns the job's excluded nodes. Raises where it cannot."""
    def port_free(self, port: int) -> bool: ...
    def free_gib(self, path: str) -> float: ...
    def shm_segments(self, run_id: str) -> dict[str, list[int]]:
        """The run's NCCL shared-memory segments in /dev/shm, each with the live pids mapping or holding it."""
    def remove_shm(self, names: list[str]) -> None:
        """Unlink segments nobody maps any more (what a SIGKILLed NCCL never got to unlink)."""
    def warm_page_cache(self, files: list[Path]) -> None:
        """Start reading `files` into the page cache in the background (bounded by available memory)."""
    def stop_warming(self) -> int:
        """Stop the warm-up; returns the bytes it asked the kernel to read."""

    # --- evidence about a failed attempt (evidence.py reads it, verdict.py weighs it)
    def evidence_baseline(self, trainer: Trainer, run_id: str, gpus: list[int | str]) -> None:
        """At launch: counters to compare against later, and a reader of the run's pids and GPU events."""
    def evidence(self, trainer: Trainer, paths: dict[str, str], port: int | None) -> SystemEvidence:
        """At the crash: kernel OOM kills of the run's processes since launch, cgroup oom_kill, Xid/ECC on the
        run's GPUs, free space of `paths` (role -> path), the owner of `port` (None: not asked). Never raises."""
    def slowdown_evidence(self, trainer: Trainer) -> SlowdownEvidence:
        """At a throughput drop: the run's GPUs (clocks, throttle reasons, temperature, power, ECC, PCIe
        replays, Xids), host CPU busy/steal/iowait, memory pressure and swap, the trainer's cgroup CPU
        throttling. Blocks about half a second (rates need two reads). Never raises."""


class LocalHost:
    """This machine: today's launcher, NVML reader, sockets and statvfs."""

    def __init__(self, gpu_reader: gpu.GpuReader, shm_dir: str = shm.SHM_DIR) -> None:
        self.gpus = gpu_reader
        self.shm_dir = shm_dir
        self.first_launch: dict[str, float] = {}   # run id -> wall time of its first launch here
        self.warmer: pagecache.Warmer | None = None
        self.watches: dict[int, evidence.AttemptEvidence] = {}   # trainer pid -> its evidence since launch

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        return event.wait(max(0.0, timeout_s))

    def wait_exit(self, trainer: launcher.Launched, timeout_s: float) -> bool:
        return trainer.exited.wait(max(0.0, timeout_s))

    def launch(self, cmd: Command, log_path: Path, run_id: str, cwd: str) -> launcher.Launched:
        self.stop_warming()  # the trainer's own reads come first
        self.first_launch.setdefault(run_id, time.time())
        return launcher.launch(cmd, log_path, run_id, cwd=cwd)

    def terminate(self, run_id: str, pgids: set[int], grace_s: float) -> list[int]:
        return launcher.terminate(run_id, pgids, grace_s)

    def leftovers(self, run_id: str) -> list[int]:
        return [p.pid for p in launcher.run_processes(run_id)]

    def alive(self, pid: int, create_time: float | None) -> bool:
        return launcher.same_process(pid, create_time)

    def cmdline(self, pid: int) -> str:
        return launcher.cmdline(pid)

    def kill(self, pids: list[int]) -> None:
        launcher.kill_pids(pids)

    def dump_stacks(self, root_pid: int, out: Path) -> None:
        launcher.dump_stacks([p.pid for p in launcher.tree(root_pid)], out)

    def read_tail(self, path: Path) -> str:
        return launcher.read_tail(path)

    def newest_write(self, output_dir: Path) -> float | None:
        newest = None
        for d in Path(output_dir).glob("checkpoint-*"):
            for root, _dirs, files in os.walk(d):
                for f in files:
                    try:
                        m = os.stat(os.path.join(root, f)).st_mtime
                    except OSError:
                        continue
                    newest = m if newest is None else max(newest, m)
        return newest

    def failure_log(self, trainer: launcher.Launched) -> tuple[str, str | None]:
        return launcher.read_tail(trainer.log_path), None

    def gpu_snapshot(self) -> GpuSnapshot:
        return self.gpus.snapshot()

    def nodes(self) -> tuple[str, ...]:
        return ()

    def node_gpu_problems(self, ids: list[int | str], threshold_mib: int) -> dict[str, list[str]]:
        return {}

    def exclude_node(self, node: str) -> str:
        raise RuntimeError("one node: no Slurm job to requeue")

    def port_free(self, port: int, host: str = "127.0.0.1") -> bool:
        return port_free(port, host)

    def free_gib(self, path: str) -> float:
        return free_gib(path)

    def shm_segments(self, run_id: str) -> dict[str, list[int]]:
        return shm.run_segments(self.shm_dir, {p.pid for p in launcher.run_processes(run_id)},
                                self.first_launch.get(run_id))

    def remove_shm(self, names: list[str]) -> None:
        shm.remove(self.shm_dir, names)

    def warm_page_cache(self, files: list[Path]) -> None:
        self.stop_warming()
        self.warmer = pagecache.Warmer(files)
        self.warmer.start()

    def stop_warming(self) -> int:
        w, self.warmer = self.warmer, None
        return w.stop() if w else 0

    def evidence_baseline(self, trainer: launcher.Launched, run_id: str, gpus: list[int | str]) -> None:
        self.watches = {pid: w for pid, w in self.watches.items() if not w.done.is_set() and w.running()}
        try:
            self.watches[trainer.pid] = evidence.AttemptEvidence(
                trainer.pid, run_id, trainer.started_mono - 1.0, lambda: trainer.status is None,
                nv=evidence.load_nvml() if gpus else None, gpus=gpus)
        except Exception:  # evidence must never cost the run; evidence() says it is missing
            pass

    def evidence(self, trainer: launcher.Launched, paths: dict[str, str], port: int | None) -> SystemEvidence:
        watch = self.watches.pop(trainer.pid, None)
        try:
            if watch is not None:
                return watch.collect(paths, port)
        except Exception as e:
            missing = f"evidence: not available: {e!r}"
        else:
            missing = "kernel log, cgroup, NVML: not available: no baseline was taken at launch"
        disks, why = evidence.disk_space(paths)
        owners, why_port = evidence.port_owners(port) if port is not None else ([], [])
        return SystemEvidence(disks=tuple(disks), port_owners=tuple(owners), unavailable=(missing, *why, *why_port))

    def slowdown_evidence(self, trainer: launcher.Launched) -> SlowdownEvidence:
        watch = self.watches.get(trainer.pid)
        nvml = watch.nvml if watch is not None else None
        gpus, why = None, "no evidence watch for this attempt"
        if watch is not None and nvml is None:
            why = next((w.split(": not available: ", 1)[-1] for w in watch.unavailable if w.startswith("NVML")),
                       "not read")
        elif nvml is not None and nvml.error:
            why = nvml.error.split(": not available: ", 1)[-1]
        elif nvml is not None:
            try:
                gpus = slowdown_evidence.gpu_health(nvml.nv, nvml.handles, list(nvml.xids))
            except Exception as e:  # evidence must never cost the run
                why = repr(e)
        try:
            pids = [p.pid for p in launcher.tree(trainer.pid)] or [trainer.pid]
            return slowdown_evidence.read(pids, gpus=gpus, gpu_why=why)
        except Exception as e:
            return SlowdownEvidence(time.time(), unavailable=(f"slowdown evidence: not available: {e!r}",))
