"""Checkpoint verification, discovery and manifests against real files written with the safetensors library."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from orchestrator.store import checkpoints as ck
from orchestrator.store import manifest as mf
from orchestrator.store.checkpoints import LoraExpect
from orchestrator.types import CheckpointInfo
from checkpoint_dirs import TARGETS, adapter_config, link_last, make_megatron, make_merged, make_swift, write_adapter  # noqa: F401



def raw_safetensors(path: Path, header: dict | bytes, data: bytes, header_len: int | None = None) -> None:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if header_len is None else header_len) + h + data)


def corrupt(kind: str):
    """Mutations of a good swift checkpoint-10 (d) -> the field failures we must catch."""
    def apply(d: Path) -> None:
        f = d / "adapter_model.safetensors"
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        hdr = json.loads(raw[8:8 + n])
        if kind == "stub":  # the field's 39 KB file: a header, metadata padding, no tensors
            raw_safetensors(f, {"__metadata__": {"format": "pt", "pad": "x" * 39_000}}, b"")
        elif kind == "truncated":
            f.write_bytes(raw[:-100])
        elif kind == "header_len_past_eof":
            f.write_bytes(struct.pack("<Q", len(raw) * 4) + raw[8:])
        elif kind == "offsets_past_eof":
            key = next(k for k in hdr if k != "__metadata__")
            hdr[key]["shape"][0] *= 100
            hdr[key]["data_offsets"][1] += (hdr[key]["data_offsets"][1] - hdr[key]["data_offsets"][0]) * 99
            raw_safetensors(f, hdr, raw[8 + n:])
        elif kind == "trailing":
            f.write_bytes(raw + b"\0" * 17)
        elif kind == "dtype_size":
            key = next(k for k in hdr if k != "__metadata__")
            hdr[key]["dtype"] = "F16"
            raw_safetensors(f, hdr, raw[8 + n:])
        elif kind == "unknown_dtype":
            key = next(k for k in hdr if k != "__metadata__")
            hdr[key]["dtype"] = "Q4"
            raw_safetensors(f, hdr, raw[8 + n:])
        elif kind == "overlap":
            keys = [k for k in hdr if k != "__metadata__"]
            hdr[keys[1]]["data_offsets"] = list(hdr[keys[0]]["data_offsets"])
            hdr[keys[1]]["shape"] = list(hdr[keys[0]]["shape"])
            raw_safetensors(f, hdr, raw[8 + n:])
        elif kind == "bad_json":
            f.write_bytes(raw[:8] + b"{not json" + raw[17:])
        elif kind == "tiny_file":
            f.write_bytes(b"\x01\x02")
        elif kind == "not_lora":
            write_adapter(f, lora=False)
        elif kind == "config_bad_json":
            (d / "adapter_config.json").write_text("{")
        elif kind == "step_mismatch":
            (d / "trainer_state.json").write_text(json.dumps({"global_step": 9, "log_history": []}))
        elif kind == "config_missing_swift":
            (d / "adapter_config.json").unlink()
        else:
            raise AssertionError(kind)
    return apply


CORRUPT_CASES = [
    ("stub", "holds no tensors"),
    ("truncated", "truncated"),
    ("header_len_past_eof", "exceeds the file"),
    ("offsets_past_eof", "truncated"),
    ("trailing", "trailing garbage"),
    ("dtype_size", "needs"),
    ("unknown_dtype", "unknown dtype"),
    ("overlap", "overlapping"),
    ("bad_json", "not valid JSON"),
    ("tiny_file", "too short"),
    ("not_lora", "no lora_A/lora_B"),
    ("config_bad_json", "not JSON"),
    ("step_mismatch", "says step 9"),
    ("config_missing_swift", "adapter_config.json missing"),
]


@pytest.mark.parametrize("kind,needle", CORRUPT_CASES, ids=[c[0] for c in CORRUPT_CASES])
def test_corrupt_swift_checkpoint_is_complete_but_not_ok(tmp_path, kind, needle):
    d = make_swift(tmp_path, 10)
    corrupt(kind)(d)
    v = ck.verify(d, backend="swift")
    assert v.complete and not v.ok and v.step == 10
    assert any(needle in p for p in v.problems), v.problems
    assert all(p.startswith("checkpoint-10") for p in v.problems)  # each line names the file


def test_stub_message_reports_size(tmp_path):
    d = make_swift(tmp_path, 10)
    corrupt("stub")(d)
    (msg,) = ck.verify(d).problems
    assert "adapter_model.safetensors" in msg and "KB" in msg and "do not resume" in msg


def test_good_layouts(tmp_path):
    s = make_swift(tmp_path / "s", 10)
    m = make_megatron(tmp_path / "m", 200)
    for path, backend in ((s, "swift"), (m, "megatron"), (s, None), (m, None)):
        v = ck.verify(path, LoraExpect(8, 32, tuple(TARGETS)), backend=backend)
        assert v.ok and v.complete and v.problems == () and v.files == ("adapter_model.safetensors",)
        assert v.tensors == 8


INCOMPLETE_CASES = [  # (builder, backend, reason fragment)
    (lambda o: make_swift(o, 10, link=False, state=False), "swift", "trainer_state.json missing"),
    (lambda o: make_megatron(o, 10, iter_file=False), "megatron", ck.ITER_FILE),
    (lambda o: make_megatron(o, 10, config=False), "megatron", "adapter_config.json missing"),
    (lambda o: make_megatron(o, 10, config=False), None, "missing"),
]


@pytest.mark.parametrize("build,backend,reason", INCOMPLETE_CASES)
def test_missing_markers_are_incomplete_not_corrupt(tmp_path, build, backend, reason):
    d = build(tmp_path)
    # a half-written adapter must not be called corrupt while the save is running
    (d / "adapter_model.safetensors").write_bytes((d / "adapter_model.safetensors").read_bytes()[:-64])
    v = ck.verify(d, backend=backend)
    assert not v.complete and not v.ok
    (msg,) = v.problems
    assert msg.startswith("checkpoint-10: incomplete:") and reason in msg and "still being written?" in msg


def test_last_checkpoint_link_marks_older_and_same_steps_complete(tmp_path):
    make_swift(tmp_path, 10, link=False, state=False)
    make_swift(tmp_path, 20, link=False, state=False)
    assert not ck.verify(tmp_path / "checkpoint-20", backend="swift").complete
    link_last(tmp_path, 20)
    assert ck.verify(tmp_path / "checkpoint-10", backend="swift").ok
    assert ck.verify(tmp_path / "checkpoint-20", backend="swift").ok
    make_megatron(tmp_path / "m", 30, iter_file=False)  # async_save: the link is the proof
    link_last(tmp_path / "m", 30)
    assert ck.verify(tmp_path / "m" / "checkpoint-30", backend="megatron").complete


def test_megatron_specific_checks(tmp_path):
    d = make_megatron(tmp_path, 200)
    (d / ck.ITER_FILE).write_text("100")
    assert any("says step 100" in p for p in ck.verify(d, backend="megatron").problems)
    d = make_megatron(tmp_path, 300)
    (d / "iter_0000300" / "common.pt").unlink()
    assert any("common.pt missing" in p for p in ck.verify(d, backend="megatron").problems)
    assert ck.verify(make_megatron(tmp_path, 400, safetensors=False), backend="megatron").ok  # mcore shards only
    v = ck.verify(make_megatron(tmp_path, 500, safetensors=False, shards=False), backend="megatron")
    assert any("no adapter weights" in p for p in v.problems)


EXPECT_CASES = [  # (expect, ok, problem fragment)
    (LoraExpect(8, 32, tuple(TARGETS)), True, None),
    (LoraExpect(16, None, None), False, "r=8 but the recipe expects lora_rank=16"),
    (LoraExpect(None, 16, None), False, "lora_alpha=32"),
    (LoraExpect(None, None, ("q_proj", "gate_proj")), False, "target_modules"),
    (LoraExpect(None, None, ("q_proj",)), True, None),
    (LoraExpect(None, None, ("all-linear",)), True, None),
    (None, True, None),
]


@pytest.mark.parametrize("expect,ok,frag", EXPECT_CASES)
def test_adapter_config_against_recipe(tmp_path, expect, ok, frag):
    v = ck.verify(make_swift(tmp_path, 10), expect)
    assert v.ok is ok
    assert frag is None or any(frag in p for p in v.problems), v.problems


@pytest.mark.parametrize("cfg,expect,n_problems", [
    ({"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}, LoraExpect(8, 16, ("all-linear",)), 0),
    ({"r": 8, "target_modules": ["q_proj"]}, LoraExpect(targets=("all-linear",)), 0),
    ({"r": 8, "target_modules": "all-linear"}, LoraExpect(targets=("q_proj",)), 1),
    ({"r": 8, "target_modules": None}, LoraExpect(targets=("all-linear",)), 1),
    ({"r": 4, "lora_alpha": 8}, LoraExpect(8, 16), 2),
    ([1, 2], None, 1),
])
def test_check_adapter_config_table(cfg, expect, n_problems):
    assert len(ck.check_adapter_config(cfg, expect, "adapter_config.json")) == n_problems


def _hdr(**tensors):
    return {k: {"dtype": d, "shape": s, "data_offsets": o} for k, (d, s, o) in tensors.items()}


@pytest.mark.parametrize("header,hlen,flen,frag", [
    (_hdr(a=("F32", [2, 2], [0, 16])), 100, 124, None),
    (_hdr(a=("BF16", [3], [0, 6]), b=("I8", [2], [6, 8])), 50, 66, None),
    (_hdr(a=("F4", [4], [0, 2])), 50, 60, None),
    (_hdr(a=("F32", [2, 2], [0, 16])), 100, 120, "truncated"),
    (_hdr(a=("F32", [2, 2], [0, 16])), 100, 130, "6 bytes of trailing"),
    (_hdr(a=("F32", [2, 2], [0, 12])), 100, 120, "needs 16 bytes"),
    (_hdr(a=("F32", [2], [0, 8]), b=("F32", [2], [16, 24])), 10, 42, "gapped"),
    (_hdr(a=("F32", [2], [8, 0])), 10, 26, "needs"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 10, 22, "malformed"),
    ({"__metadata__": {}}, 20, 28, "holds no tensors"),
    ([], 2, 10, "not a JSON object"),
])
def test_check_header_table(header, hlen, flen, frag):
    problems, _ = ck.check_header(header, hlen, flen, "x.safetensors")
    assert (frag is None and not problems) or any(frag in p for p in problems), problems


@pytest.mark.parametrize("backend,names,step,last,merged,newer,complete", [
    ("swift", {"trainer_state.json"}, 10, None, False, False, True),
    ("swift", set(), 10, 10, False, False, True),
    ("swift", set(), 10, 20, False, False, True),
    ("swift", set(), 20, 10, False, False, False),
    ("swift", {ck.ITER_FILE}, 10, None, False, False, False),
    ("megatron", {ck.ITER_FILE}, 10, None, False, False, True),
    ("megatron", {ck.ITER_FILE, "adapter_model.safetensors"}, 10, None, False, False, False),
    ("megatron", {ck.ITER_FILE, "adapter_model.safetensors", "adapter_config.json"}, 10, None, False, False, True),
    ("megatron", {"trainer_state.json"}, 10, None, False, False, False),
    ("megatron", set(), 10, 10, False, False, True),
    ("megatron", {"config.json"}, 10, None, True, False, False),
    ("megatron", {"config.json", "model.safetensors"}, 10, None, True, False, True),
    ("megatron", set(), 10, None, True, True, True),
])
def test_completeness_table(backend, names, step, last, merged, newer, complete):
    assert (ck.completeness(backend, names, step, last, merged, newer) is None) is complete


def test_merged_dir(tmp_path):
    make_megatron(tmp_path, 100)
    good = make_merged(tmp_path, 100)
    v = ck.verify(good, backend="megatron")
    assert v.ok and v.step == 100 and len(v.files) == 2  # no lora expectations on merged weights
    make_megatron(tmp_path, 200)
    bad = make_merged(tmp_path, 200, drop_shard=True)
    v = ck.verify(bad, backend="megatron")
    assert not v.ok and any("listed in model.safetensors.index.json but missing" in p for p in v.problems)


def test_discover_sorts_attaches_merged_and_losses(tmp_path):
    for s, loss in ((100, 2.0), (20, 3.0), (3, 4.0)):
        make_swift(tmp_path, s, loss=loss)
    make_merged(tmp_path, 20)
    (tmp_path / "checkpoint-notastep").mkdir()
    (tmp_path / "checkpoint-7").write_text("a file, not a dir")
    infos = ck.discover(tmp_path, "swift")
    assert [i.step for i in infos] == [3, 20, 100]
    assert all(isinstance(i, CheckpointInfo) and i.ok for i in infos)
    assert infos[1].merged_path == str(tmp_path / "checkpoint-20-merged") and infos[0].merged_path is None
    assert [i.loss for i in infos] == [4.0, 3.0, 2.0]
    assert ck.discover(tmp_path / "missing", "swift") == []


def test_discover_newest_being_written(tmp_path):
    make_megatron(tmp_path, 100)
    make_megatron(tmp_path, 200, config=False)
    with open(tmp_path / "logging.jsonl", "w") as f:
        f.writelines(json.dumps({"loss": loss, "iteration": f"{it}/400"}) + "\n"
                     for it, loss in ((99, 9.0), (100, 1.5), (150, 1.2)))
        f.write('{"loss": 1.25, "iteration": "100/400"}\n')  # a resume re-logs step 100: the last wins
    old, new = ck.discover(tmp_path, "megatron")
    assert old.ok and old.loss == 1.25
    assert not new.complete and not new.ok and "still being written?" in new.problems[0]


def test_verify_report_paths(tmp_path):
    make_swift(tmp_path, 10)
    d = make_swift(tmp_path, 20)
    corrupt("trailing")(d)
    rep = ck.verify_report(tmp_path)  # an output_dir: its newest checkpoint
    assert rep["ok"] is False and rep["step"] == 20 and rep["complete"] is True
    assert json.loads(json.dumps(rep)) == rep
    rep = ck.verify_report(tmp_path / "checkpoint-10" / "adapter_model.safetensors")
    assert rep["ok"] and rep["step"] is None and rep["problems"] == []
    rep = ck.verify_report(tmp_path / "nope")
    assert not rep["ok"] and "no such" in rep["problems"][0]
    (tmp_path / "empty").mkdir()
    assert "no checkpoint-N" in ck.verify_report(tmp_path / "empty")["problems"][0]


def test_manifest_roundtrip_and_checksums(tmp_path):
    d = make_swift(tmp_path, 10)
    (d / "sub").mkdir()
    (d / "sub" / "x.bin").write_bytes(os.urandom(3 << 20))  # > 1 chunk
    path = mf.write_manifest(d, 10, "abc", loss=0.5)
    assert path == d / mf.MANIFEST and not [p for p in os.listdir(d) if ".tmp-" in p]
    m = mf.read_manifest(d)
    assert m["step"] == 10 and m["recipe_hash"] == "abc" and m["loss"] == 0.5 and m["created_at"] > 0
    assert {f["path"] for f in m["files"]} == set(mf.list_files(d)) and "sub/x.bin" in mf.list_files(d)
    assert mf.MANIFEST not in mf.list_files(d)
    assert mf.manifest_matches(d, m) == [] and not mf.manifest_stale(d, m)
    assert ck.verify(d, full_checksum=True).ok
    raw = bytearray((d / "optimizer.pt").read_bytes())
    raw[5] ^= 0xFF  # same size, one bit pattern different: only the checksum sees it
    (d / "optimizer.pt").write_bytes(bytes(raw))
    assert ck.verify(d).ok
    v = ck.verify(d, full_checksum=True)
    assert not v.ok and any("optimizer.pt: sha256 differs" in p for p in v.problems)
    assert mf.manifest_stale(d, m)
    (d / "scheduler.pt").write_bytes(b"x")
    (d / "rng_state.pth").unlink()
    probs = mf.manifest_matches(d, m)
    assert any("scheduler.pt: 1 bytes" in p for p in probs) and any("rng_state.pth: missing" in p for p in probs)
    assert mf.read_manifest(tmp_path) is None


def _info(step, ok=True):
    return CheckpointInfo(path=f"/o/checkpoint-{step}", step=step, complete=ok, ok=ok,
                          problems=() if ok else ("bad",))


@pytest.mark.parametrize("infos,manifests,recipe,require,want", [
    ([_info(1), _info(2), _info(3, ok=False)], None, None, True, 2),
    ([_info(1), _info(2)], {"/o/checkpoint-1": {"recipe_hash": "h"}, "/o/checkpoint-2": {"recipe_hash": "g"}},
     "h", True, 1),
    ([_info(1), _info(2)], {"/o/checkpoint-1": {"recipe_hash": "h"}}, "h", True, 1),
    ([_info(1), _info(2)], {"/o/checkpoint-1": {"recipe_hash": "h"}}, "h", False, 2),
    ([_info(1, ok=False)], None, None, True, None),
    ([], None, "h", True, None),
])
def test_latest_good_table(infos, manifests, recipe, require, want):
    got = ck.latest_good(infos, manifests, recipe, require_manifest=require)
    assert (got.step if got else None) == want


def test_pick_resume_explains_skips():
    best, why = ck.pick_resume([_info(1), _info(2, ok=False)], {"/o/checkpoint-1": {"recipe_hash": "h"}}, "h")
    assert best.step == 1 and why == ["checkpoint-2: bad"]


def test_header_check_reads_no_tensor_data(tmp_path):
    # a sparse 4 GiB file: a data read would be slow and the sparse hole reads as zeros; both are fine,
    # but the verifier must accept it from its header alone
    f = tmp_path / "big.safetensors"
    n = 1 << 30
    hdr = {f"t{i}.lora_A.weight": {"dtype": "F32", "shape": [n // 4], "data_offsets": [i * n, (i + 1) * n]}
           for i in range(4)}
    h = json.dumps(hdr).encode()
    with open(f, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)) + h)
        fh.truncate(8 + len(h) + 4 * n)
    v = ck.verify(f)
    assert v.ok and v.tensors == 4


# ---------------------------------------------------------------- copied under another name, other backend

@pytest.mark.parametrize("make,kind", [(make_swift, "swift"), (make_megatron, "megatron")])
def test_copy_under_another_name_reads_its_step_from_its_files(tmp_path, make, kind):
    d = make(tmp_path / "out", 30)
    copy = tmp_path / "keep" / "best-adapter"
    copy.parent.mkdir()
    d.rename(copy)
    v = ck.verify(copy, LoraExpect(8, 32, tuple(TARGETS)), backend=kind)
    assert (v.ok, v.step, v.kind, v.problems) == (True, 30, kind, ())
    rep = ck.verify_report(copy)
    assert rep["step"] == 30 and rep["kind"] == kind and rep["ok"]


def test_copy_with_an_unreadable_step_says_so(tmp_path):
    copy = make_swift(tmp_path, 30).rename(tmp_path / "renamed")
    (copy / "trainer_state.json").write_text('{"global_step": "x"}')
    v = ck.verify(copy)
    assert not v.ok and v.step is None and "its step is unreadable" in v.problems[0]


@pytest.mark.parametrize("make,kind,other", [(make_swift, "swift", "megatron"), (make_megatron, "megatron", "swift")])
def test_the_other_backends_checkpoint_is_named_first(tmp_path, make, kind, other):
    d = make(tmp_path, 30)
    for path in (d, tmp_path / "renamed"):
        if not path.exists():
            d.rename(path)
        v = ck.verify(path, backend=other)
        assert not v.ok and v.step == 30
        assert v.problems == (f"this is a {kind} sft checkpoint; the recipe's backend is {other}: use a recipe "
                              f"with run.backend = \"{kind}\" to verify or resume from it",)


def test_verify_command_prints_the_step_of_a_renamed_copy(tmp_path, write_recipe):
    from click.testing import CliRunner

    from orchestrator.ops.cli import main

    copy = make_swift(tmp_path / "out", 30).rename(tmp_path / "adapter-copy")
    res = CliRunner().invoke(main, ["verify", str(copy)])
    assert res.exit_code == 0 and res.stdout == f"ok: {copy} (swift sft checkpoint, step 30)\n"
    res = CliRunner().invoke(main, ["verify", str(copy), "--recipe", str(write_recipe())])  # a megatron recipe
    assert res.exit_code == 2 and "step None" not in res.stdout
    assert res.stdout.splitlines()[1] == ("  this is a swift sft checkpoint; the recipe's backend is megatron: use a "
                                          "recipe with run.backend = \"swift\" to verify or resume from it")
    res = CliRunner().invoke(main, ["verify", str(copy / "adapter_model.safetensors")])
    assert res.exit_code == 0 and res.stdout == f"ok: {copy / 'adapter_model.safetensors'}\n"


# ---------------------------------------------------------------- verify_merged (the final export's output)

def _export(d: Path, shards: int = 2) -> Path:
    d.mkdir(parents=True)
    wmap, total = {}, 0
    for k in range(1, shards + 1):
        shard = f"model-{k:05d}-of-{shards:05d}.safetensors"
        t = {f"model.layers.{k}.mlp.weight": np.ones((8, 8), np.float32), f"model.layers.{k}.norm": np.ones(8, np.float32)}
        save_file(t, str(d / shard))
        wmap.update({n: shard for n in t})
        total += sum(a.nbytes for a in t.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}))
    (d / "config.json").write_text("{}")
    return d


def _drop_shard(d):
    (d / "model-00002-of-00002.safetensors").unlink()


def _truncate_shard(d):
    f = d / "model-00001-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-10])


def _wrong_total(d):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["metadata"]["total_size"] += 4
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def _tensor_elsewhere(d):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.9.mlp.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def _no_config(d):
    (d / "config.json").unlink()


def _no_weights(d):
    for f in d.glob("model*"):
        f.unlink()


@pytest.mark.parametrize("damage, needle", [
    (None, None),
    (_drop_shard, "listed in the index but missing"),
    (_truncate_shard, "truncated"),
    (_wrong_total, "total_size"),
    (_tensor_elsewhere, "absent from their shard"),
    (_no_config, "config.json missing"),
    (_no_weights, "wrote no weights"),
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_verify_merged(tmp_path, damage, needle):
    d = _export(tmp_path / ".partial-checkpoint-10-merged")
    if damage:
        damage(d)
    v = ck.verify_merged(d)
    assert v.ok == (needle is None), v.problems
    if needle:
        assert any(needle in p for p in v.problems), v.problems
    else:
        assert v.files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors") and v.tensors == 4


def test_verify_merged_single_file(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    save_file({"w": np.ones((4, 4), np.float32)}, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    assert ck.verify_merged(d).ok
    assert not ck.verify_merged(tmp_path / "absent").ok
