"""The supervisor loop against the fake trainer: every crash class recovered (or not) as the policy says."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from orchestrator.host.launch import local
from orchestrator.store.rundir import run_id
from orchestrator.types import CrashClass, ExitCode
from supervised import attempts, cli, events, fake_recipe, journal, logged_steps, published_at, supervise

RECOVERED = [c for c in CrashClass if c not in (CrashClass.OTHER,)]


@pytest.mark.parametrize("cls", RECOVERED, ids=lambda c: c.value)
def test_each_class_is_classified_and_recovered(tmp_path, cls):
    step = 0 if cls in (CrashClass.COLD_START_OOM, CrashClass.PORT_IN_USE) else 15
    recipe = fake_recipe(tmp_path, faults=f"{cls.value}@{step}")
    code, _ = supervise(recipe)
    assert code == ExitCode.OK
    runs = attempts(tmp_path / "out")
    assert [a.cls for a in runs] == [cls, None]
    assert runs[-1].end_step == 40 and runs[-1].exit_code == 0
    if step:  # resumed from the newest verified checkpoint before the fault
        assert runs[1].resumed_from == str(tmp_path / "out" / "checkpoint-10")
        assert runs[1].start_step == 10
    assert runs[0].evidence, "the deciding log lines are recorded"
    if cls is CrashClass.PORT_IN_USE:
        assert runs[1].port != runs[0].port


def test_class_other_gives_up_with_exit_3(tmp_path):
    recipe = fake_recipe(tmp_path, faults="other@0")
    code, sup = supervise(recipe)
    assert code == ExitCode.GAVE_UP
    runs = attempts(tmp_path / "out")
    assert len(runs) == 1 and runs[0].cls is CrashClass.OTHER
    assert any("remaining_argv" in line for line in runs[0].evidence)


def test_nan_loss_twice_in_a_row_gives_up(tmp_path):
    # Without FAKE_STATE the fault fires on every launch: the NaN comes back after the resume.
    code, _ = supervise(fake_recipe(tmp_path, faults="nan_loss@15", state=False))
    assert code == ExitCode.GAVE_UP
    assert [a.cls for a in attempts(tmp_path / "out")] == [CrashClass.NAN_LOSS, CrashClass.NAN_LOSS]


def test_crash_loop_without_checkpoint_progress_gives_up(tmp_path):
    recipe = fake_recipe(tmp_path, faults="cold_start_oom@0", state=False,
                         supervisor={"max_relaunches_without_progress": 3})
    code, sup = supervise(recipe)
    assert code == ExitCode.GAVE_UP
    assert len(attempts(tmp_path / "out")) == 3
    assert "without checkpoint progress" in sup.exit_reason


def test_crash_loop_backs_off_and_alerts(tmp_path):
    faults = ",".join(f"fla_backward_oom@{s}" for s in (12, 22, 32, 35))
    recipe = fake_recipe(tmp_path, faults=faults, supervisor={"max_crashes_per_hour": 3, "wait_s": 0.05})
    code, sup = supervise(recipe)
    assert code == ExitCode.OK
    kinds = [e["data"].get("evidence") and e["message"] for e in events(tmp_path / "out", "crash")]
    assert "backing off" in kinds[3] and "backing off" not in kinds[2]
    states = [e["message"] for e in events(tmp_path / "out", "state")]
    assert "cleaning -> backoff" in states


def test_hang_is_detected_stacks_dumped_and_restarted(tmp_path):
    code, _ = supervise(fake_recipe(tmp_path, faults="nccl_timeout_hang@25"))
    assert code == ExitCode.OK
    runs = attempts(tmp_path / "out")
    assert runs[0].cls is CrashClass.NCCL_TIMEOUT_HANG and "no new training step" in runs[0].evidence[0]
    assert runs[0].signal == signal.SIGTERM and runs[0].hang_detected_at is not None
    if shutil.which("py-spy", path=os.path.dirname(sys.executable)):
        assert "fake_trainer.py" in (tmp_path / "out" / ".orchestrator" / "stacks-0001.txt").read_text()


def test_steps_never_go_back_past_the_last_good_checkpoint(tmp_path):
    code, _ = supervise(fake_recipe(tmp_path, faults="cuda_fatal@17,nccl_error@33"))
    assert code == ExitCode.OK
    runs = attempts(tmp_path / "out")
    assert [r.start_step for r in runs] == [0, 10, 30]
    steps = logged_steps(tmp_path / "out")
    assert set(steps) == set(range(1, 41))


def test_invalid_checkpoint_is_alerted_and_never_resumed_from(tmp_path, monkeypatch):
    recipe = fake_recipe(tmp_path, faults="fla_backward_oom@25")
    out = tmp_path / "out"
    # Corrupt checkpoint-20 the moment it is written: a stub adapter with a header and no tensors.
    from orchestrator.loop.supervisor import Supervisor
    from orchestrator.config.recipe import load

    from orchestrator.store.tracker import CheckpointTracker

    sup = Supervisor(load(recipe), install_signals=False)
    original = CheckpointTracker.scan

    def corrupt_then_scan(self, *args, **kwargs):
        ck = out / "checkpoint-20" / "adapter_model.safetensors"
        if ck.exists() and ck.stat().st_size > 100:
            header = b'{"__metadata__": {"format": "pt"}}'
            ck.write_bytes(len(header).to_bytes(8, "little") + header)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointTracker, "scan", corrupt_then_scan)
    assert sup.run() == ExitCode.OK
    runs = attempts(out)
    assert runs[1].resumed_from == str(out / "checkpoint-10")
    assert any("checkpoint-20" in e["message"] for e in events(out, "checkpoint_invalid"))
    assert (published_at(recipe) / "checkpoint-10").is_dir() and not (published_at(recipe) / "checkpoint-20").exists()


def test_resume_divergence_stops_the_run(tmp_path):
    recipe = fake_recipe(tmp_path, faults="fla_backward_oom@15")
    assert supervise(recipe, "checkpoint.keep_local=10")[0] == ExitCode.OK  # local retention keeps checkpoint-10
    # A second run of the same recipe in a new directory, seeded with checkpoint-10 and a
    # logging.jsonl that says step 11 had a very different loss before the "crash".
    out2 = tmp_path / "out2"
    out2.mkdir()
    shutil.copytree(tmp_path / "out" / "checkpoint-10", out2 / "checkpoint-10")
    rec = {"loss": 99.0, "grad_norm": 1.0, "learning_rate": 1e-4, "iteration": "11/40"}
    (out2 / "logging.jsonl").write_text(json.dumps(rec) + "\n")
    code, sup = supervise(recipe, f"run.output_dir={json.dumps(str(out2))}", "run.persistent_dir=\"\"", healthy=False)
    assert code == ExitCode.GAVE_UP
    assert "resume divergence" in sup.exit_reason
    assert events(out2, "resume_divergence")
    # Regression: the give-up left the attempt's row open, and the next `run` reported it as "supervisor
    # restarted while this attempt ran".
    last = attempts(out2)[-1]
    assert last.ended_at is not None and last.cls is None and "resume divergence" in " ".join(last.evidence)


def test_metrics_are_served_while_running(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=400, extra_env={"FAKE_STEP_S": "0.02"})
    from orchestrator.config.recipe import load
    from orchestrator.loop.supervisor import Supervisor
    import threading

    sup = Supervisor(load(recipe), install_signals=False)
    t = threading.Thread(target=sup.run)
    t.start()
    try:
        deadline = time.monotonic() + 30
        body = ""
        while time.monotonic() < deadline:
            port = sup.ctx.metrics_port if sup.ctx else None
            if port and sup.attempt and sup.attempt.last and sup.attempt.last.step > 5:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                if 'orchestrator_state{state="running"} 1.0' in body:
                    break
            time.sleep(0.05)
        assert 'orchestrator_state{state="running"} 1.0' in body
        assert "orchestrator_training_step" in body and "orchestrator_info{" in body
    finally:
        sup.request_stop("test over")
        t.join(60)
    assert sup.state.value == "stopped"


def test_second_supervisor_on_the_same_run_is_refused(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=2000)
    first = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(recipe)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock = tmp_path / "out" / ".orchestrator" / "lock"
        deadline = time.monotonic() + 30
        while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        second = cli("run", str(recipe), timeout=60)
        assert second.returncode == ExitCode.BAD_INPUT
        assert "another supervisor" in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0


def _wait_for_step(out: Path, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jl = out / "logging.jsonl"
        if jl.exists() and logged_steps(out) and max(logged_steps(out)) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def test_sigterm_stops_training_gracefully_and_exits_0(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=3000)
    p = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(recipe)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    _wait_for_step(tmp_path / "out", 12)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert not local.run_processes(run_id(tmp_path / "out"))
    assert "stopped" in out
    assert any("signal SIGTERM" in e["message"] for e in events(tmp_path / "out", "stop"))


def test_restarted_supervisor_stops_its_predecessors_training_first(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=3000)
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(recipe)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_step(out, 12)
    trainers = local.run_processes(run_id(out))
    assert trainers
    first.kill()  # the supervisor dies with -9; its trainer keeps running
    first.wait()
    assert all(t.is_running() for t in trainers)
    second = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(recipe)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        old_pids = {t.pid for t in trainers}

        def new_trainers() -> set[int]:
            return {p.pid for p in local.run_processes(run_id(out))
                    if "fake_trainer" in " ".join(p.cmdline()) and p.pid not in old_pids}

        # The attempt row is written before the launch, so wait for the new trainer process itself.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not new_trainers():
            time.sleep(0.05)
        assert len(attempts(out)) == 2
        assert not any(t.is_running() and t.status() != psutil.STATUS_ZOMBIE for t in trainers), \
            "the predecessor's trainer was stopped before the new launch"
        assert events(out, "predecessor")
        assert len(new_trainers()) == 1
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(60)


@pytest.mark.parametrize("policy, expect_code, expect_dir", [
    ("fresh", ExitCode.OK, "fresh"), ("refuse", ExitCode.GAVE_UP, None), ("resume", ExitCode.OK, "same")])
def test_recipe_drift_policies(tmp_path, policy, expect_code, expect_dir):
    recipe = fake_recipe(tmp_path, iterations=20, save_steps=10)
    assert supervise(recipe)[0] == ExitCode.OK
    r = cli("run", str(recipe), "--set", "optim.lr=3e-4", "--set", f"run.on_drift=\"{policy}\"")
    assert r.returncode == expect_code, r.stderr
    fresh_dirs = [d for d in tmp_path.iterdir() if d.name.startswith("out-")]
    if expect_dir == "fresh":
        assert len(fresh_dirs) == 1 and (fresh_dirs[0] / "checkpoint-20").exists()
        assert (tmp_path / "out" / "checkpoint-20").exists(), "old checkpoints are kept"
    elif expect_dir is None:
        assert "optim.lr" in r.stderr and not fresh_dirs
    else:
        assert not fresh_dirs and any("optim.lr" in e["message"] for e in events(tmp_path / "out", "drift"))


def test_resumes_from_persistent_storage_when_local_disk_is_gone(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=40, faults="nan_loss@25", state=False)
    assert supervise(recipe)[0] == ExitCode.GAVE_UP  # NaN twice after checkpoint-20
    # checkpoint-20 was published; the "new instance" has an empty local disk.
    assert (published_at(recipe) / "checkpoint-20").exists()
    shutil.rmtree(tmp_path / "out")
    code, _ = supervise(recipe, 'env.vars.FAKE_FAULTS=""')
    assert code == ExitCode.OK
    runs = attempts(tmp_path / "out")
    assert runs[0].resumed_from == str(tmp_path / "out" / "checkpoint-20")


class HeldGpus:
    """NVML stand-in: GPU 3 is held by `holder` (30 GiB) for as long as that process lives."""

    def __init__(self, holder: subprocess.Popen):
        self.holder = holder
        self.calls = 0

    def snapshot(self):
        from orchestrator.types import GpuInfo, GpuProcess, GpuSnapshot

        self.calls += 1
        held = self.holder.poll() is None
        gpus = tuple(GpuInfo(i, "H200", 141 << 30, (30 << 30) if held and i == 3 else 0,
                             (GpuProcess(self.holder.pid, 30 << 30),) if held and i == 3 else ())
                     for i in range(8))
        return GpuSnapshot(gpus=gpus)


@pytest.mark.parametrize("allowed", [True, False], ids=["kill_pattern_matches", "no_kill_pattern"])
def test_foreign_gpu_holder_is_killed_only_when_the_recipe_allows(tmp_path, allowed):
    from orchestrator.config.recipe import load
    from orchestrator.loop.supervisor import Supervisor
    import threading

    holder = subprocess.Popen(["sleep", "300"])
    patterns = '["^sleep 300$"]' if allowed else "[]"
    recipe = fake_recipe(tmp_path, iterations=20)
    sup = Supervisor(load(recipe, ["gpu.check=true", f"gpu.kill_patterns={patterns}",
                                   "supervisor.backoff_max_s=0.2"]),
                     gpu_reader=HeldGpus(holder), install_signals=False)
    result = []
    t = threading.Thread(target=lambda: result.append(sup.run()))
    t.start()
    try:
        if allowed:
            t.join(60)
            assert result == [ExitCode.OK]
            assert holder.wait(5) == -signal.SIGKILL
            ev = events(tmp_path / "out", "gpus_not_clear")
            assert ev[0]["data"]["killed_foreign"] == [holder.pid]
        else:
            deadline = time.monotonic() + 30
            while len(events(tmp_path / "out", "gpus_not_clear")) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(events(tmp_path / "out", "gpus_not_clear")) >= 3
            assert sup.state.value == "verifying" and not attempts(tmp_path / "out"), "never launched onto busy GPUs"
            assert holder.poll() is None, "a process outside the run is never killed without a pattern"
            assert any(holder.pid in e["data"].get("spared_foreign", []) for e in events(tmp_path / "out", "gpus_not_clear"))
    finally:
        sup.request_stop("test over")
        t.join(60)
        holder.kill()
        holder.wait()


def test_spot_notice_stops_training_and_publishes_the_last_checkpoint(tmp_path):
    notice = tmp_path / "reclaim"
    recipe = fake_recipe(tmp_path, iterations=3000, supervisor={"spot_notice_file": str(notice)})
    p = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(recipe)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    _wait_for_step(tmp_path / "out", 25)
    notice.write_text("instance-action: terminate\n")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    stop = events(tmp_path / "out", "stop")
    assert stop and "spot interruption" in stop[0]["message"] and "terminate" in stop[0]["message"]
    j = journal(tmp_path / "out")
    rows = {c["step"]: c["synced_at"] for c in j.checkpoints() if c["ok"]}
    j.close()
    # the newest verified one (a save on SIGTERM may come after the one last-checkpoint names)
    assert (published_at(recipe) / f"checkpoint-{max(rows)}").is_dir(), "the final sync published the newest"
    assert rows[max(rows)], "the journal knows what reached persistent storage"
    assert not local.run_processes(run_id(tmp_path / "out"))


def test_sd_notify_ready_status_watchdog_and_stopping_reach_systemd(tmp_path):
    import socket as pysocket

    sock_path = str(tmp_path / "notify.sock")
    sock = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(0.5)
    recipe = fake_recipe(tmp_path, iterations=30)
    env = {**os.environ, "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "200000"}
    p = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(recipe)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    messages = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            try:
                messages.append(sock.recv(4096).decode())
            except TimeoutError:
                if p.poll() is not None:
                    break  # exited and nothing more queued
    finally:
        p.wait(60)
        sock.close()
    assert p.returncode == 0
    joined = "\n".join(messages)
    assert "READY=1" in joined and "WATCHDOG=1" in joined and "STOPPING=1" in joined
    assert any(m.startswith("STATUS=running") for m in messages)
    assert messages.index(next(m for m in messages if "READY=1" in m)) < \
        messages.index(next(m for m in messages if m.startswith("STATUS=running")))
    # The trainer does not inherit the socket: only the supervisor talks to systemd.
    log = (tmp_path / "out" / ".orchestrator" / "attempts" / "attempt-0001.log").read_text()
    assert "NOTIFY_SOCKET" not in log


def test_a_completed_run_is_not_launched_again(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=20)
    assert supervise(recipe)[0] == ExitCode.OK
    code, sup = supervise(recipe)
    assert code == ExitCode.OK and sup.state.value == "completed"
    assert len(attempts(tmp_path / "out")) == 1
    assert events(tmp_path / "out", "complete")
