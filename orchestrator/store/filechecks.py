"""File-level checks of a checkpoint's contents (checkpoints.py verifies the directory around them):
safetensors headers, a sharded model's index, a LoRA adapter's config, and a merged full model as a whole
(verify_merged). Reads headers only, never tensor data. `check_header` and `check_adapter_config` are pure.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.types import CheckpointInfo

safe_open: Callable[..., Any] | None
try:  # imported here, not on first use: the first check must not stall the supervisor's loop
    import numpy  # noqa: F401  (safe_open's numpy framework needs it)
    from safetensors import safe_open
except ImportError:  # without them only our own header parse runs
    safe_open = None

MAX_HEADER = 100_000_000  # the safetensors library's own limit
REDO = "do not resume from it; use an earlier checkpoint"
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

@dataclass(frozen=True)
class LoraExpect:
    """What the recipe says the adapter must look like (None = do not check)."""

    rank: int | None = None
    alpha: int | None = None
    targets: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Verification:
    ok: bool
    step: int | None
    complete: bool
    problems: tuple[str, ...] = ()
    files: tuple[str, ...] = ()      # safetensors files whose headers were checked, relative to path
    tensors: int = 0
    path: str = ""
    kind: str | None = None          # the backend that wrote it, read from its files ("swift", "megatron")

    def to_info(self, merged_path: str | None = None, loss: float | None = None) -> CheckpointInfo:
        return CheckpointInfo(path=self.path, step=self.step if self.step is not None else -1,
                              complete=self.complete, ok=self.ok, problems=self.problems,
                              merged_path=merged_path, loss=loss)


def _kb(n: int) -> str:
    return f"{n / 1024:.1f} KB" if n < 1 << 20 else f"{n / (1 << 30):.2f} GiB"


def check_header(header: Any, header_len: int, file_len: int, name: str) -> tuple[list[str], list[str]]:
    """(problems, tensor names) for a parsed safetensors header of a file of `file_len` bytes."""
    if not isinstance(header, dict):
        return [f"{name}: header is not a JSON object; {REDO}"], []
    spans, problems = [], []
    for key, t in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(t, dict) and isinstance(t.get("shape"), list)
                and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
                and all(isinstance(x, int) and x >= 0 for x in t["shape"] + t["data_offsets"])):
            problems.append(f"{name}: tensor '{key}' has a malformed header entry; {REDO}")
            continue
        bits = _DTYPE_BITS.get(t.get("dtype", ""))  # no dtype: "" is no dtype of ours either
        begin, end = t["data_offsets"]
        numel = 1
        for d in t["shape"]:
            numel *= d
        if bits is None:
            problems.append(f"{name}: tensor '{key}' has unknown dtype {t.get('dtype')!r}; {REDO}")
        elif end < begin or numel * bits != (end - begin) * 8:
            problems.append(f"{name}: tensor '{key}' {t['dtype']}{t['shape']} needs {numel * bits // 8} bytes "
                            f"but data_offsets span {end - begin}; {REDO}")
        spans.append((begin, end, key))
    names = [k for k in header if k != "__metadata__"]
    if not names:
        return [(f"{name}: holds no tensors (header only, {_kb(file_len)}): the save wrote no weights; check "
                 f"the save settings (save_safetensors, mcore-bridge version); {REDO}")], []
    data_len = file_len - 8 - header_len
    max_end = max((e for _, e, _ in spans), default=0)
    if max_end > data_len:
        key = max(spans, key=lambda s: s[1])[2]
        problems.append(f"{name}: truncated: tensor '{key}' ends at byte {max_end} of the data region but only "
                        f"{data_len} bytes follow the header (copy or save cut short); {REDO}")
    elif max_end < data_len:
        problems.append(f"{name}: {data_len - max_end} bytes of trailing garbage after the last tensor "
                        f"(overwritten or appended file); {REDO}")
    expected = 0
    for begin, end, key in sorted(spans):
        if begin != expected:
            problems.append(f"{name}: tensor '{key}' starts at {begin}, expected {expected} "
                            f"(overlapping or gapped tensors); {REDO}")
            break
        expected = end
    return problems, names


def check_adapter_config(cfg: Any, expect: LoraExpect | None, name: str) -> list[str]:
    if not isinstance(cfg, dict):
        return [f"{name}: not a JSON object; {REDO}"]
    if expect is None:
        return []
    problems = []
    for key, want, flag in (("r", expect.rank, "lora_rank"), ("lora_alpha", expect.alpha, "lora_alpha")):
        if want is not None and cfg.get(key) != want:
            problems.append(f"{name}: {key}={cfg.get(key)!r} but the recipe expects {flag}={want}: the adapter "
                            f"belongs to a different recipe; do not resume from it with this recipe")
    if expect.targets is not None:
        have = cfg.get("target_modules")
        if tuple(expect.targets) == ("all-linear",):
            good = have == "all-linear" or isinstance(have, list)
        else:
            good = isinstance(have, list) and set(expect.targets) <= set(have)
        if not good:
            problems.append(f"{name}: target_modules={have!r} does not cover the recipe's {list(expect.targets)}; "
                            f"do not resume from it with this recipe")
    return problems


def read_safetensors(path: Path, name: str) -> tuple[list[str], list[str]]:
    """(problems, tensor names) from the header alone: reads 8 + N bytes, never tensor data."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                return [f"{name}: {size} bytes, too short for a safetensors header; {REDO}"], []
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or n > size - 8:
                return [(f"{name}: header length {n} exceeds the file ({size} bytes): truncated or not "
                         f"safetensors; {REDO}")], []
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        return [f"{name}: header is not valid JSON ({e}); {REDO}"], []
    except OSError as e:
        return [f"{name}: cannot read ({e.strerror})"], []
    problems, names = check_header(header, n, size, name)
    if not problems and safe_open is not None:
        try:  # the library's parse is authoritative; it mmaps and reads the header only
            with safe_open(str(path), framework="numpy"):
                pass
        except Exception as e:  # noqa: BLE001 - any library rejection is a finding
            problems.append(f"{name}: rejected by the safetensors library ({e}); {REDO}")
    return problems, names


