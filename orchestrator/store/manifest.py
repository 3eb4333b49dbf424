"""Checkpoint manifests: every file's path, size and sha256, written next to a verified checkpoint and
checked against any copy of it; plus the durable-write helpers publication relies on."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MANIFEST = "orchestrator-manifest.json"
CHUNK = 1 << 20


def list_files(root: str | os.PathLike) -> list[str]:
    """Regular files under root (relative, sorted), without the manifest and its temp files."""
    root = Path(root)
    return sorted(Path(dp, fn).relative_to(root).as_posix() for dp, _, fns in os.walk(root) for fn in fns
                  if not fn.startswith((MANIFEST, "." + MANIFEST)) and not Path(dp, fn).is_symlink())


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hash_all(paths: list[Path]) -> list[str]:
    if not paths:
        return []
    # hashlib releases the GIL on large updates, so a few threads overlap I/O and hashing
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(paths)))) as pool:
        return list(pool.map(sha256_file, paths))


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> Path:
    # pid and thread: the supervisor and its sync thread may both write a manifest at once.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def build_manifest(ckpt: str | os.PathLike, step: int, recipe_hash: str | None, loss: float | None = None) -> dict:
    ckpt = Path(ckpt)
    rels = list_files(ckpt)
    sizes = [(ckpt / r).stat().st_size for r in rels]
    hashes = _hash_all([ckpt / r for r in rels])
    return {"step": step, "recipe_hash": recipe_hash, "created_at": time.time(), "loss": loss,
            "files": [{"path": r, "size": s, "sha256": h} for r, s, h in zip(rels, sizes, hashes)]}


def write_manifest(ckpt_path: str | os.PathLike, step: int, recipe_hash: str | None, loss: float | None = None) -> Path:
    """Hash every file (streamed, 1 MiB chunks) and write `<ckpt>/orchestrator-manifest.json` atomically."""
    return write_json_atomic(Path(ckpt_path) / MANIFEST, build_manifest(ckpt_path, step, recipe_hash, loss))


def read_manifest(ckpt: str | os.PathLike) -> dict | None:
    try:
        data = json.loads((Path(ckpt) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), list) else None


def load_manifest(ckpt: str | os.PathLike) -> tuple[dict | None, str]:
    """(the manifest of checkpoint `ckpt`, "") or (None, why it cannot be used: missing, unreadable, malformed)."""
    path = Path(ckpt) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, (f"{path.parent.name} has no {MANIFEST} (the supervisor writes one for each checkpoint it "
                      f"verified: this one was never verified by orchestrator, or its manifest was lost)")
    except OSError as e:
        return None, f"{path.parent.name}/{MANIFEST} cannot be read ({e.strerror or e})"
    except ValueError as e:
        return None, f"{path.parent.name}/{MANIFEST} is not valid JSON ({e})"
    if not isinstance(data, dict) or not isinstance(data.get("files"), list) or not all(
            isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
            and isinstance(f.get("sha256"), str) for f in data["files"]):
        return None, f"{path.parent.name}/{MANIFEST} is malformed (no list of files with path, size and sha256)"
    return data, ""


def checksum_problems(ckpt: str | os.PathLike, manifest: Mapping | None, why_not: str,
                      recipe_hash: str | None = None) -> list[str]:
    """What `verify --checksum` adds: where the files differ from the manifest; that the checksums were not
    compared and why, when the manifest cannot be used (the comparison asked for cannot be made); and a
    manifest naming another recipe than `recipe_hash` (the recipe given), or than its publish directory's
    `<run.name>-<hash8>` name."""
    if manifest is None:
        return [f"checksums not compared: {why_not}"]  # checkpoints.NOT_COMPARED
    problems = manifest_matches(ckpt, manifest)
    named = manifest.get("recipe_hash")
    parent = Path(ckpt).resolve().parent.name
    short = parent.rsplit("-", 1)[-1] if "-" in parent else ""
    if recipe_hash is not None and named != recipe_hash:
        problems.append(f"{Path(ckpt).name}: its manifest names recipe {named}, not this recipe's {recipe_hash}: "
                        f"written by another recipe; a run of this recipe never resumes from it")
    elif len(short) == 8 and all(c in "0123456789abcdef" for c in short) and not str(named or "").startswith(short):
        problems.append(f"{Path(ckpt).name}: its manifest names recipe {named}, but it is published under {parent} "
                        f"(recipe {short}): a copy of another recipe's checkpoint; its run never restores it")
    return problems


def manifest_matches(dir: str | os.PathLike, manifest: Mapping, checksums: bool = True,
                     known: Mapping[str, str] | None = None) -> list[str]:
    """Problems where `dir` differs from `manifest` (missing files, sizes, sha256).

    `known`: sha256 of files already hashed in their current state (by tailhash during a copy)."""
    d = Path(dir)
    problems, to_hash = [], []
    for ent in manifest.get("files", []):
        f = d / ent["path"]
        try:
            size = f.stat().st_size
        except OSError:
            problems.append(f"{d.name}/{ent['path']}: missing (listed in the manifest)")
            continue
        if size != ent["size"]:
            problems.append(f"{d.name}/{ent['path']}: {size} bytes, the manifest says {ent['size']}")
        elif checksums:
            to_hash.append((ent, (known or {}).get(ent["path"])))
    fresh = iter(_hash_all([d / e["path"] for e, got in to_hash if got is None]))
    for ent, got in to_hash:
        got = got or next(fresh)
        if got != ent["sha256"]:
            problems.append(f"{d.name}/{ent['path']}: sha256 differs from the manifest (changed or corrupted "
                            f"after verification)")
    return problems


def manifest_stale(ckpt: str | os.PathLike, manifest: Mapping) -> bool:
    """True when files were added, removed, resized or touched after the manifest was written (stat only)."""
    ckpt = Path(ckpt)
    try:
        written = (ckpt / MANIFEST).stat().st_mtime_ns
        listed = {e["path"]: e["size"] for e in manifest["files"]}
        rels = list_files(ckpt)
        if set(rels) != set(listed):
            return True
        for r in rels:
            st = (ckpt / r).stat()
            if st.st_size != listed[r] or st.st_mtime_ns > written:
                return True
    except (OSError, KeyError, TypeError):
        return True
    return False
