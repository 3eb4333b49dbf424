"""GPU readers and the pure "may we launch?" decision."""
from __future__ import annotations

import pytest

from orchestrator.host import gpu
from orchestrator.host.gpu import MIB, GpuSelectionError, NullReader, NvmlReader, clear_verdict, holders, run_gpus
from orchestrator.types import GpuInfo, GpuProcess, GpuSnapshot

GIB = 1024 * MIB


def uuid(index: int) -> str:
    return f"GPU-{index}c4a1b2e-1111-2222-3333-44445555666{index}"


def g(index: int, used_mib: float = 0, pids: tuple[int, ...] = ()) -> GpuInfo:
    return GpuInfo(index, "NVIDIA H200", 141 * GIB, int(used_mib * MIB), tuple(GpuProcess(p, 1 * GIB) for p in pids),
                   uuid(index))


def snap(*gpus: GpuInfo) -> GpuSnapshot:
    return GpuSnapshot(gpus=gpus)


EIGHT_IDLE = snap(*(g(i, 500) for i in range(8)))

CLEAR = [
    # (id, snapshot, indices, threshold, clear, fragments of the reasons)
    ("all-idle", EIGHT_IDLE, range(8), 1024, True, []),
    ("no-indices", EIGHT_IDLE, [], 1024, True, []),
    ("error", GpuSnapshot(error="NVML unavailable: no driver"), range(8), 1024, False, ["NVML unavailable"]),
    ("error-no-indices", GpuSnapshot(error="NVML unavailable"), [], 1024, False, ["NVML unavailable"]),
    ("process-on-used", snap(g(0), g(1, 0, (4242,))), [0, 1], 1024, False, ["GPU 1", "pid 4242"]),
    ("two-processes", snap(g(0, 0, (1, 2))), [0], 1024, False, ["pid 1, 2"]),
    ("process-on-unused", snap(g(0), g(1, 5000, (4242,))), [0], 1024, True, []),
    ("memory-over", snap(g(0, 2048)), [0], 1024, False, ["GPU 0", "2048 MiB used", "threshold 1024 MiB"]),
    ("memory-at-threshold", snap(g(0, 1024)), [0], 1024, True, []),
    ("memory-just-over", snap(g(0, 1025)), [0], 1024, False, ["1025 MiB"]),
    ("threshold-zero", snap(g(0, 1)), [0], 0, False, ["GPU 0"]),
    ("threshold-zero-empty", snap(g(0, 0)), [0], 0, True, []),
    ("missing-index", snap(g(0), g(1)), [0, 1, 2], 1024, False, ["GPU 2 not found", "NVML sees 2"]),
    ("no-gpus", snap(), [0], 1024, False, ["GPU 0 not found", "NVML sees 0"]),
    ("held-and-full", snap(g(3, 80_000, (9,))), [3], 1024, False, ["pid 9", "80000 MiB"]),
    # CUDA_VISIBLE_DEVICES as UUIDs: the GPUs named are checked, not 0..n-1
    ("uuid-idle", snap(g(0, 0, (7,)), g(1)), [uuid(1)], 1024, True, []),
    ("uuid-held", snap(g(0), g(1, 0, (7,))), [uuid(1)], 1024, False, [uuid(1), "pid 7"]),
    ("uuid-upper-case", snap(g(0), g(1, 0, (7,))), [uuid(1).upper()], 1024, False, ["pid 7"]),
    ("uuid-prefix", snap(g(0), g(1, 0, (7,))), ["GPU-1c4a"], 1024, False, ["GPU-1c4a: held by pid 7"]),
    ("uuid-prefix-ambiguous", snap(g(0), g(1)), ["GPU-"], 1024, False, ["GPU- matches 2 GPUs"]),
    ("uuid-unknown", snap(g(0), g(1)), ["GPU-ffff"], 1024, False, ["GPU-ffff not found", "NVML sees 2"]),
    ("uuid-no-uuid-read", snap(GpuInfo(0, "x", GIB, 0)), [uuid(0)], 1024, False, ["not found"]),
    ("index-and-uuid", snap(g(0), g(1, 2048)), [0, uuid(1)], 1024, False, [f"{uuid(1)}: 2048 MiB"]),
]


@pytest.mark.parametrize("s,indices,threshold,clear,fragments", [c[1:] for c in CLEAR], ids=[c[0] for c in CLEAR])
def test_clear_verdict(s, indices, threshold, clear, fragments):
    ok, reasons = clear_verdict(s, indices, threshold)
    assert ok is clear
    assert (reasons == []) is clear
    text = "; ".join(reasons)
    for f in fragments:
        assert f in text, (f, text)


def test_clear_verdict_one_reason_per_problem():
    ok, reasons = clear_verdict(snap(g(0, 5000, (1,)), g(1, 5000)), [0, 1, 7], 1024)
    assert not ok and len(reasons) == 4


def test_clear_verdict_accepts_generator():
    assert clear_verdict(EIGHT_IDLE, (i for i in range(8)), 1024) == (True, [])


@pytest.mark.parametrize("nproc,visible,expected", [
    (8, None, list(range(8))),
    (8, "", list(range(8))),
    (2, "0,1", [0, 1]),
    (4, "4,5,6,7", [4, 5, 6, 7]),
    (2, " 2 , 3 ", [2, 3]),
    (2, "3,1", [3, 1]),
    (2, "0,,1,", [0, 1]),
    (1, "7", [7]),
    (2, "GPU-8c4a1b2e-1111-2222-3333-444455556666,GPU-9d5b2c3f-1111-2222-3333-444455556666",
     ["GPU-8c4a1b2e-1111-2222-3333-444455556666", "GPU-9d5b2c3f-1111-2222-3333-444455556666"]),
    (1, "GPU-8c4a", ["GPU-8c4a"]),
    (2, "0,GPU-8c4a", [0, "GPU-8c4a"]),
    (3, ",", [0, 1, 2]),
])
def test_run_gpus(nproc, visible, expected):
    assert run_gpus(nproc, visible) == expected


