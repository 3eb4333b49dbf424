"""Benchmark: header-only verification of a 4 GiB safetensors adapter (sparse file, no disk time).

    python bench/bench_verify.py [--size-gib 4] [--repeat 50] [--json]

`run()` returns rows {name, measured, unit, target, pass} for a future bench runner.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from orchestrator.store import checkpoints as ck

TARGET_MS = 50.0


def make_sparse_adapter(path: Path, size_bytes: int, layers: int = 48) -> None:
    """A valid header for LoRA A/B BF16 tensors totalling ~size_bytes; the data region is a hole."""
    per = max(2, size_bytes // (layers * 2) // 2 * 2)
    hdr, off = {"__metadata__": {"format": "pt"}}, 0
    for i in range(layers):
        for ab in ("A", "B"):
            hdr[f"base_model.model.model.layers.{i}.mlp.experts.lora_{ab}.weight"] = {
                "dtype": "BF16", "shape": [per // 2], "data_offsets": [off, off + per]}
            off += per
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(8 + len(h) + off)
        f.flush()
        os.fsync(f.fileno())


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _ms(fn, repeat: int, before=None) -> list[float]:
    out = []
    for _ in range(repeat):
        if before:
            before()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def run(size_gib: float = 4.0, repeat: int = 50, workdir: str | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        ckpt = Path(tmp) / "checkpoint-100"
        ckpt.mkdir()
        f = ckpt / "adapter_model.safetensors"
        make_sparse_adapter(f, int(size_gib * (1 << 30)))
        cfg = {"r": 64, "lora_alpha": 128, "target_modules": "all-linear"}
        (ckpt / "adapter_config.json").write_text(json.dumps(cfg))
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 100}))
        assert ck.verify(f).ok and ck.verify(ckpt, ck.LoraExpect(64, 128, ("all-linear",))).ok
        size = f.stat().st_size
        cold = _ms(lambda: ck.verify(f), min(repeat, 10), before=lambda: _drop_cache(f))
        warm = _ms(lambda: ck.verify(f), repeat)
        whole = _ms(lambda: ck.verify(ckpt, ck.LoraExpect(64, 128, ("all-linear",))), repeat)
    rows = [
        (f"verify {size / (1 << 30):.1f} GiB safetensors, page cache dropped (median)", statistics.median(cold)),
        (f"verify {size / (1 << 30):.1f} GiB safetensors, warm (median)", statistics.median(warm)),
        (f"verify {size / (1 << 30):.1f} GiB safetensors, warm (max of {repeat})", max(warm)),
        ("verify checkpoint dir with that adapter (median)", statistics.median(whole)),
    ]
    return [{"name": n, "measured": round(v, 3), "unit": "ms", "target": f"<= {TARGET_MS:g}",
             "pass": v <= TARGET_MS} for n, v in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--dir", default=None, help="where to create the sparse file (default: system temp)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = run(a.size_gib, a.repeat, a.dir)
    from run_all import print_table  # bench/ is on sys.path: this file's own folder
    print(json.dumps(rows, indent=1)) if a.json else print_table(rows)
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
