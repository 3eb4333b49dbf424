"""Checkpoint health: is a verified checkpoint's trainable content what training should have produced?

  checkpoint_unchanged  its weight files are byte-identical to an earlier checkpoint's although steps
                        advanced and the learning rate was above zero in between: an async writer that
                        wrote a stale copy (NeMo-RL #3312). Compared per group, from the manifest's sha256
                        (no second read): the adapter safetensors, and the mcore shards (*.distcp), each
                        as (file name, sha256) pairs; one group identical is enough (with --async_save the
                        adapter is written synchronously and the shards in the background).
  checkpoint_nonfinite  a NaN or Inf in a floating-point tensor of one of its safetensors files: streamed
                        in chunks (bounded memory), the exponent bits tested with numpy (bf16 included,
                        which numpy has no type for). bench/bench_checkpoint_health.py measures the rate.

Either makes the checkpoint no resume point: the tracker (store/tracker.py) moves it out of the checkpoint
namespace. The checks run on the tracker's manifest thread, never on the loop's.
"""
from __future__ import annotations

import json
import os
import re
import struct
import threading
import time
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrator.domain import progress
from orchestrator.domain.checkpoint_names import CKPT_RE, step_of
from orchestrator.domain.health.kinds import Finding
from orchestrator.store import manifest
from orchestrator.types import HealthKind

CHUNK = 64 << 20

# weight files per group; optimizer, scheduler, rng and args files are left out (they may be fresh while
# the weights are stale, and a weights-only save has none)
GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("adapter safetensors", re.compile(r"(^|/)[^/]*\.safetensors$")),
    ("mcore shards", re.compile(r"(^|/)[^/]*\.distcp$")),
)
# safetensors dtype -> (unsigned view, exponent mask): all exponent bits set is Inf or NaN
# (float8 e4m3fn has no Inf; its NaN is S.1111.111, so the mask takes the mantissa too)
NONFINITE_MASK: dict[str, tuple[type, int]] = {
    "F64": (np.uint64, 0x7FF0000000000000), "F32": (np.uint32, 0x7F800000), "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80), "F8_E5M2": (np.uint8, 0x7C), "F8_E4M3": (np.uint8, 0x7F),
}


# ---- pure -------------------------------------------------------------------------------------------
def weight_groups(files: Iterable[Mapping]) -> dict[str, tuple[tuple[str, str], ...]]:
    """A manifest's `files` entries -> group -> sorted (file name, sha256); groups without files left out."""
    out: dict[str, list[tuple[str, str]]] = {}
    for ent in files:
        for name, pat in GROUPS:
            if pat.search(ent["path"]):
                out.setdefault(name, []).append((ent["path"].rsplit("/", 1)[-1], ent["sha256"]))
                break
    return {k: tuple(sorted(v)) for k, v in out.items()}


def unchanged_problem(prev_step: int, prev: Mapping[str, tuple], step: int, cur: Mapping[str, tuple],
                      max_lr: float | None) -> str | None:
    """Why checkpoint `step` is a stale copy of checkpoint `prev_step`, or None. `max_lr`: the highest
    learning rate logged in (prev_step, step]; None (not logged) counts as above zero."""
    if step <= prev_step or (max_lr is not None and max_lr <= 0):
        return None
    same = [g for g, files in cur.items() if files and prev.get(g) == files]
    if not same:
        return None
    lr = "unknown" if max_lr is None else f"up to {max_lr:g}"
    return (f"checkpoint-{step}: its {' and '.join(same)} are byte-identical to checkpoint-{prev_step}'s although "
            f"{step - prev_step} steps were trained in between (learning rate {lr}): a stale copy, not the "
            f"weights of step {step}; not a resume point")


# ---- nonfinite scan ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scan:
    bytes: int = 0                 # tensor bytes read
    seconds: float = 0.0
    bad: tuple[str, ...] = ()      # "file: tensor (dtype)" with a NaN or Inf, the first per file


def _header(f) -> tuple[dict, int]:
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n)), 8 + n


