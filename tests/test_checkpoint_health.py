"""Checkpoint health (store/checkpoint_health.py) and the tracker acting on it: stale copies and non-finite
tensors. Real checkpoint directories written by the fake trainer; a real journal."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from recipes import DROP, write_recipe
from fake_runs import MEG, SWIFT, run

from orchestrator.config.recipe import load
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.store import checkpoint_health as ch
from orchestrator.store import sync
from orchestrator.store.tracker import CheckpointTracker
from orchestrator.types import HealthKind

A = (("adapter_model.safetensors", "aa"),)
S = (("__0_0.distcp", "s0"), ("__1_0.distcp", "s1"))


# ---- pure: is it a stale copy?
@pytest.mark.parametrize("prev_step, prev, step, cur, lr, stale", [
    # false positives first
    (10, {"adapter safetensors": A}, 20, {"adapter safetensors": (("adapter_model.safetensors", "bb"),)}, 1e-4, False),
    (10, {"adapter safetensors": A}, 20, {"adapter safetensors": A}, 0.0, False),       # lr 0 all along: no change due
    (20, {"adapter safetensors": A}, 20, {"adapter safetensors": A}, 1e-4, False),      # same step (a rewrite)
    (30, {"adapter safetensors": A}, 20, {"adapter safetensors": A}, 1e-4, False),      # an older step
    (10, {}, 20, {}, 1e-4, False),                                                        # no weight files at all
    (10, {"mcore shards": S}, 20, {"adapter safetensors": A}, 1e-4, False),              # different groups
    (10, {"mcore shards": S, "adapter safetensors": A}, 20,
     {"mcore shards": (S[0], ("__1_0.distcp", "zz")), "adapter safetensors": (("adapter_model.safetensors", "b"),)},
     1e-4, False),                                                                        # one shard changed is enough
    # stale
    (10, {"adapter safetensors": A}, 20, {"adapter safetensors": A}, 1e-4, True),
    (10, {"adapter safetensors": A}, 20, {"adapter safetensors": A}, None, True),       # lr not logged: assumed > 0
    (10, {"mcore shards": S, "adapter safetensors": A}, 20,
     {"mcore shards": S, "adapter safetensors": (("adapter_model.safetensors", "fresh"),)}, 2e-5, True),  # async shards
])
def test_unchanged_problem(prev_step, prev, step, cur, lr, stale):
    why = ch.unchanged_problem(prev_step, prev, step, cur, lr)
    assert (why is not None) == stale
    if stale:
        assert f"checkpoint-{step}" in why and f"checkpoint-{prev_step}" in why and "not a resume point" in why


def test_weight_groups_leave_out_optimizer_and_metadata():
    files = [{"path": p, "sha256": p.upper()} for p in (
        "adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
        "iter_0000010/__0_0.distcp", "iter_0000010/common.pt", "iter_0000010/.metadata")]
    assert ch.weight_groups(files) == {
        "adapter safetensors": (("adapter_model.safetensors", "ADAPTER_MODEL.SAFETENSORS"),),
        "mcore shards": (("__0_0.distcp", "ITER_0000010/__0_0.DISTCP"),)}


# ---- the nonfinite scan
def write_st(path: Path, tensors: dict[str, tuple[str, bytes]]) -> Path:
    """A safetensors file from raw bytes per tensor (dtype, data), in the given order."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, (dtype, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": [len(raw)], "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def f32(*v: float) -> bytes:
    return np.asarray(v, dtype=np.float32).tobytes()


