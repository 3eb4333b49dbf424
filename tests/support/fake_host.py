"""An in-memory Host (orchestrator/host/base.py) with a fake clock, for table tests of the state machine.

Nothing runs and no time passes except what the loop asks for: a wait advances the fake clock. A
test scripts the world: what a trainer writes and when it exits (`FakeTrainer`), GPU holders, taken
ports, free disk, leftovers. Every call the loop makes is recorded in `calls` as (name, args).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from orchestrator.types import (Command, DiskSpace, ExitStatus, GpuInfo, GpuProcess, GpuSnapshot, SlowdownEvidence,
                                SystemEvidence)

T0 = 1_700_000_000.0
MIB = 1024**2
GIB = 1024**3


@dataclass
class FakeTrainer:
    pid: int
    create_time: float
    log_path: Path
    started_at: float
    started_mono: float
    cmd: Command
    status: ExitStatus | None = None
    obeys_sigterm: bool = True

    def write(self, *lines: str) -> None:
        with open(self.log_path, "a") as f:
            f.writelines(line + "\n" for line in lines)

    def steps(self, first: int, last: int, max_steps: int, loss: float = 1.0) -> None:
        """ms-swift's stdout progress dicts for steps first..last."""
        self.write(*(str({"loss": f"{loss:.4g}", "grad_norm": "0.5", "learning_rate": "1e-4",
                          "global_step/max_steps": f"{s}/{max_steps}"}) for s in range(first, last + 1)))

    def exit(self, code: int | None = None, signal: int | None = None) -> None:
        self.status = ExitStatus(code=code, signal=signal)


