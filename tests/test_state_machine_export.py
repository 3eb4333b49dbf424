"""checkpoint.merge = "final", table-tested on the fake host: after the last step the export of the newest
verified checkpoint is one more attempt (kind "export") of the same loop; a merged copy takes its
published name (checkpoint-N-merged) only after it verifies. Real files in tmp_path; the exporter is the
fake host's trainer: the test writes what ms-swift would have written into the --output_dir it was given."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoint_dirs import make_megatron
from loop_world import BASE, MAX, OOM, drive, journal
from orchestrator.types import Action, CrashClass, State

FINAL = {"checkpoint": {"merge": "final"}, "lora": {"rank": 8, "alpha": 32}}


def write_export(out: Path, shards: int = 2, drop: int | None = None) -> None:
    """What `megatron export --to_hf` writes: config.json, shards, model.safetensors.index.json."""
    out.mkdir(parents=True, exist_ok=True)
    wmap, total = {}, 0
    for k in range(1, shards + 1):
        shard = f"model-{k:05d}-of-{shards:05d}.safetensors"
        t = {f"model.layers.{k}.mlp.weight": np.ones((8, 8), np.float32)}
        wmap.update({n: shard for n in t})
        total += 8 * 8 * 4
        if k != drop:
            save_file(t, str(out / shard))
    (out / "model.safetensors.index.json").write_text(
        f'{{"metadata": {{"total_size": {total}}}, "weight_map": {__import__("json").dumps(wmap)}}}')
    (out / "config.json").write_text("{}")


def option(argv, name: str) -> str:
    return argv[argv.index(f"--{name}") + 1]


def trained(sup, host):
    """Training to max steps with checkpoint-MAX saved, exited 0: one RUNNING pass."""
    drive(sup, State.RUNNING)
    t = host.trainers[-1]
    make_megatron(sup.ctx.out, MAX)
    t.steps(1, MAX, MAX)
    t.exit(code=0)
    return sup.step()


def exporting(sup, host):
    assert trained(sup, host) is State.VERIFYING
    drive(sup, State.RUNNING)
    return host.trainers[-1]


def test_training_done_goes_to_the_export_not_completed(world):
    sup, host = world(**FINAL)
    assert trained(sup, host) is State.VERIFYING
    j = journal(sup)
    assert j.get_all()["training_done"] == {"step": MAX, "recipe_hash": sup.hash}
    first = j.last_attempt()
    assert first.kind == "train" and first.ended_at is not None and first.cls is None
    assert sup.step() is State.RELAUNCHING and sup.step() is State.RUNNING
    cmd = host.trainers[-1].cmd
    ckpt = str(sup.ctx.out / f"checkpoint-{MAX}")
    assert cmd.argv[1] == "export" and option(cmd.argv, "adapters") == ckpt
    assert option(cmd.argv, "merge_lora") == "true" and option(cmd.argv, "to_hf") == "true"
    assert option(cmd.argv, "output_dir") == str(sup.ctx.out / f".partial-checkpoint-{MAX}-merged")
    assert option(cmd.argv, "exist_ok") == "true" and "sft" not in cmd.argv
    row = journal(sup).last_attempt()
    assert row.kind == "export" and row.n == 2 and row.resumed_from == ckpt and row.start_step == MAX


def test_merge_never_completes_at_the_last_step(world):
    sup, host = world(lora=FINAL["lora"], checkpoint={"merge": "never"})
    assert trained(sup, host) is State.COMPLETED
    assert "training_done" not in journal(sup).get_all()


@pytest.mark.parametrize("merge", ["never", "final"])
def test_a_final_checkpoint_that_fails_verification_is_not_complete(world, merge):
    """Exit 0 at the last step is complete only when the last save verifies: with merge = "final" the
    export would otherwise merge an older checkpoint as the run's result, steps short."""
    sup, host = world(lora=FINAL["lora"], checkpoint={"merge": merge})
    drive(sup, State.RUNNING)
    t = host.trainers[-1]
    make_megatron(sup.ctx.out, MAX // 2)
    adapter = make_megatron(sup.ctx.out, MAX) / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])  # a torn save
    t.steps(1, MAX, MAX)
    t.exit(code=0)
    assert sup.step() is State.CRASHED
    crash = sup.attempt.crash
    assert crash.cls is CrashClass.OTHER and f"exited 0 at step {MAX}" in crash.evidence[0]
    assert any(f"checkpoint-{MAX}" in e for e in crash.evidence[1:]), crash.evidence
    assert sup.step() is State.CLEANING and sup.attempt.decision.action is Action.GIVE_UP
    assert "training_done" not in journal(sup).get_all()