def bf16(*v: float) -> bytes:   # the upper half of the float32
    return (np.asarray(v, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def f16(*v: float) -> bytes:
    return np.asarray(v, dtype=np.float16).tobytes()


@pytest.mark.parametrize("chunk", [ch.CHUNK, 8])   # 8 bytes: every tensor spans several chunks
@pytest.mark.parametrize("tensors, bad", [
    # false positives first: large finite values, subnormals, -0, integer bit patterns that look like NaN
    ({"a.lora_A": ("F32", f32(1.0, -3e38, 1e-45, -0.0)), "a.lora_B": ("BF16", bf16(3e38, -1.0, 0.5, 2.0))}, ()),
    ({"h": ("F16", f16(65504.0, -65504.0, 6e-8, 0.0))}, ()),
    ({"ids": ("I32", np.asarray([-1, 0x7F800000], dtype=np.int32).tobytes()), "u": ("U8", b"\xff" * 8)}, ()),
    ({"x": ("F64", np.asarray([1e308, -1e308], dtype=np.float64).tobytes())}, ()),
    # non-finite
    ({"a.lora_A": ("F32", f32(1.0, 2.0)), "a.lora_B": ("F32", f32(0.0, 0.0, float("nan"), 1.0))}, ("a.lora_B (F32)",)),
    ({"a": ("BF16", bf16(1.0, 2.0, 3.0, 4.0)), "b": ("BF16", bf16(1.0, float("-inf")))}, ("b (BF16)",)),
    ({"a": ("F16", f16(1.0, float("inf"))), "b": ("F32", f32(float("nan")))}, ("a (F16)",)),
    ({"x": ("F64", np.asarray([1.0, float("nan")], dtype=np.float64).tobytes())}, ("x (F64)",)),
])
def test_scan_safetensors(tmp_path, tensors, bad, chunk):
    s = ch.scan_safetensors(write_st(tmp_path / "w.safetensors", tensors), chunk=chunk)
    assert s.bad == tuple(f"w.safetensors: {b}" for b in bad)
    if not bad:   # everything floating read, integers skipped
        assert s.bytes == sum(len(r) for d, r in tensors.values() if d in ch.NONFINITE_MASK)


def test_scan_of_a_truncated_file_raises(tmp_path):
    p = write_st(tmp_path / "w.safetensors", {"a": ("F32", f32(*range(100)))})
    p.write_bytes(p.read_bytes()[:-40])
    with pytest.raises(ValueError, match="ends inside tensor data"):
        ch.scan_safetensors(p)


# ---- real checkpoints: the fake trainer's, the tracker acting
def tracked(tmp_path: Path, out: Path, backend: str) -> tuple[CheckpointTracker, Journal]:
    run_section = {"backend": backend, "output_dir": str(out)}
    if backend == "swift":
        path = write_recipe(tmp_path, run=run_section, lora={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                            parallel={"nproc_per_node": 1, "expert": DROP})
    else:
        path = write_recipe(tmp_path, run=run_section)
    recipe = load(path)
    j = Journal(tmp_path / "journal.sqlite")
    rc = CheckpointTracker(recipe, "hash", out, j, Metrics(), on_saved=lambda: None, in_flight=sync.InFlight())
    rc.scan(0.0)
    rc.close()   # the manifest thread done (manifests and checks), what it found applied
    return rc, j


def kinds(j: Journal) -> list[str]:
    return [e["kind"] for e in j.events(200) if e["kind"].startswith("checkpoint_")]


@pytest.mark.parametrize("backend, flags", [("swift", SWIFT), ("megatron", MEG)])
def test_a_normal_run_raises_nothing(tmp_path, backend, flags):
    out = tmp_path / "out"
    assert run(out, *flags, FAKE_NPROC=1).returncode == 0
    rc, j = tracked(tmp_path, out, backend)
    assert kinds(j) == [] and all(c["ok"] for c in j.checkpoints())
    assert rc.resume_point().step == max(c["step"] for c in j.checkpoints())


@pytest.mark.parametrize("backend, flags, stale, before", [
    ("swift", SWIFT, 4, 2),          # saves at 2, 4, 6: 4 is 2's bytes
    ("megatron", MEG, 10, 5),        # saves at 5, 10 (and 12 at the end): 10 is 5's adapter and shards
])
def test_a_stale_checkpoint_is_no_resume_point(tmp_path, backend, flags, stale, before):
    out = tmp_path / "out"
    assert run(out, *flags, FAKE_NPROC=1, FAKE_STALE_SAVE=stale, FAKE_EXIT_AFTER_STEP=stale).returncode == 0
    rc, j = tracked(tmp_path, out, backend)
    ev = [e for e in j.events(200) if e["kind"] == "checkpoint_unchanged"]
    assert len(ev) == 1 and ev[0]["data"]["step"] == stale and ev[0]["data"]["previous_step"] == before
    assert ev[0]["data"]["max_lr"] > 0
    assert not (out / f"checkpoint-{stale}").exists() and (out / f"checkpoint-{stale}.checkpoint_unchanged").is_dir()
    row = {c["step"]: c for c in j.checkpoints()}[stale]
    assert not row["ok"] and "byte-identical" in row["problems"][0]
    assert rc.newest_verdict == (stale, False)            # checkpoint_invalid raised: it was the newest
    assert rc.resume_point().step == before                # the next resume skips it
    assert Path(out / "last-checkpoint").resolve().name == f"checkpoint-{before}"


def test_a_stale_copy_with_lr_zero_is_not_a_finding(tmp_path):
    out = tmp_path / "out"
    assert run(out, *SWIFT, "--learning_rate", "0", FAKE_NPROC=1, FAKE_STALE_SAVE=4).returncode == 0
    _, j = tracked(tmp_path, out, "swift")
    assert kinds(j) == []


def test_a_nonfinite_adapter_is_no_resume_point(tmp_path):
    out = tmp_path / "out"
    assert run(out, *SWIFT, FAKE_NPROC=1).returncode == 0
    adapter = out / "checkpoint-6" / "adapter_model.safetensors"
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(adapter))
    name = sorted(tensors)[3]
    tensors[name][0, 1] = math.inf
    save_file(tensors, str(adapter), metadata={"format": "pt"})
    rc, j = tracked(tmp_path, out, "swift")
    (ev,) = [e for e in j.events(200) if e["kind"] == "checkpoint_nonfinite"]
    assert ev["data"]["tensors"] == [f"adapter_model.safetensors: {name} (F32)"] and ev["data"]["scanned_bytes"] > 0
    assert (out / "checkpoint-6.checkpoint_nonfinite").is_dir()
    assert rc.resume_point().step == 4


def test_a_stale_copy_of_a_pruned_checkpoint_is_still_caught(tmp_path):
    """The health check remembers each step's weights: the checkpoint copied may be gone by then."""
    health = ch.CheckpointHealth(tmp_path)
    files = [{"path": "adapter_model.safetensors", "size": 1, "sha256": "x"}]
    assert health.check(str(tmp_path / "checkpoint-2"), 2, {"files": files}) is None
    f = health.check(str(tmp_path / "checkpoint-4"), 4, {"files": files})
    assert f is not None and f.kind == HealthKind.CHECKPOINT_UNCHANGED and f.details["max_lr"] is None


def test_after_a_supervisor_restart_the_previous_manifest_on_disk_is_the_reference(tmp_path):
    from orchestrator.store import manifest
    for step in (2, 4):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(b"same bytes")
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    manifest.write_manifest(tmp_path / "checkpoint-2", 2, "h")
    manifest.write_manifest(tmp_path / "checkpoint-4", 4, "h")
    f = ch.CheckpointHealth(tmp_path).check(str(tmp_path / "checkpoint-4"), 4)   # a fresh process: nothing remembered
    assert f is not None and f.kind == HealthKind.CHECKPOINT_UNCHANGED and f.details["previous_step"] == 2
