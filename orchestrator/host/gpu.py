"""GPUs through NVML, behind a one-method protocol; a null reader where no driver exists.

`clear_verdict` is the pure decision "may we launch onto these GPUs?"; the readers are the only
code that talks to the driver.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from orchestrator.types import GpuInfo, GpuProcess, GpuSnapshot

MIB = 1024**2


class GpuReader(Protocol):
    def snapshot(self) -> GpuSnapshot: ...


class NullReader:
    """GPU checks disabled (gpu.check = false): a blind reader must say so, not look healthy."""

    def __init__(self, reason: str = "GPU checks disabled in the recipe (gpu.check = false)"):
        self.reason = reason

    def snapshot(self) -> GpuSnapshot:
        return GpuSnapshot(error=self.reason)


class NvmlReader:
    def __init__(self) -> None:
        self._ready = False

    def _init(self):
        import pynvml  # nvidia-ml-py

        if not self._ready:
            pynvml.nvmlInit()
            self._ready = True
        return pynvml

    def snapshot(self) -> GpuSnapshot:
        try:
            nv = self._init()
            gpus = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                name = nv.nvmlDeviceGetName(h)
                procs = []
                for getter in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
                    try:
                        procs += [GpuProcess(p.pid, p.usedGpuMemory) for p in getter(h)]
                    except nv.NVMLError:
                        pass
                gpus.append(GpuInfo(i, _text(name), int(mem.total), int(mem.used), tuple(procs),
                                    _text(nv.nvmlDeviceGetUUID(h))))
            return GpuSnapshot(gpus=tuple(gpus))
        except Exception as e:  # no driver, no library, driver/library mismatch: all mean "cannot see"
            return GpuSnapshot(error=f"NVML unavailable: {e}")


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


STANDIN_ENV = "ORCHESTRATOR_GPU_STANDIN"


class StandinReader:
    """TEST SEAM, not a GPU reader: the Slurm tests' stand-in for NVML on machines without GPUs.
    `ORCHESTRATOR_GPU_STANDIN=<file.json>` maps a node name (SLURMD_NODENAME, else the host name) or
    "default" to {"gpus": N, "used_mib": M, "pids": [..]}: what that node's GPUs look like. All the test
    cluster's nodes are one machine, so this is how one of them is made to report busy GPUs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def snapshot(self) -> GpuSnapshot:
        import json
        import os
        import socket

        try:
            table = json.loads(open(self.path).read())
        except (OSError, ValueError) as e:
            return GpuSnapshot(error=f"GPU stand-in {self.path}: {e}")
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        spec = table.get(node, table.get("default", {}))
        used = int(spec.get("used_mib", 0)) * MIB
        procs = tuple(GpuProcess(pid) for pid in spec.get("pids", []))
        return GpuSnapshot(gpus=tuple(GpuInfo(i, "stand-in", 80 * 1024 * MIB, used, procs, f"GPU-standin-{node}-{i}")
                                      for i in range(int(spec.get("gpus", 8)))))


def reader(check: bool) -> GpuReader:
    import os

    if check and os.environ.get(STANDIN_ENV):
        return StandinReader(os.environ[STANDIN_ENV])
    return NvmlReader() if check else NullReader()


class GpuSelectionError(ValueError):
    """CUDA_VISIBLE_DEVICES names GPUs in a form the verification cannot map onto what NVML reports."""


GpuId = int | str   # an NVML index, or a GPU UUID (or a unique prefix of one, as CUDA accepts)


def run_gpus(nproc: int, cuda_visible: str | None) -> list[GpuId]:
    """The GPUs a run uses: CUDA_VISIBLE_DEVICES's indices and GPU-UUIDs, else 0..nproc-1.
    MIG instances and anything else are refused: checking other GPUs than the trainer gets would
    let a launch onto busy GPUs through (and hold back one onto idle GPUs)."""
    ids = [x.strip() for x in (cuda_visible or "").split(",") if x.strip()]
    if not ids:
        return list(range(nproc))
    mig = [x for x in ids if x.upper().startswith("MIG-")]
    if mig:
        raise GpuSelectionError(f"CUDA_VISIBLE_DEVICES={cuda_visible}: {mig[0]} is a MIG instance; NVML reports whole GPUs, "
                                "so the GPUs cannot be verified: give GPU indices or GPU-UUIDs, or set gpu.check = false")
    bad = [x for x in ids if not (x.isdigit() or (x.upper().startswith("GPU-") and len(x) > 4))]
    if bad:
        raise GpuSelectionError(f"CUDA_VISIBLE_DEVICES={cuda_visible}: {bad[0]!r} is neither a GPU index nor a GPU UUID "
                                "(GPU-...); list GPUs as nvidia-smi -L shows them")
    return [int(x) if x.isdigit() else x for x in ids]


def find(snap: GpuSnapshot, gid: GpuId) -> list[GpuInfo]:
    """The GPUs `gid` names: the one with that index, or those whose UUID starts with it."""
    if isinstance(gid, int):
        return [g for g in snap.gpus if g.index == gid]
    return [g for g in snap.gpus if g.uuid and g.uuid.lower().startswith(gid.lower())]


def _label(gid: GpuId) -> str:
    return f"GPU {gid}" if isinstance(gid, int) else gid


def clear_verdict(snap: GpuSnapshot, ids: Iterable[GpuId], threshold_mib: int) -> tuple[bool, list[str]]:
    """Clear = NVML readable, and on every GPU the run uses: no compute process and used memory
    under the threshold. Returns (clear, reasons it is not)."""
    if snap.error:
        return False, [snap.error]
    problems = []
    for gid in ids:
        found = find(snap, gid)
        if len(found) != 1:
            what = "not found" if not found else f"matches {len(found)} GPUs"
            problems.append(f"{_label(gid)} {what} (NVML sees {len(snap.gpus)})")
            continue
        g, name = found[0], _label(gid)
        if g.processes:
            pids = ", ".join(str(p.pid) for p in g.processes)
            problems.append(f"{name}: held by pid {pids}")
        if g.memory_used_bytes > threshold_mib * MIB:
            problems.append(f"{name}: {g.memory_used_bytes / MIB:.0f} MiB used (threshold {threshold_mib} MiB)")
    return not problems, problems


def holders(snap: GpuSnapshot, ids: Iterable[GpuId]) -> set[int]:
    return {p.pid for gid in ids for g in find(snap, gid) for p in g.processes}