def scan_safetensors(path: str | os.PathLike, chunk: int = CHUNK) -> Scan:
    """Read every floating-point tensor of one safetensors file in chunks; the first tensor holding a NaN
    or Inf is named. Raises OSError/ValueError on an unreadable file (verification reports those)."""
    t0, read = time.monotonic(), 0
    with open(path, "rb", buffering=0) as f:
        header, base = _header(f)
        # contiguous runs of one dtype are read as one region: the adapter is thousands of small tensors
        regions: list[tuple[int, int, str, list[tuple[int, str]]]] = []
        for name, t in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                              key=lambda kv: kv[1]["data_offsets"][0]):
            if t["dtype"] not in NONFINITE_MASK:
                continue
            a, b = t["data_offsets"]
            if regions and regions[-1][2] == t["dtype"] and regions[-1][1] == a:
                regions[-1] = (regions[-1][0], b, t["dtype"], regions[-1][3] + [(a, name)])
            else:
                regions.append((a, b, t["dtype"], [(a, name)]))
        buf = np.empty(chunk, dtype=np.uint8)
        raw = memoryview(buf.data)
        masked: dict[type, np.ndarray] = {}   # one scratch array per element size, reused by every region
        for a, b, dtype, names in regions:
            kind, mask = NONFINITE_MASK[dtype]
            size = np.dtype(kind).itemsize
            step = chunk - chunk % size
            tmp = masked.setdefault(kind, np.empty(step // size, dtype=kind))
            f.seek(base + a)
            pos = a
            while pos < b:
                n = f.readinto(raw[:min(step, b - pos)])
                if not n:
                    raise ValueError(f"{Path(path).name}: ends inside tensor data (offset {pos})")
                n -= n % size
                view: np.ndarray = buf[:n].view(kind)
                part = tmp[:len(view)]
                np.bitwise_and(view, kind(mask), out=part)
                if part.max() == mask:
                    first = pos + int(np.flatnonzero(part == mask)[0]) * size
                    tensor = names[bisect_right([o for o, _ in names], first) - 1][1]
                    read += pos + n - a
                    return Scan(read, time.monotonic() - t0, (f"{Path(path).name}: {tensor} ({dtype})",))
                pos += n
                f.seek(base + pos)
            read += b - a
    return Scan(read, time.monotonic() - t0)


def scan_checkpoint(ckpt: str | os.PathLike, chunk: int = CHUNK) -> Scan:
    """The nonfinite scan over every safetensors file of a checkpoint directory."""
    total, secs, bad = 0, 0.0, list[str]()
    for f in sorted(Path(ckpt).rglob("*.safetensors")):
        s = scan_safetensors(f, chunk)
        total, secs, bad = total + s.bytes, secs + s.seconds, bad + list(s.bad)
    return Scan(total, secs, tuple(bad))


# ---- the learning rate between two saves ------------------------------------------------------------
def max_lr(output_dir: str | os.PathLike, ckpt: str | os.PathLike, lo: int, hi: int) -> float | None:
    """The highest learning rate logged for a step in (lo, hi]: logging.jsonl (both backends), else the
    checkpoint's trainer_state.json log_history (swift). None where neither logged one."""
    lrs = []
    try:
        with open(Path(output_dir) / "logging.jsonl", "rb") as f:
            for line in f:
                if b"learning_rate" in line and (p := progress.parse_jsonl_line(line.decode("utf-8", "replace"))):
                    if lo < p.step <= hi and p.lr is not None:
                        lrs.append(p.lr)
    except OSError:
        pass
    if not lrs:
        try:
            hist = json.loads((Path(ckpt) / "trainer_state.json").read_text())["log_history"]
            lrs = [float(r["learning_rate"]) for r in hist if "learning_rate" in r and lo < int(r.get("step", -1)) <= hi]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return max(lrs) if lrs else None


# ---- what the tracker uses --------------------------------------------------------------------------
class CheckpointHealth:
    """Checks each verified checkpoint once its manifest is written (call `check` on the manifest thread; the
    tracker applies what it returns on the loop's thread). Remembers each checked step's weight groups, so a
    stale copy is caught even after the checkpoint it copied was pruned."""

    def __init__(self, output_dir: str | os.PathLike, chunk: int = CHUNK) -> None:
        self.out, self.chunk = Path(output_dir), chunk
        self.groups: dict[int, dict[str, tuple]] = {}
        self.lock = threading.Lock()

    def check(self, path: str, step: int, mani: Mapping | None = None) -> Finding | None:
        """Both checks of checkpoint `path` (its manifest: given, else read). Never raises: a check that
        cannot read says so in the finding's data, not as a failure of the checkpoint."""
        mani = mani if mani is not None else manifest.read_manifest(path)
        finding = None
        if mani is not None:
            cur = weight_groups(mani.get("files", []))
            with self.lock:
                earlier = {s: g for s, g in self.groups.items() if s < step}
                self.groups[step] = cur
            prev_step, prev = max(earlier.items(), default=(None, None)) if earlier else self._on_disk(step)
            if prev_step is not None and prev is not None:
                try:
                    problem = unchanged_problem(prev_step, prev, step, cur, None)
                    if problem:  # only then is the log read: the rare case pays
                        lr = max_lr(self.out, path, prev_step, step)
                        problem = unchanged_problem(prev_step, prev, step, cur, lr)
                        if problem:
                            finding = Finding(HealthKind.CHECKPOINT_UNCHANGED, problem, last_step=step, subject=path,
                                              details={"step": step, "previous_step": prev_step, "max_lr": lr})
                except (OSError, ValueError, KeyError, TypeError):
                    pass
        if finding is None:
            try:
                scan = scan_checkpoint(path, self.chunk)
            except (OSError, ValueError, KeyError, TypeError, struct.error):
                scan = None   # unreadable files are verification's finding (checkpoint_invalid), not this one
            if scan is not None and scan.bad:
                problem = (f"checkpoint-{step}: NaN or Inf in {', '.join(scan.bad)}: training diverged before "
                           f"this save; not a resume point")
                finding = Finding(HealthKind.CHECKPOINT_NONFINITE, problem, last_step=step, subject=path,
                                  details={"step": step, "tensors": list(scan.bad), "scanned_bytes": scan.bytes,
                                           "seconds": round(scan.seconds, 3)})
        return finding

    def _on_disk(self, step: int) -> tuple[int | None, dict | None]:
        """The newest earlier checkpoint in output_dir with a manifest (after a supervisor restart)."""
        earlier = sorted((s, d) for d in self.out.glob("checkpoint-*")
                         if CKPT_RE.fullmatch(d.name) and (s := step_of(d)) is not None and s < step)
        for s, d in reversed(earlier):
            if (m := manifest.read_manifest(d)) is not None:
                return s, weight_groups(m.get("files", []))
        return None, None


def unhealthy_name(path: Path, kind: str) -> Path:
    """Where an unhealthy checkpoint is moved: `<name>.<kind>` (`.<kind>.K` when taken), out of the
    checkpoint-N namespace that resume, retention and publication look in."""
    target, k = path.with_name(f"{path.name}.{kind}"), 1
    while target.exists():
        k += 1
        target = path.with_name(f"{path.name}.{kind}.{k}")
    return target