@pytest.mark.parametrize("merge, saved_last, next_state", [
    ("never", True, State.COMPLETED),
    ("final", True, State.VERIFYING),    # the export comes next
    ("never", False, State.CRASHED),     # the last save is missing: steps to redo
])
def test_a_failure_at_teardown_after_the_last_verified_save_is_complete(world, merge, saved_last, next_state):
    """Every step done and the last checkpoint verified, then a nonzero exit while tearing down (a gloo rank's
    "terminate called without an active exception" at exit, seen on the 2-node run): nothing to redo."""
    sup, host = world(lora=FINAL["lora"], checkpoint={"merge": merge})
    drive(sup, State.RUNNING)
    t = host.trainers[-1]
    make_megatron(sup.ctx.out, MAX // 2)
    if saved_last:
        make_megatron(sup.ctx.out, MAX)
    t.steps(1, MAX, MAX)
    t.write("terminate called without an active exception")
    t.exit(code=1)
    assert sup.step() is next_state
    teardown = [e for e in journal(sup).events() if e["kind"] == "teardown_failure"]
    assert bool(teardown) is saved_last
    if saved_last:
        assert f"exited 1 after its last step {MAX}" in teardown[0]["message"]


def _ok(sup, t):
    write_export(Path(option(t.cmd.argv, "output_dir")))
    t.exit(code=0)


def _partial_exit_0(sup, t):  # a shard listed in the index is missing
    write_export(Path(option(t.cmd.argv, "output_dir")), drop=2)
    t.exit(code=0)


def _oom(sup, t):
    write_export(Path(option(t.cmd.argv, "output_dir")), drop=2)
    t.write(OOM)
    t.exit(code=1)


def _killed(sup, t):
    write_export(Path(option(t.cmd.argv, "output_dir")), drop=1)
    t.exit(signal=9)


def _no_exit(sup, t):  # an export logs no steps: startup_timeout_s bounds it
    sup.host.mono += BASE["supervisor"]["startup_timeout_s"] + 1


def _still_running(sup, t):
    pass


@pytest.mark.parametrize("event, next_state, cls, action", [
    (_ok, State.COMPLETED, None, None),
    (_partial_exit_0, State.CRASHED, CrashClass.OTHER, Action.GIVE_UP),
    (_oom, State.CRASHED, CrashClass.COLD_START_OOM, Action.RELAUNCH),
    (_killed, State.CRASHED, CrashClass.HOST_OOM_KILLED, Action.RELAUNCH),
    (_no_exit, State.CRASHED, CrashClass.NCCL_TIMEOUT_HANG, Action.RELAUNCH),
    (_still_running, State.RUNNING, None, None),
], ids=lambda v: getattr(v, "__name__", None))
def test_export_attempt(world, event, next_state, cls, action):
    sup, host = world(**FINAL)
    t = exporting(sup, host)
    event(sup, t)
    assert sup.step() is next_state
    merged = sup.ctx.out / f"checkpoint-{MAX}-merged"
    assert merged.is_dir() == (next_state is State.COMPLETED), "only a verified export takes the published name"
    if next_state is State.COMPLETED:
        assert not (sup.ctx.out / f".partial-checkpoint-{MAX}-merged").exists()
        row = journal(sup).last_attempt()
        assert row.kind == "export" and row.ended_at is not None and row.cls is None
    if cls is not None:
        assert sup.attempt.crash.cls is cls, sup.attempt.crash
        assert sup.step() is State.CLEANING and sup.attempt.decision.action is action
        if cls is CrashClass.NCCL_TIMEOUT_HANG:
            assert "startup_timeout_s" in sup.attempt.crash.evidence[0]


def test_a_failed_export_is_exported_again_into_a_clean_staging_dir(world):
    sup, host = world(**FINAL)
    t = exporting(sup, host)
    _oom(sup, t)
    staging = Path(option(t.cmd.argv, "output_dir"))
    assert sup.step() is State.CRASHED
    drive(sup, State.RUNNING)   # crashed -> cleaning -> waiting -> verifying -> relaunching -> running
    again = host.trainers[-1]
    assert again is not t and again.cmd.argv[1] == "export" and option(again.cmd.argv, "output_dir") == str(staging)
    assert not staging.exists(), "the failed export's partial files are gone before the export runs again"
    assert not (sup.ctx.out / f"checkpoint-{MAX}-merged").exists()
    _ok(sup, again)
    assert sup.step() is State.COMPLETED and (sup.ctx.out / f"checkpoint-{MAX}-merged").is_dir()
    assert [a.kind for a in journal(sup).attempts()] == ["train", "export", "export"]


def test_a_supervisor_restarted_after_training_goes_straight_to_the_export(world):
    sup, host = world(**FINAL)
    assert trained(sup, host) is State.VERIFYING
    sup.shutdown()
    again, host2 = world(**FINAL)
    drive(again, State.RUNNING)
    assert [t.cmd.argv[1] for t in host2.trainers] == ["export"]
    assert journal(again).last_attempt().kind == "export"


def test_a_supervisor_restarted_during_the_export_exports_again(world):
    sup, host = world(**FINAL)
    t = exporting(sup, host)
    write_export(Path(option(t.cmd.argv, "output_dir")), drop=2)  # killed mid-write with the supervisor
    sup.shutdown()
    again, host2 = world(**FINAL)
    drive(again, State.RUNNING)
    assert [t.cmd.argv[1] for t in host2.trainers] == ["export"]
    assert not (again.ctx.out / f"checkpoint-{MAX}-merged").exists()


def test_a_verified_merged_copy_completes_a_restarted_run(world):
    """Killed after the export finished, before COMPLETED was recorded: its verified output completes the run."""
    sup, host = world(**FINAL)
    t = exporting(sup, host)
    write_export(Path(option(t.cmd.argv, "output_dir")))
    sup.shutdown()
    again, host2 = world(**FINAL)
    drive(again, State.COMPLETED)
    assert not host2.trainers and (again.ctx.out / f"checkpoint-{MAX}-merged").is_dir()


@pytest.mark.parametrize("merge, after", [("never", State.COMPLETED), ("final", State.VERIFYING)])
def test_a_checkpoint_of_the_last_step_is_never_relaunched_from(world, merge, after):
    """A trainer stopped as hung that ran on to the end while it was being stopped (seen on Slurm: TERM + CONT
    let the tiny model finish): ms-swift resumed from the last step's checkpoint trains a step past the end.
    Nothing is launched: COMPLETED, or with merge = "final" the export next."""
    sup, host = world(checkpoint={"merge": merge}, lora=FINAL["lora"])
    drive(sup, State.RUNNING)
    t = host.trainers[-1]
    t.steps(1, 5, MAX)
    t.write(OOM)
    t.exit(code=1)
    assert sup.step() is State.CRASHED
    make_megatron(sup.ctx.out, MAX)  # written on the way out
    drive(sup, State.RELAUNCHING)
    assert sup.step() is after and len(host.trainers) == 1
    j = journal(sup)
    assert any("checkpoint of the last step" in e["message"] for e in j.events() if e["kind"] == "training_done")
    if merge == "final":
        drive(sup, State.RUNNING)
        assert j.last_attempt().kind == "export" and "export" in host.trainers[-1].cmd.argv