@pytest.mark.parametrize("visible,fragments", [
    ("MIG-1234,0", ["MIG-1234 is a MIG instance", "gpu.check = false"]),
    ("MIG-GPU-8c4a1b2e-1111-2222-3333-444455556666/1/0", ["MIG instance", "GPU indices or GPU-UUIDs"]),
    ("0,mig-abcd", ["mig-abcd is a MIG instance"]),
    ("0,abc", ["'abc' is neither a GPU index nor a GPU UUID", "nvidia-smi -L"]),
    ("-1", ["'-1'"]),
    ("GPU-", ["'GPU-'"]),
])
def test_run_gpus_refuses(visible, fragments):
    with pytest.raises(GpuSelectionError) as e:
        run_gpus(2, visible)
    assert f"CUDA_VISIBLE_DEVICES={visible}" in str(e.value)
    for f in fragments:
        assert f in str(e.value)


@pytest.mark.parametrize("s,indices,expected", [
    (snap(g(0, 0, (10,)), g(1, 0, (11, 12))), [0, 1], {10, 11, 12}),
    (snap(g(0, 0, (10,)), g(1, 0, (11, 12))), [1], {11, 12}),
    (snap(g(0, 0, (10,)), g(1, 0, (10,))), [0, 1], {10}),
    (snap(g(0, 0, (10,))), [5], set()),
    (snap(), [0], set()),
    (GpuSnapshot(error="x"), [0], set()),
    (snap(g(0, 0, (10,)), g(1, 0, (11,))), [uuid(1)], {11}),
    (snap(g(0, 0, (10,)), g(1, 0, (11,))), ["GPU-ffff"], set()),
])
def test_holders(s, indices, expected):
    assert holders(s, indices) == expected


def test_nvml_reader_without_driver_does_not_raise():
    s = NvmlReader().snapshot()
    assert isinstance(s, GpuSnapshot)
    if s.error is not None:  # this machine: no NVIDIA driver
        assert s.gpus == ()
        assert "NVML" in s.error
        assert clear_verdict(s, [0], 1024)[0] is False
    else:  # a GPU machine
        assert s.gpus


def test_nvml_reader_twice():
    r = NvmlReader()
    a, b = r.snapshot(), r.snapshot()
    assert (a.error is None) == (b.error is None)


def test_nvml_reader_failing_library(monkeypatch):
    class Broken:
        class NVMLError(Exception):
            pass

        @staticmethod
        def nvmlInit():
            raise Broken.NVMLError("Driver/library version mismatch")

    r = NvmlReader()
    monkeypatch.setattr(r, "_init", lambda: Broken.nvmlInit())
    s = r.snapshot()
    assert s.gpus == () and "Driver/library version mismatch" in s.error


def test_nvml_reader_with_fake_library(monkeypatch):
    class Proc:
        def __init__(self, pid, used):
            self.pid, self.usedGpuMemory = pid, used

    class Mem:
        total, used = 80 * GIB, 3 * GIB

    class FakeNvml:
        class NVMLError(Exception):
            pass

        @staticmethod
        def nvmlDeviceGetCount():
            return 2

        @staticmethod
        def nvmlDeviceGetHandleByIndex(i):
            return i

        @staticmethod
        def nvmlDeviceGetMemoryInfo(h):
            return Mem

        @staticmethod
        def nvmlDeviceGetName(h):
            return b"NVIDIA H100 80GB HBM3" if h == 0 else "NVIDIA H100 80GB HBM3"

        @staticmethod
        def nvmlDeviceGetUUID(h):
            return b"GPU-aaaa" if h == 0 else "GPU-bbbb"  # bytes from older nvidia-ml-py

        @staticmethod
        def nvmlDeviceGetComputeRunningProcesses(h):
            return [Proc(100 + h, GIB)]

        @staticmethod
        def nvmlDeviceGetGraphicsRunningProcesses(h):
            raise FakeNvml.NVMLError("not supported")

    r = NvmlReader()
    monkeypatch.setattr(r, "_init", lambda: FakeNvml)
    s = r.snapshot()
    assert s.error is None
    assert [x.index for x in s.gpus] == [0, 1]
    assert all(x.name == "NVIDIA H100 80GB HBM3" for x in s.gpus)
    assert s.gpus[1].processes == (GpuProcess(101, GIB),)
    assert s.gpus[0].memory_total_bytes == 80 * GIB
    assert holders(s, [0, 1]) == {100, 101}
    assert [x.uuid for x in s.gpus] == ["GPU-aaaa", "GPU-bbbb"]
    assert holders(s, ["GPU-bbbb"]) == {101}


@pytest.mark.parametrize("reason", [None, "no GPUs on this host"])
def test_null_reader_says_why(reason):
    r = NullReader() if reason is None else NullReader(reason)
    s = r.snapshot()
    assert s.gpus == ()
    assert s.error == (reason or "GPU checks disabled in the recipe (gpu.check = false)")
    ok, reasons = clear_verdict(s, [0], 1024)
    assert not ok and reasons == [s.error]


@pytest.mark.parametrize("check,kind", [(True, NvmlReader), (False, NullReader)])
def test_reader_factory(check, kind):
    assert isinstance(gpu.reader(check), kind)
