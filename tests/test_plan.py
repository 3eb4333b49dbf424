"""`orchestrator plan`: argv, env, hash, memory and the pre-flight checks."""
from __future__ import annotations

import json
import socket

import pytest

from recipes import MODEL_CONFIG, RECIPES, make_model
from orchestrator.host import probe as host_probe
from orchestrator.ops import plan
from orchestrator.loop import preflight
from orchestrator.config import recipe as R
from orchestrator.host.gpu import NullReader
from orchestrator.types import GpuInfo, GpuSnapshot

GIB = 1024**3


class FakeReader:
    def __init__(self, snap: GpuSnapshot):
        self.snap = snap

    def snapshot(self) -> GpuSnapshot:
        return self.snap


def gpus(n: int, gib: float = 80) -> GpuSnapshot:
    return GpuSnapshot(gpus=tuple(GpuInfo(i, "NVIDIA H100", int(gib * GIB), 0, uuid=f"GPU-{i:08x}-0000")
                                  for i in range(n)))


NO_DRIVER = GpuSnapshot(error="NVML unavailable: NVML Shared Library Not Found")


@pytest.fixture
def listening():
    """A port held by a listening socket."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def by_name(checks) -> dict:
    return {c["name"] if isinstance(c, dict) else c.name: c for c in checks}


# --- plan() --------------------------------------------------------------------------------------

def test_plan_shape(write_recipe):
    r = R.load(write_recipe())
    out = plan.plan(r, FakeReader(gpus(8)))
    json.loads(json.dumps(out))  # JSON-serialisable as is
    assert isinstance(out["argv"], list) and out["argv"][:2] == ["megatron", "sft"]
    assert all(isinstance(w, str) for w in out["argv"])
    assert isinstance(out["env"], dict) and out["env"]["NPROC_PER_NODE"] == "8"
    assert out["recipe_hash"] == R.recipe_hash(r)
    assert out["backend"] == "megatron"
    assert out["checks"] and all(set(c) >= {"name", "ok", "detail"} for c in out["checks"])
    assert all(isinstance(c["ok"], bool) and c["detail"] for c in out["checks"])
    assert {"total_gib", "fits", "capacity_gib"} <= set(out["memory"])
    assert out["memory"]["capacity_gib"] == 80.0


def test_plan_all_ok(write_recipe, tmp_path):
    r = R.load(write_recipe(supervisor={"min_free_gib": 0}))
    checks = by_name(plan.plan(r, FakeReader(gpus(8)))["checks"])
    assert checks.pop("shared_memory")["fatal"] is False   # its verdict is this machine's /dev/shm's
    assert {n: c["ok"] for n, c in checks.items()} == {
        "model": True, "dataset": True, "disk:output_dir": True, "disk:persistent_dir": True, "gpus": True,
        "rendezvous_port": True, "experts_divisible_by_ep": True, "global_batch_divisible": True, "trainer": True}


@pytest.mark.parametrize("name", [p.name for p in RECIPES])
def test_plan_shipped_recipes(name):
    r = R.load(next(p for p in RECIPES if p.name == name))
    out = plan.plan(r, FakeReader(NO_DRIVER))
    json.dumps(out)
    assert out["argv"][1] == "sft"
    assert by_name(out["checks"])["gpus"]["ok"] is (not r.gpu.check)


def test_plan_without_driver_does_not_raise(write_recipe):
    r = R.load(write_recipe())
    out = plan.plan(r)  # the real NVML reader
    g = by_name(out["checks"])["gpus"]
    if "NVML" in g["detail"] and not g["ok"]:  # this machine: no driver
        assert "driver" in g["detail"]
        assert g["fatal"] is True
        assert out["memory"]["capacity_gib"] is None


def test_plan_gpus_check_fails_with_driver_message(write_recipe):
    out = plan.plan(R.load(write_recipe()), FakeReader(NO_DRIVER))
    g = by_name(out["checks"])["gpus"]
    assert g["ok"] is False and "driver" in g["detail"] and "NVML" in g["detail"]


def test_plan_gpu_check_disabled(write_recipe):
    r = R.load(write_recipe(gpu={"check": False, "capacity_gib": 141.0}))
    out = plan.plan(r)  # NullReader: nothing touches NVML
    g = by_name(out["checks"])["gpus"]
    assert g["ok"] is True and g["fatal"] is False and "disabled" in g["detail"]
    assert out["memory"]["capacity_gib"] == 141.0


def test_plan_uses_first_free_port(write_recipe, listening):
    if not host_probe.port_free(listening + 1):
        pytest.skip("neighbouring port busy too")
    r = R.load(write_recipe(supervisor={"port_range": [listening, listening + 1]}))
    assert plan.plan(r, FakeReader(gpus(8)))["env"]["MASTER_PORT"] == str(listening + 1)


# --- check_gpus ----------------------------------------------------------------------------------

@pytest.mark.parametrize("snap,ok,fragment", [
    (gpus(8), True, "NVML sees 8 GPU(s)"),
    (gpus(16), True, "NVML sees 16"),
    (gpus(4), False, "nproc_per_node = 8"),
    (gpus(0), False, "NVML sees 0"),
    (NO_DRIVER, False, "no NVIDIA driver"),
    (NullReader().snapshot(), False, "gpu.check = false"),
])
def test_check_gpus(write_recipe, snap, ok, fragment):
    c = preflight.check_gpus(R.load(write_recipe()), snap)
    assert c.ok is ok and fragment in c.detail and c.name == "gpus"


@pytest.mark.parametrize("visible,ok,fragment", [
    ("0,1,2,3,4,5,6,7", True, "CUDA_VISIBLE_DEVICES selects 8"),
    (",".join(f"GPU-{i:08x}-0000" for i in range(8, 16)), True, "selects 8"),
    ("GPU-00000008,GPU-0000000f", True, "selects 2"),                   # unique prefixes, as CUDA accepts
    ("GPU-0000000f,GPU-deadbeef", False, "GPU-deadbeef not among the 16 GPU(s)"),
    ("GPU-0000000", False, "GPU-0000000 not among"),                    # a prefix of 8 UUIDs: not unique
    ("3,16", False, "16 not among"),
    ("MIG-GPU-00000001-0000/1/0", False, "is a MIG instance"),
    ("0,x", False, "'x' is neither a GPU index nor a GPU UUID"),
])
def test_check_gpus_cuda_visible_devices(write_recipe, visible, ok, fragment):
    c = preflight.check_gpus(R.load(write_recipe(env={"vars": {"CUDA_VISIBLE_DEVICES": visible}})), gpus(16))
    assert (c.ok, c.fatal) == (ok, True) and fragment in c.detail, c.detail


def test_check_gpus_mig_ignored_when_checks_are_off(write_recipe):
    c = preflight.check_gpus(R.load(write_recipe(gpu={"check": False}, env={"vars": {"CUDA_VISIBLE_DEVICES": "MIG-1"}})),
                        NullReader().snapshot())
    assert c.ok is True and c.fatal is False


# --- check_trainer -------------------------------------------------------------------------------

def executable(path, mode: int = 0o755):
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("backend", ["megatron", "swift"])
def test_check_trainer_default_executable(write_recipe, backend):
    c = preflight.check_trainer(R.load(write_recipe(run={"backend": backend}, parallel={"nproc_per_node": 1, "expert": 1})))
    assert c.ok is True and c.name == "trainer" and c.fatal is True, c.detail  # installed next to this interpreter


def test_check_trainer_absolute_entrypoint(write_recipe, tmp_path):
    exe = executable(tmp_path / "train.sh")
    c = preflight.check_trainer(R.load(write_recipe(run={"entrypoint": [exe, "--flag"]})))
    assert c.ok is True and c.detail == exe


@pytest.mark.parametrize("entrypoint,fragment", [
    (["/nonexistent/bin/trainer"], "run.entrypoint[0] = '/nonexistent/bin/trainer': no executable file at that path"),
    (["no-such-trainer-xyz", "sft"], "run.entrypoint[0] = 'no-such-trainer-xyz': not found on PATH"),
    (["./relative-missing"], "'./relative-missing'"),
])
def test_check_trainer_missing_entrypoint(write_recipe, entrypoint, fragment):
    c = preflight.check_trainer(R.load(write_recipe(run={"entrypoint": entrypoint})))
    assert (c.ok, c.fatal, c.name) == (False, True, "trainer") and fragment in c.detail, c.detail
    assert "give an existing executable" in c.detail


def test_check_trainer_not_executable(write_recipe, tmp_path):
    exe = executable(tmp_path / "train.sh", 0o644)
    assert preflight.check_trainer(R.load(write_recipe(run={"entrypoint": [exe]}))).ok is False


def test_check_trainer_on_the_recipes_path(write_recipe, tmp_path):
    """A bare name is looked up on the trainer's PATH when the recipe sets one, as Popen does."""
    (tmp_path / "bin").mkdir()
    exe = executable(tmp_path / "bin" / "my-trainer")
    c = preflight.check_trainer(R.load(write_recipe(run={"entrypoint": ["my-trainer"]},
                                               env={"vars": {"PATH": str(tmp_path / "bin")}})))
    assert c.ok is True and c.detail == f"my-trainer -> {exe}"