@dataclass
class FakeHost:
    mono: float = 0.0
    gpu_count: int = 8
    holders: dict[int, list[int]] = field(default_factory=dict)   # GPU index -> pids holding it
    cmdlines: dict[int, str] = field(default_factory=dict)
    leftover_pids: list[int] = field(default_factory=list)
    taken_ports: set[int] = field(default_factory=set)
    free: float = 1000.0                                           # GiB free on every path not in free_at
    free_at: dict[str, float] = field(default_factory=dict)        # GiB free on these paths
    calls: list[tuple] = field(default_factory=list)
    trainers: list[FakeTrainer] = field(default_factory=list)
    on_wait: object = None   # callable(host, seconds): the world moves while the loop waits
    last_write: float | None = None   # wall time of the newest checkpoint file write (a save in progress)
    shm: dict[str, list[int]] = field(default_factory=dict)        # the run's NCCL segments -> pids mapping them
    warming: list[Path] | None = None                              # files being read into the page cache
    system: SystemEvidence | None = None   # scripted evidence at the crash (disks follow `free` unless given)
    slowdown: SlowdownEvidence | None = None   # scripted evidence at a throughput drop

    # --- clock
    def now(self) -> float:
        return T0 + self.mono

    def monotonic(self) -> float:
        return self.mono

    def _pass(self, seconds: float) -> None:
        self.mono += max(0.0, seconds)
        if self.on_wait:
            self.on_wait(self, seconds)

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        self.calls.append(("wait", round(timeout_s, 3)))
        if not event.is_set():
            self._pass(timeout_s)
        return event.is_set()

    def wait_exit(self, trainer: FakeTrainer, timeout_s: float) -> bool:
        if trainer.status is None:
            self._pass(timeout_s)
        return trainer.status is not None

    # --- processes
    def launch(self, cmd: Command, log_path: Path, run_id: str, cwd: str) -> FakeTrainer:
        self.stop_warming()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.touch()
        t = FakeTrainer(4000 + len(self.trainers), self.now(), log_path, self.now(), self.mono, cmd)
        self.trainers.append(t)
        self.calls.append(("launch", t.pid))
        return t

    def terminate(self, run_id: str, pgids: set[int], grace_s: float) -> list[int]:
        self.calls.append(("terminate", tuple(sorted(pgids))))
        killed = []
        for t in self.trainers:
            if t.status is None and t.pid in pgids:
                if t.obeys_sigterm:
                    t.exit(signal=15)
                else:
                    t.exit(signal=9)
                    killed.append(t.pid)
        killed += self.leftover_pids
        self.leftover_pids = []
        return killed

    def leftovers(self, run_id: str) -> list[int]:
        return list(self.leftover_pids)

    def alive(self, pid: int, create_time: float | None) -> bool:
        return any(t.pid == pid and t.status is None for t in self.trainers)

    def cmdline(self, pid: int) -> str:
        return self.cmdlines.get(pid, "")

    def kill(self, pids: list[int]) -> None:
        self.calls.append(("kill", tuple(pids)))
        self.leftover_pids = [p for p in self.leftover_pids if p not in pids]
        self.holders = {i: [p for p in ps if p not in pids] for i, ps in self.holders.items()}

    def dump_stacks(self, root_pid: int, out: Path) -> None:
        self.calls.append(("dump_stacks", root_pid))

    def read_tail(self, path: Path) -> str:
        return Path(path).read_text()

    def newest_write(self, output_dir: Path) -> float | None:
        self.calls.append(("newest_write",))
        return self.last_write

    def failure_log(self, trainer: FakeTrainer) -> tuple[str, str | None]:
        return self.read_tail(trainer.log_path), None

    # --- resources

    def gpu_snapshot(self) -> GpuSnapshot:
        self.calls.append(("gpu_snapshot",))
        return GpuSnapshot(tuple(
            GpuInfo(i, "Fake H200", 141 * 1024 * MIB, (70_000 * MIB if self.holders.get(i) else 0),
                    tuple(GpuProcess(p, 70_000 * MIB) for p in self.holders.get(i, [])))
            for i in range(self.gpu_count)))

    # a multi-node job (SlurmHost): scripted by setting job_nodes / node_problems; exclude_node is recorded
    def nodes(self) -> tuple[str, ...]:
        return getattr(self, "job_nodes", ())

    def node_gpu_problems(self, ids: list[int | str], threshold_mib: int) -> dict[str, list[str]]:
        return dict(getattr(self, "node_problems", {}))

    def exclude_node(self, node: str) -> str:
        self.calls.append(("exclude_node", node))
        return node

    def port_free(self, port: int) -> bool:
        return port not in self.taken_ports

    def free_gib(self, path: str) -> float:
        self.calls.append(("free_gib", path))
        return self.free_at.get(path, self.free)

    def shm_segments(self, run_id: str) -> dict[str, list[int]]:
        self.calls.append(("shm_segments",))
        return {k: list(v) for k, v in self.shm.items()}

    def remove_shm(self, names: list[str]) -> None:
        self.calls.append(("remove_shm", tuple(names)))
        for n in names:
            self.shm.pop(n, None)

    def warm_page_cache(self, files: list[Path]) -> None:
        self.calls.append(("warm_page_cache", len(files)))
        self.warming = list(files)

    def stop_warming(self) -> int:
        if self.warming is None:
            return 0
        self.calls.append(("stop_warming",))
        self.warming = None
        return 1

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    # --- evidence
    def evidence_baseline(self, trainer: FakeTrainer, run_id: str, gpus: list[int | str]) -> None:
        self.calls.append(("evidence_baseline", trainer.pid))

    def evidence(self, trainer: FakeTrainer, paths: dict[str, str], port: int | None) -> SystemEvidence:
        self.calls.append(("evidence", trainer.pid, port))
        s = self.system or SystemEvidence(kernel_log="fake kmsg")
        if not s.disks:
            s = replace(s, disks=tuple(DiskSpace(role, p, int(self.free_at.get(p, self.free) * GIB), 2000 * GIB, 10**6)
                                       for role, p in paths.items()))
        return s

    def slowdown_evidence(self, trainer: FakeTrainer) -> SlowdownEvidence:
        self.calls.append(("slowdown_evidence", trainer.pid))
        return self.slowdown or SlowdownEvidence(self.now(), unavailable=("NVML: not available: fake host",))