def _load_json(path: Path, name: str, problems: list[str]) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{name}: unreadable or not JSON ({e}); {REDO}")
        return None


def _check_index(p: Path, per_file: dict[str, set[str]], problems: list[str]) -> None:
    idx = p / "model.safetensors.index.json"
    if not idx.exists():
        return
    data = _load_json(idx, f"{p.name}/{idx.name}", problems)
    wmap = (data or {}).get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict):
        if data is not None:
            problems.append(f"{p.name}/{idx.name}: no weight_map; {REDO}")
        return
    for shard in sorted(set(wmap.values())):
        if shard not in per_file:
            problems.append(f"{p.name}/{shard}: listed in {idx.name} but missing; {REDO}")
    missing = [k for k, s in wmap.items() if s in per_file and k not in per_file[s]]
    if missing:
        problems.append(f"{p.name}/{idx.name}: {len(missing)} tensors (e.g. {missing[0]!r}) absent from their "
                        f"shard; {REDO}")


def verify_merged(path: str | os.PathLike) -> Verification:
    """A merged full model (HF layout) as `swift export` / `megatron export --to_hf` write it: config.json;
    model.safetensors, or model.safetensors.index.json with every listed shard present, every tensor of
    the weight_map in its shard, and the index's total_size equal to the tensor bytes of the shards;
    every shard header-checked (check_header + the safetensors library)."""
    p = Path(path)
    if not p.is_dir():
        return Verification(False, None, False, (f"{p}: no such merged model directory",), path=str(p))
    problems: list[str] = []
    if not (p / "config.json").is_file():
        problems.append(f"{p.name}/config.json missing: not a loadable model; {REDO}")
    idx = p / "model.safetensors.index.json"
    if idx.exists():
        data = _load_json(idx, f"{p.name}/{idx.name}", problems)
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            problems.append(f"{p.name}/{idx.name}: no weight_map; {REDO}")
            wmap = {}
        shards = sorted(set(wmap.values()))
        total = (data.get("metadata") or {}).get("total_size") if isinstance(data, dict) else None
    elif (p / "model.safetensors").exists():
        shards, wmap, total = ["model.safetensors"], {}, None
    else:
        problems.append(f"{p.name}: neither model.safetensors nor model.safetensors.index.json: the export "
                        f"wrote no weights; {REDO}")
        shards, wmap, total = [], {}, None
    per_file: dict[str, set[str]] = {}
    data_bytes = 0
    for shard in shards:
        f = p / shard
        if not f.is_file():
            problems.append(f"{p.name}/{shard}: listed in the index but missing (export cut short); {REDO}")
            continue
        probs, names = read_safetensors(f, f"{p.name}/{shard}")
        problems += probs
        per_file[shard] = set(names)
        if not probs:  # headers are consistent: the data region is exactly the tensors' bytes
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
            data_bytes += f.stat().st_size - 8 - n
    missing = [k for k, s in wmap.items() if s in per_file and k not in per_file[s]]
    if missing:
        problems.append(f"{p.name}/model.safetensors.index.json: {len(missing)} tensors (e.g. {missing[0]!r}) "
                        f"absent from their shard; {REDO}")
    if isinstance(total, int) and not problems and total != data_bytes:
        problems.append(f"{p.name}/model.safetensors.index.json: metadata total_size {total} bytes but the shards "
                        f"hold {data_bytes} bytes of tensors; {REDO}")
    tensors = sum(len(v) for v in per_file.values())
    return Verification(not problems, None, True, tuple(problems), tuple(shards), tensors, str(p))