def test_check_trainer_relative_to_output_dir(write_recipe, tmp_path):
    """The trainer starts in output_dir, so a relative entrypoint is found there."""
    (tmp_path / "out").mkdir()
    executable(tmp_path / "out" / "train.sh")
    assert preflight.check_trainer(R.load(write_recipe(run={"entrypoint": ["./train.sh"]}))).ok is True


def test_check_trainer_default_missing_names_the_fix(write_recipe, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(preflight.launcher.sys, "executable", str(tmp_path / "python"))  # no swift/megatron beside it
    c = preflight.check_trainer(R.load(write_recipe()))
    assert c.ok is False and "'megatron' (the megatron trainer)" in c.detail and "set run.entrypoint" in c.detail


# --- ports ---------------------------------------------------------------------------------------

def test_check_port_busy(write_recipe, listening):
    c = preflight.check_port(R.load(write_recipe(supervisor={"port_range": [listening, listening]})))
    assert c.ok is False and f"{listening}-{listening}" in c.detail and c.name == "rendezvous_port"


def test_check_port_skips_busy(write_recipe, listening):
    if not host_probe.port_free(listening + 1):
        pytest.skip("neighbouring port busy too")
    c = preflight.check_port(R.load(write_recipe(supervisor={"port_range": [listening, listening + 1]})))
    assert c.ok is True and c.detail.startswith(f"{listening + 1} free")


# --- model / dataset -----------------------------------------------------------------------------

@pytest.mark.parametrize("config,weights,ok,fragment", [
    (MODEL_CONFIG, True, True, "1 safetensors file(s)"),
    (None, True, False, "no config.json"),
    (MODEL_CONFIG, False, False, "no *.safetensors"),
    (None, False, False, "no config.json"),
])
def test_check_model(write_recipe, tmp_path, config, weights, ok, fragment):
    make_model(tmp_path / "m", config, weights)
    c = preflight.check_model(R.load(write_recipe(model={"path": "m", "num_experts": 16})))
    assert c.ok is ok and fragment in c.detail and c.name == "model"


def test_check_model_missing_dir(write_recipe):
    c = preflight.check_model(R.load(write_recipe(model={"path": "/nonexistent/model", "num_experts": 16})))
    assert c.ok is False and "/nonexistent/model" in c.detail


@pytest.mark.parametrize("dataset,val,ok,fragment", [
    (["data.jsonl"], [], True, "1 local file(s) found"),
    (["data.jsonl", "data.jsonl#10"], ["data.jsonl"], True, "3 local file(s)"),
    (["missing.jsonl"], [], False, "missing: "),
    (["data.jsonl"], ["nope.jsonl"], False, "nope.jsonl"),
    (["AI-ModelScope/alpaca-gpt4-data-en#500"], [], False, "non-local"),
    (["/abs/missing.jsonl#100"], [], False, "/abs/missing.jsonl#100"),
])
def test_check_data(write_recipe, dataset, val, ok, fragment):
    c = preflight.check_data(R.load(write_recipe(data={"dataset": dataset, "val_dataset": val})))
    assert c.ok is ok and fragment in c.detail and c.name == "dataset"


# --- disk / layout -------------------------------------------------------------------------------

@pytest.mark.parametrize("sections,ep_ok,ep_fatal", [
    ({}, True, True),
    ({"model": {"path": "/nonexistent/model"}}, False, False),     # expert count unknown: a warning
    ({"model": {"path": "/nonexistent/model", "num_experts": 64}}, True, True),
])
def test_check_layout(write_recipe, sections, ep_ok, ep_fatal):
    ep, gbs = preflight.check_layout(R.load(write_recipe(**sections)))
    assert (ep.name, ep.ok, ep.fatal) == ("experts_divisible_by_ep", ep_ok, ep_fatal)
    assert gbs.ok is True and "DP 8" in gbs.detail


def test_preflight_names(write_recipe):
    names = [c.name for c in preflight.checks(R.load(write_recipe()), gpus(8))]
    assert names == ["model", "dataset", "disk:output_dir", "disk:persistent_dir", "gpus", "rendezvous_port",
                     "experts_divisible_by_ep", "global_batch_divisible", "trainer", "shared_memory"]


# --- memory --------------------------------------------------------------------------------------

def test_memory_from_config_and_index(write_recipe, tmp_path):
    # No attention shape in the config: the weights are sized from the index's total.
    d = make_model(tmp_path / "big", {**MODEL_CONFIG, "hidden_size": 4096, "num_hidden_layers": 60,
                                      "vocab_size": 150_000, "moe_intermediate_size": 1024,
                                      "num_attention_heads": None})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 40 * GIB}}))
    r = R.load(write_recipe(model={"path": "big"}))
    with_index = plan.memory(r, gpus(8, 80))
    (d / "model.safetensors.index.json").write_text("{}")
    without = plan.memory(r, gpus(8, 80))
    assert with_index.capacity_gib == 80
    assert with_index.base_weights_gib != without.base_weights_gib
    assert with_index.base_weights_gib > 0 and without.base_weights_gib > 0


