"""Benchmark: the checkpoint health scan (store/checkpoint_health.py) of a GiB-size BF16 safetensors adapter.

    python bench/bench_checkpoint_health.py [--size-gib 1] [--repeat 3] [--dir DIR] [--json]

Writes a real (not sparse) adapter of finite BF16 LoRA tensors into a temporary directory (deleted after),
then measures, page cache warm and dropped (posix_fadvise DONTNEED, as far as the kernel lets go):
  * the NaN/Inf scan (64 MiB chunks) in GiB/s, and the time it implies for the 397B recipe's 28 GiB adapter;
  * for scale, sha256 of the same file (what the manifest already reads every byte for), in GiB/s.
Target: the scan costs no more than the manifest's hash of the same bytes (rate >= sha256's), so checking
a checkpoint's health at most doubles the background work its manifest already does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orchestrator.store import checkpoint_health as ch  # noqa: E402
from orchestrator.store import manifest  # noqa: E402

QUICK = {"size_gib": 0.03, "repeat": 1}
REAL_ADAPTER_GIB = 28.0


def make_adapter(path: Path, size_bytes: int, layers: int = 48) -> int:
    """LoRA A/B BF16 tensors totalling ~size_bytes of finite values (magnitudes < 1); returns the file size."""
    per = max(2, size_bytes // (layers * 2) // 2 * 2)
    hdr: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    off = 0
    for i in range(layers):
        for ab in ("A", "B"):
            hdr[f"base_model.model.model.layers.{i}.mlp.experts.lora_{ab}.weight"] = {
                "dtype": "BF16", "shape": [per // 2], "data_offsets": [off, off + per]}
            off += per
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 0x3F80, size=8 << 20, dtype=np.uint16).tobytes()   # 16 MiB, reused
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        left = off
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(h) + off


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _rate(fn, size: int, repeat: int, before=None) -> list[float]:
    """GiB/s of `fn` over `size` bytes, one per repetition."""
    out = []
    for _ in range(repeat):
        if before:
            before()
        t = time.perf_counter()
        fn()
        out.append(size / (1 << 30) / (time.perf_counter() - t))
    return out


def run(size_gib: float = 1.0, repeat: int = 3, workdir: str | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        f = Path(tmp) / "adapter_model.safetensors"
        size = make_adapter(f, int(size_gib * (1 << 30)))
        assert ch.scan_safetensors(f).bad == ()
        drop = lambda: _drop_cache(f)  # noqa: E731
        scan_cold = _rate(lambda: ch.scan_safetensors(f), size, repeat, before=drop)
        sha_cold = _rate(lambda: manifest.sha256_file(f), size, repeat, before=drop)
        ch.scan_safetensors(f)
        scan_warm = _rate(lambda: ch.scan_safetensors(f), size, repeat)
        sha_warm = _rate(lambda: manifest.sha256_file(f), size, repeat)
    gib = size / (1 << 30)
    sw, hw, sc, hc = (statistics.median(x) for x in (scan_warm, sha_warm, scan_cold, sha_cold))
    return [
        {"name": f"nonfinite scan, {gib:.2f} GiB BF16, page cache warm (median)", "measured": round(sw, 3),
         "unit": "GiB/s", "target": f">= sha256 ({hw:.2f})", "pass": sw >= hw},
        {"name": f"nonfinite scan, {gib:.2f} GiB BF16, cache dropped (median)", "measured": round(sc, 3),
         "unit": "GiB/s", "target": f">= sha256 ({hc:.2f})", "pass": sc >= hc},
        {"name": "sha256 of the same file (the manifest's pass), warm", "measured": round(hw, 3), "unit": "GiB/s",
         "target": "-", "pass": True},
        {"name": "sha256 of the same file, cache dropped", "measured": round(hc, 3), "unit": "GiB/s", "target": "-",
         "pass": True},
        {"name": f"nonfinite scan of the {REAL_ADAPTER_GIB:g} GiB adapter at the cold rate (extrapolated)",
         "measured": round(REAL_ADAPTER_GIB / sc, 1), "unit": "s", "target": "-", "pass": True},
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the adapter (default: system temp)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = run(a.size_gib, a.repeat, a.dir)
    from run_all import print_table  # bench/ is on sys.path: this file's own folder
    print(json.dumps(rows, indent=1)) if a.json else print_table(rows)
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
