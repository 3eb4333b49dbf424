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
                gpus.append(GpuInfo(i, name.decode() if isinstance(name, bytes) else name,
                                    int(mem.total), int(mem.used), tuple(procs)))
            return GpuSnapshot(gpus=tuple(gpus))
        except Exception as e:  # no driver, no library, driver/library mismatch: all mean "cannot see"
            return GpuSnapshot(error=f"NVML unavailable: {e}")


def reader(check: bool) -> GpuReader:
    return NvmlReader() if check else NullReader()


def run_gpus(nproc: int, cuda_visible: str | None) -> list[int]:
    """Indices of the GPUs a run uses: CUDA_VISIBLE_DEVICES when it lists indices, else 0..nproc-1."""
    if cuda_visible:
        ids = [x.strip() for x in cuda_visible.split(",") if x.strip()]
        if ids and all(x.isdigit() for x in ids):
            return [int(x) for x in ids]
    return list(range(nproc))


def clear_verdict(snap: GpuSnapshot, indices: Iterable[int], threshold_mib: int) -> tuple[bool, list[str]]:
    """Clear = NVML readable, and on every GPU the run uses: no compute process and used memory
    under the threshold. Returns (clear, reasons it is not)."""
    if snap.error:
        return False, [snap.error]
    by_index = {g.index: g for g in snap.gpus}
    problems = []
    for i in indices:
        g = by_index.get(i)
        if g is None:
            problems.append(f"GPU {i} not found (NVML sees {len(snap.gpus)})")
            continue
        if g.processes:
            pids = ", ".join(str(p.pid) for p in g.processes)
            problems.append(f"GPU {i}: held by pid {pids}")
        if g.memory_used_bytes > threshold_mib * MIB:
            problems.append(f"GPU {i}: {g.memory_used_bytes / MIB:.0f} MiB used (threshold {threshold_mib} MiB)")
    return not problems, problems


def holders(snap: GpuSnapshot, indices: Iterable[int]) -> set[int]:
    wanted = set(indices)
    return {p.pid for g in snap.gpus if g.index in wanted for p in g.processes}