def test_memory_counts_structured_config_not_index(write_recipe, tmp_path):
    # The index also counts weights megatron does not build (MTP layers unless --mtp_num_layers).
    d = make_model(tmp_path / "big", {**MODEL_CONFIG, "hidden_size": 4096, "num_hidden_layers": 60})
    r = R.load(write_recipe(model={"path": "big"}))
    without = plan.memory(r, gpus(8, 80))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 400 * GIB}}))
    assert plan.memory(r, gpus(8, 80)).base_weights_gib == without.base_weights_gib


def test_memory_unknown_model(write_recipe):
    r = R.load(write_recipe(model={"path": "/nonexistent/model", "num_experts": 16}))
    e = plan.memory(r, NO_DRIVER)
    assert e.base_weights_gib == 0 and any("config.json" in n for n in e.notes)


# --- the save interval plan starts with (interval.py) ------------------------------------------
@pytest.mark.parametrize("save_steps, mode", [(100, "fixed"), ("auto", "auto")])
def test_plan_shows_the_save_interval(save_steps, mode, monkeypatch, tmp_path):
    from orchestrator.host import node_history
    from orchestrator.store.rundir import run_id
    r = R.load(next(p for p in RECIPES if p.name.startswith("qwen3.5-397b")))
    shipped = r.model_copy(update={"checkpoint": r.checkpoint.model_copy(update={"save_steps": "auto"})})
    auto = plan.plan(shipped, FakeReader(NO_DRIVER))["save_interval"]["auto"]  # no HF adapter: a 2 s save
    assert auto["steps"] == 10 and auto["save_s"] < 2.5 and auto["background_s"] > 140  # Daly ~178 s: 10 steps
    # with the HF adapter at every save (28.3 GiB written before training goes on): Young/Daly decides
    r = r.model_copy(update={"checkpoint": r.checkpoint.model_copy(update={"save_steps": save_steps,
                                                                           "save_safetensors": True})})
    out = plan.plan(r, FakeReader(NO_DRIVER))  # not probed: the default write speed
    si = out["save_interval"]
    argv = out["argv"]
    assert si["mode"] == mode and int(argv[argv.index("--save_steps") + 1]) == si["steps"]
    assert "Young/Daly" in si["reason"] and "default write speed" in si["auto"]["save_source"]
    assert si["steps"] == (100 if mode == "fixed" else si["auto"]["steps"])
    # an earlier run on this node that crashed every half hour: a shorter start
    node_history.NodeHistory().record("another-run", 40, 20.0, 1.0)
    assert plan.plan(r, FakeReader(NO_DRIVER))["save_interval"]["auto"]["steps"] < si["auto"]["steps"]
    node_history.NodeHistory().record(run_id(r.run.output_dir), 1000, 1.0, 1.0)  # its own entry is not "earlier"
    assert plan.plan(r, FakeReader(NO_DRIVER))["save_interval"]["auto"]["failures"] == 40


@pytest.mark.parametrize("parallel, data, ok", [
    ({"nproc_per_node": 8}, {}, False),                                       # NCCL's shm transport
    ({"nproc_per_node": 1, "expert": 1}, {"dataloader_num_workers": 4}, False),   # DataLoader batches
    ({"nproc_per_node": 1, "expert": 1}, {}, True),                           # nothing puts much there
], ids=["eight_ranks", "workers", "one_rank"])
def test_check_shm_on_a_container_sized_tmpfs(write_recipe, mount_tmpfs, parallel, data, ok):
    shm = mount_tmpfs("size=64m")     # Docker's default /dev/shm
    c = preflight.check_shm(R.load(write_recipe(parallel=parallel, data=data)), str(shm))
    assert (c.ok, c.fatal) == (ok, False) and "64 MiB in all" in c.detail, c
    if not ok:
        assert "too small for" in c.detail and "--shm-size" in c.detail


def test_check_shm_names_a_missing_mount(write_recipe, tmp_path):
    c = preflight.check_shm(R.load(write_recipe()), str(tmp_path / "no-shm"))
    assert not c.ok and not c.fatal and "cannot read its size" in c.detail
