"""Checkpoint discovery and integrity checks of a checkpoint directory (the files in it:
orchestrator/store/filechecks.py; manifests: orchestrator/store/manifest.py).

Reads files only. Pure decision helpers
(`completeness`, `pick_resume`; filechecks' `check_header`, `check_adapter_config`) are separate from the I/O.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path

from orchestrator.domain import progress
from orchestrator.domain.checkpoint_names import CKPT_RE, MERGED_RE, step_of
from orchestrator.store.filechecks import (
    MAX_HEADER,
    REDO,
    LoraExpect,
    Verification,
    _check_index,
    _load_json,
    check_adapter_config,
    check_header,
    read_safetensors,
    verify_merged,
)
from orchestrator.store.manifest import (
    checksum_problems,
    load_manifest,
    manifest_stale,
    read_manifest,
)
from orchestrator.types import CheckpointInfo

# The file checks stay importable from here: callers verify, discover and check through this module.
__all__ = [
    "CKPT_RE",
    "ITER_DIR_RE",
    "ITER_FILE",
    "MAX_HEADER",
    "MERGED_RE",
    "REDO",
    "LoraExpect",
    "Verification",
    "async_proof",
    "check_adapter_config",
    "check_header",
    "checkpoint_kind",
    "completeness",
    "discover",
    "export_staging_name",
    "latest_good",
    "logged_losses",
    "merged_name",
    "pick_resume",
    "read_safetensors",
    "saved_async",
    "scan",
    "step_from_files",
    "step_of",
    "verify",
    "verify_merged",
    "verify_report",
]

ITER_DIR_RE = re.compile(r"iter_(\d{7,})")
ITER_FILE = "latest_checkpointed_iteration.txt"
NOT_COMPARED = "checksums not compared"


# ---------------------------------------------------------------- pure checks

def completeness(backend: str | None, names: set[str], step: int, last_step: int | None,
                 merged: bool = False, newer_exists: bool = False, async_save: bool = False) -> str | None:
    """None when checkpoint-`step` (whose entries are `names`) counts as fully written, else why not.

    `last_step` is the step `<output_dir>/last-checkpoint` points at; the trainer moves it only after a
    save is durable, so it (or a newer one) proves completeness for both backends.
    `async_save`: a megatron save under --async_save (its args.json says so) writes the iteration file at
    once and the mcore shards in the background; only the link (moved in the async request's finalize,
    after the synchronous safetensors) marks it complete: the caller passes `last_step` only when the link
    was moved after this checkpoint's iteration file (or a fresh manifest of ours vouches for it).
    """
    if last_step is not None and last_step >= step:
        return None
    if async_save and not merged:
        return ("last-checkpoint does not point at it or later yet: with --async_save the mcore shards are "
                "written in the background after the iteration file")
    if merged:
        # the merge of N finishes before checkpoint-(N+k) starts; otherwise weights + config must be there
        if newer_exists or ("config.json" in names and names & {"model.safetensors", "model.safetensors.index.json"}):
            return None
        return "merged weights or config.json missing"
    megatron_ok = ITER_FILE in names and ("adapter_model.safetensors" not in names or "adapter_config.json" in names)
    if backend in (None, "megatron") and megatron_ok:
        return None
    if backend in (None, "swift") and "trainer_state.json" in names:
        return None
    if backend == "megatron":
        return f"{ITER_FILE} missing" if ITER_FILE not in names else "adapter_config.json missing"
    return "trainer_state.json missing and last-checkpoint does not point at it or later"


def pick_resume(infos: Sequence[CheckpointInfo], manifests: Mapping[str, Mapping | None] | None = None,
                recipe_hash: str | None = None, require_manifest: bool = True
                ) -> tuple[CheckpointInfo | None, list[str]]:
    """Newest ok checkpoint (its manifest's recipe_hash matching, when given) and why newer ones were passed over."""
    passed = []
    for info in sorted(infos, key=lambda i: i.step, reverse=True):
        name = Path(info.path).name
        if not info.ok:
            passed.append(f"{name}: " + ("; ".join(info.problems) or "not ok"))
            continue
        if recipe_hash is not None:
            m = (manifests or {}).get(info.path)
            if m is None:
                if require_manifest:
                    passed.append(f"{name}: no manifest, recipe unknown")
                    continue
            elif m.get("recipe_hash") != recipe_hash:
                passed.append(f"{name}: written by recipe {m.get('recipe_hash')}, not {recipe_hash}")
                continue
        return info, passed
    return None, passed


def latest_good(infos: Sequence[CheckpointInfo], manifests: Mapping[str, Mapping | None] | None = None,
                recipe_hash: str | None = None, require_manifest: bool = True) -> CheckpointInfo | None:
    return pick_resume(infos, manifests, recipe_hash, require_manifest)[0]


# ---------------------------------------------------------------- file checks

def _link_step(output_dir: Path) -> int | None:
    """The step last-checkpoint names, while that checkpoint is there: a dangling link (the checkpoint was
    quarantined or deleted) proves nothing about the checkpoints being written after it."""
    try:
        target = os.readlink(output_dir / "last-checkpoint")
    except OSError:
        return None
    if (m := CKPT_RE.fullmatch(Path(target).name)) is None:  # it names no checkpoint-N
        return None
    step = int(m.group(1))
    return step if (output_dir / target).is_dir() else None


def _link(output_dir: Path) -> tuple[int, int] | None:
    """(step, when it was moved, ns) of last-checkpoint, dangling or not: --async_save's completeness mark."""
    try:
        link = output_dir / "last-checkpoint"
        if (m := CKPT_RE.fullmatch(Path(os.readlink(link)).name)) is None:  # it names no checkpoint-N
            return None
        return int(m.group(1)), os.lstat(link).st_mtime_ns
    except OSError:
        return None


def saved_async(p: Path, names: Collection[str]) -> bool:
    """Whether megatron checkpoint `p` was saved with --async_save: its args.json (the run's arguments,
    copied in at the start of the save) says so. Unreadable: False (the synchronous rule)."""
    if "args.json" not in names:
        return False
    try:
        return json.loads((p / "args.json").read_text()).get("async_save") is True
    except (OSError, ValueError, AttributeError):
        return False


def async_proof(p: Path, step: int) -> int | None:
    """The `last_step` completeness() may trust for async checkpoint `p`: the link's step when the link was
    moved at or after p's iteration file was written (a link older than it vouches for an earlier save of
    the same name, not for this one), else `step` when a manifest of ours covers p's files unchanged (we
    hash only verified checkpoints: a restored or published copy), else None."""
    link = _link(p.parent)
    try:
        marker = (p / ITER_FILE).stat().st_mtime_ns
    except OSError:
        return None  # the iteration file precedes the link: without it the save has not got that far
    if link is not None and link[0] >= step and link[1] >= marker:
        return link[0]
    m = read_manifest(p)
    return step if m is not None and not manifest_stale(p, m) else None


def _int_file(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def checkpoint_kind(names: Collection[str]) -> str | None:
    """The backend that wrote a checkpoint directory holding `names`: `swift sft` writes trainer_state.json,
    `megatron sft` the iteration file and iter_NNNNNNN/; None when neither is there (yet)."""
    if "trainer_state.json" in names:
        return "swift"
    if ITER_FILE in names or any(ITER_DIR_RE.fullmatch(n) for n in names):
        return "megatron"
    return None


def step_from_files(p: Path, kind: str | None) -> int | None:
    """A checkpoint's step from its own files (whatever the directory is called): trainer_state.json's
    global_step (swift), latest_checkpointed_iteration.txt or the iter_NNNNNNN/ name (megatron)."""
    if kind == "swift":
        try:
            step = json.loads((p / "trainer_state.json").read_text()).get("global_step")
        except (OSError, ValueError, AttributeError):
            return None
        return step if isinstance(step, int) and not isinstance(step, bool) else None
    if kind == "megatron":
        step = _int_file(p / ITER_FILE)
        if step is None:
            iters = sorted(int(m.group(1)) for e in p.iterdir() if (m := ITER_DIR_RE.fullmatch(e.name)))
            step = iters[-1] if iters else None
        return step
    return None


def verify(path: str | os.PathLike, expect: LoraExpect | None = None, full_checksum: bool = False,
           *, backend: str | None = None, recipe_hash: str | None = None) -> Verification:
    """Verify a checkpoint dir (`checkpoint-N`, or one copied under another name), a `-merged` dir, a
    .safetensors file, or an output_dir (its newest checkpoint). `full_checksum`: also compare every file
    with the manifest (a manifest that cannot be used, or names another recipe than `recipe_hash`, is a problem)."""
    p = Path(path)
    if p.is_file():
        problems, tnames = read_safetensors(p, p.name)
        if full_checksum:
            problems.append(f"{NOT_COMPARED}: {p.name} is a file; the manifest covers its checkpoint "
                            f"directory: verify {p.parent} --checksum")
        return Verification(not problems, None, True, tuple(problems), (p.name,), len(tnames), str(p))
    m, mm = CKPT_RE.fullmatch(p.name), MERGED_RE.fullmatch(p.name)
    if not p.is_dir():
        return Verification(False, None, False, (f"{p}: no such checkpoint directory or file",), path=str(p))
    names = {e.name for e in p.iterdir()}
    kind = checkpoint_kind(names)
    if not (m or mm) and kind is None and not names & {"adapter_model.safetensors", "adapter_config.json"}:
        infos = [q for q in p.iterdir() if CKPT_RE.fullmatch(q.name) and q.is_dir()]
        if not infos:
            return Verification(False, None, False, (f"{p}: no checkpoint-N directories",), path=str(p))
        return verify(max(infos, key=step_of), expect, full_checksum, backend=backend, recipe_hash=recipe_hash)
    # the other backend's checkpoint is named as such first, then checked as what it is
    problems = []
    if backend is not None and kind is not None and kind != backend and not mm:  # -merged: full weights, any backend
        problems.append(f"this is a {kind} sft checkpoint; the recipe's backend is {backend}: "
                        f"use a recipe with run.backend = \"{kind}\" to verify or resume from it")
        backend = kind
    is_async = False
    step: int | None
    if (named := m or mm) is not None:
        step, merged = int(named.group(1)), mm is not None
        newer = any((q := CKPT_RE.fullmatch(e.name)) and int(q.group(1)) > step for e in p.parent.iterdir())
        is_async = not merged and backend in (None, "megatron") and kind == "megatron" and saved_async(p, names)
        last_step = async_proof(p, step) if is_async else _link_step(p.parent)
    else:  # copied under another name: its own files say the step; no siblings or link speak for it
        merged = "config.json" in names and bool(names & {"model.safetensors", "model.safetensors.index.json"})
        step, newer, last_step = step_from_files(p, kind), False, None
        if step is None:
            problems.append(f"{p.name}: not named checkpoint-N and its step is unreadable (no trainer_state.json "
                            f"global_step, no {ITER_FILE}): an incomplete or damaged copy; {REDO}")
            return Verification(False, None, False, tuple(problems), path=str(p), kind=kind)
    why = completeness(backend, names, step, last_step, merged, newer, is_async)
    if why is not None:
        problems.append(f"{p.name}: incomplete: {why} (still being written?); wait for the save to finish or "
                        f"resume from an earlier checkpoint")
        return Verification(False, step, False, tuple(problems), path=str(p), kind=kind)
    it = _int_file(p / ITER_FILE) if ITER_FILE in names else None
    if ITER_FILE in names and it is None:
        problems.append(f"{p.name}/{ITER_FILE}: not an iteration number; resume would fail; {REDO}")
    state = _load_json(p / "trainer_state.json", f"{p.name}/trainer_state.json", problems) \
        if "trainer_state.json" in names else None
    gstep = state.get("global_step") if isinstance(state, dict) else None
    for label, got in ((ITER_FILE, it), ("trainer_state.json global_step", gstep)):
        if got is not None and got != step:
            problems.append(f"{p.name}/{label} says step {got}, the "
                            f"{'directory' if m or mm else 'checkpoint'} says {step}: mixed-up checkpoint; "
                            f"do not resume from it")
    files, all_names, per_file = [], [], {}
    for f in sorted(p.rglob("*.safetensors")):
        rel = f.relative_to(p).as_posix()
        probs, tnames = read_safetensors(f, f"{p.name}/{rel}")
        problems += probs
        files.append(rel)
        all_names += tnames
        per_file[rel] = set(tnames)
    if merged:
        _check_index(p, per_file, problems)
    else:
        _check_adapter(p, names, backend, step, expect, all_names, problems)
    if full_checksum:
        problems += checksum_problems(p, *load_manifest(p), recipe_hash=recipe_hash)
    return Verification(not problems, step, True, tuple(problems), tuple(files), len(all_names), str(p), kind)


def _check_adapter(p: Path, names: set[str], backend: str | None, step: int, expect: LoraExpect | None,
                   tensor_names: list[str], problems: list[str]) -> None:
    iter_dir = p / f"iter_{step:07d}"
    is_megatron = backend == "megatron" or (backend is None and ITER_FILE in names)
    if is_megatron and not (iter_dir / "common.pt").is_file():
        problems.append(f"{p.name}/{iter_dir.name}/common.pt missing: the mcore save did not finish and "
                        f"resume cannot read the iteration; resume from an earlier checkpoint")
    if "adapter_model.safetensors" in names:
        if "adapter_config.json" not in names:
            problems.append(f"{p.name}/adapter_config.json missing next to adapter_model.safetensors; {REDO}")
        else:
            cfg = _load_json(p / "adapter_config.json", f"{p.name}/adapter_config.json", problems)
            if cfg is not None:
                problems += check_adapter_config(cfg, expect, f"{p.name}/adapter_config.json")
        if tensor_names and not (any("lora_A" in n for n in tensor_names) and any("lora_B" in n for n in tensor_names)):
            problems.append(f"{p.name}/adapter_model.safetensors: no lora_A/lora_B tensors (e.g. "
                            f"{tensor_names[0]!r}): not a LoRA adapter; {REDO}")
    elif not (is_megatron and iter_dir.is_dir() and any(iter_dir.glob("*.distcp"))):
        problems.append(f"{p.name}: no adapter weights (adapter_model.safetensors or mcore shards); {REDO}")


def _trainer_loss(ckpt: Path, step: int) -> float | None:
    try:
        hist = json.loads((ckpt / "trainer_state.json").read_text())["log_history"]
        return [float(r["loss"]) for r in hist if "loss" in r and r.get("step", step + 1) <= step][-1]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def logged_losses(jsonl: str | os.PathLike) -> dict[int, float]:
    """step -> loss from a logging.jsonl (both backends; appended across attempts: the last record per step
    wins). Lines without a loss are skipped before parsing: the file grows by one record a step."""
    out: dict[int, float] = {}
    try:
        with open(jsonl, "rb") as f:
            for line in f:
                if b'"loss"' in line:
                    p = progress.parse_jsonl_line(line.decode("utf-8", "replace"))
                    if p is not None and p.loss is not None:
                        out[p.step] = p.loss
    except OSError:
        pass
    return out


def discover(output_dir: str | os.PathLike, backend: str, expect: LoraExpect | None = None,
             skip: Collection[str] = ()) -> list[CheckpointInfo]:
    """Every checkpoint-N/ under output_dir (paths in `skip` left out), verified, sorted by step."""
    return list(scan(output_dir, backend, expect, skip))


def scan(output_dir: str | os.PathLike, backend: str, expect: LoraExpect | None = None,
         skip: Collection[str] = (), newest_first: bool = False) -> Iterator[CheckpointInfo]:
    """Every checkpoint-N/ under output_dir (paths in `skip` left out), verified (headers only),
    by step. Lazy: a caller that stops at the first good one verifies no more."""
    out = Path(output_dir)
    try:
        entries = {e.name: e for e in out.iterdir()}
    except OSError:
        return
    jsonl = None
    names = [n for n in entries if CKPT_RE.fullmatch(n) and str(entries[n]) not in skip and entries[n].is_dir()]
    for name in sorted(names, key=step_of, reverse=newest_first):
        v = verify(entries[name], expect, backend=backend)
        merged = entries.get(f"{name}-merged")
        manifest = read_manifest(entries[name])
        loss = (manifest or {}).get("loss")
        if loss is None and v.step is not None:  # None: the dir went after listing (_trainer_loss found no loss there)
            loss = _trainer_loss(entries[name], v.step)
        if loss is None and v.step is not None and "logging.jsonl" in entries:  # None: the dir went after listing
            jsonl = logged_losses(entries["logging.jsonl"]) if jsonl is None else jsonl
            loss = max(((s, l) for s, l in jsonl.items() if s <= v.step), default=(0, None))[1]
        yield v.to_info(str(merged) if merged and merged.is_dir() else None, loss)


def verify_report(path: str | os.PathLike, expect: LoraExpect | None = None, full_checksum: bool = False,
                  backend: str | None = None, recipe_hash: str | None = None) -> dict:
    """The JSON of `orchestrator verify PATH --json`."""
    v = verify(path, expect, full_checksum, backend=backend, recipe_hash=recipe_hash)
    compared = not any(p.startswith(NOT_COMPARED) for p in v.problems)
    return {"ok": v.ok, "step": v.step, "complete": v.complete, "problems": list(v.problems), "path": v.path,
            "kind": v.kind, "checksums": ("compared" if compared else "not compared") if full_checksum else None}


# ---------------------------------------------------------------- the final export's merged copy

def merged_name(checkpoint_name: str) -> str:
    return f"{checkpoint_name}-merged"


def export_staging_name(checkpoint_name: str) -> str:
    """Where the export of checkpoint.merge = "final" writes; renamed to merged_name only once verified.
    Not a checkpoint name: discovery, sync and retention never see a partial export."""
    return f".partial-{merged_name(checkpoint_name)}"


def quarantine_name(path: Path, attempt_n: int, tag: str = "nan") -> Path:
    """Where a checkpoint written at or after a NaN (tag "nan") or a divergence's onset ("suspect") is moved:
    `<name>.<tag>-attempt-N`, or `.<tag>-attempt-N.K` when an earlier, interrupted quarantine already used that
    name (a rename onto it would fail)."""
    target, k = path.with_name(f"{path.name}.{tag}-attempt-{attempt_n}"), 1
    while target.exists():
        k += 1
        target = path.with_name(f"{path.name}.{tag}-attempt-{attempt_n}.{k}")
    return target
