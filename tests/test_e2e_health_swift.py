"""Run health against the real stack: `swift sft` (ms-swift 4.6) LoRA of the tiny MoE on CPU, supervised.

(b) the field's case: the trainer dies right after a save; the resumed attempt loads wrong weights although the
    checkpoint verifies (tests/support/perturb_resume.py adds noise to the output embeddings of the base model's
    copy the trainer loads): the jump is caught, the suspect checkpoint quarantined, the run relaunched from the one
    before it and completed; when every resume loads wrong weights, the run stops saying the resume path is
    broken (exit 3).
(c) a real slowdown: the running trainer's cgroup v1 CPU quota is cut mid-run (root only): throughput_drop with
    the cgroup's throttling as evidence, throughput_recovered once the quota is restored, `slow` in goodput.
(d) a normal run raises no health event (test_e2e_swift's and the demo's runs are checked there too).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.host.journal_goodput import goodput_of
from orchestrator.host.launch import local as launcher
from orchestrator.loop.supervisor import Supervisor
from orchestrator.types import ExitCode
from supervised import attempts, events, health_events, journal
from swift_recipe import recipe
from cpu_cgroup import CPU_V1, why_no_cpu_quota

pytestmark = [pytest.mark.swift,
              pytest.mark.skipif(importlib.util.find_spec("swift") is None, reason="ms-swift not installed (swift extra)")]

WRAPPER = Path(__file__).parent / "support" / "perturb_resume.py"
SWIFT = shutil.which("swift") or str(Path(sys.executable).with_name("swift"))


def kill_after_save(sup: Supervisor, step: int) -> threading.Thread:
    """SIGKILLs the first attempt's trainer tree as soon as its save of `step` is complete (ms-swift points
    last-checkpoint at it once written): the crash comes right after a save, so (almost) nothing is redone."""
    def watch() -> None:
        while not sup.stop_event.wait(0.02):
            a = sup.attempt
            if a is None or sup.ctx is None:
                continue
            if a.n != 1 or a.launched.status is not None:
                return
            try:
                saved = os.readlink(sup.ctx.out / "last-checkpoint").rstrip("/").endswith(f"checkpoint-{step}")
            except OSError:
                saved = False
            if saved:
                launcher.kill_pids([p.pid for p in launcher.tree(a.launched.pid)], signal.SIGKILL)
                return
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def wrong_weights_run(tiny, tmp_path: Path, perturb_steps: str) -> tuple[ExitCode, Supervisor, Path]:
    out = tmp_path / "out"
    r = recipe(tiny, tmp_path, "checkpoint.save_steps=5", "checkpoint.keep_local=10",
               f"run.entrypoint={json.dumps([sys.executable, str(WRAPPER), '--', SWIFT])}",
               'env.vars.PERTURB_TARGET="model"', 'env.vars.PERTURB_NOISE="1.0"', f'env.vars.PERTURB_STEPS="{perturb_steps}"',
               f"env.vars.PERTURB_LOG={json.dumps(str(tmp_path / 'perturbed.log'))}",
               f"env.vars.PERTURB_SCRATCH={json.dumps(str(tmp_path / 'scratch'))}")
    sup = Supervisor(r, install_signals=False)
    kill_after_save(sup, 10)
    return sup.run(), sup, out


def test_a_resume_from_wrong_weights_is_rolled_back_to_the_checkpoint_before_and_completes(tiny, tmp_path):
    code, sup, out = wrong_weights_run(tiny, tmp_path, "10")   # only checkpoint-10's resume is wrong
    assert code == ExitCode.OK, sup.exit_reason
    runs = attempts(out)
    assert [r.resumed_from for r in runs] == [None, str(out / "checkpoint-10"), str(out / "checkpoint-5")]
    (diverged,) = events(out, "resume_divergence")
    assert diverged["data"]["action"] == "rollback" and diverged["data"]["relaunch_from"] == 5
    assert (out / "checkpoint-10.suspect-attempt-2").is_dir(), "the suspect checkpoint is kept for a person"
    assert runs[-1].end_step == 30 and (out / "checkpoint-30").is_dir()
    assert (tmp_path / "perturbed.log").read_text().split()[0] == "10", "only the suspect resume was perturbed"


def test_when_every_resume_loads_wrong_weights_the_run_stops_saying_the_resume_path_is_broken(tiny, tmp_path):
    code, sup, out = wrong_weights_run(tiny, tmp_path, "")   # every resume is wrong
    assert code == ExitCode.GAVE_UP
    assert "resume path itself is broken" in sup.exit_reason
    assert [e["data"]["action"] for e in events(out, "resume_divergence")] == ["rollback", "stop"]
    assert all(r.ended_at is not None for r in attempts(out))


@pytest.mark.skipif(why_no_cpu_quota() is not None, reason=str(why_no_cpu_quota()))
def test_a_cut_cpu_quota_is_a_throughput_drop_with_evidence_then_recovered_and_slow_in_goodput(tiny, tmp_path):
    cg = CPU_V1 / f"orchestrator-e2e-{os.getpid()}"
    cg.mkdir()
    out = tmp_path / "out"
    r = recipe(tiny, tmp_path, "optim.iterations=5000", "checkpoint.save_steps=5000", "health.slowdown_window_s=8")
    sup = Supervisor(r, install_signals=False)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", sup.run()), daemon=True)
    try:
        thread.start()

        def until(what, timeout_s: float) -> None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and thread.is_alive():
                if what():
                    return
                time.sleep(0.2)
            pytest.fail(f"timed out; state {sup.state}, events {[e['kind'] for e in events(out, None)][-10:]}")

        until(lambda: sup.attempt is not None and sup.attempt.last is not None and sup.attempt.last.step >= 2, 240)
        for p in launcher.tree(sup.attempt.launched.pid):   # the trainer's whole tree into the test's cgroup
            try:
                (cg / "cgroup.procs").write_text(str(p.pid))
            except OSError:
                pass   # a process that just ended
        tracker = sup.parts.health.throughput
        until(lambda: tracker.baseline_s is not None, 240)
        (cg / "cpu.cfs_period_us").write_text("100000")
        (cg / "cpu.cfs_quota_us").write_text("10000")   # 10 % of one core: several times slower
        until(lambda: events(out, "throughput_drop"), 240)
        (cg / "cpu.cfs_quota_us").write_text("-1")
        until(lambda: events(out, "throughput_recovered"), 240)
        sup.request_stop("test over")
        thread.join(120)
    finally:
        sup.request_stop("test over")
        thread.join(120)
        (cg / "cpu.cfs_quota_us").write_text("-1")
        for pid in (cg / "cgroup.procs").read_text().split():
            (cg.parent / "cgroup.procs").write_text(pid)
        cg.rmdir()
    (drop,) = events(out, "throughput_drop")
    assert drop["data"]["ratio"] > 1.5
    assert cg.name in json.dumps(drop["data"]["evidence"]), "the trainer's cgroup throttling is the evidence"
    assert any("throttl" in c for c in drop["data"]["clues"]), drop["data"]["clues"]
    j = journal(out)
    try:
        assert goodput_of(j).lost["slow"] > 0
    finally:
        j.close()


def test_a_normal_supervised_run_raises_no_health_event(tiny, tmp_path):
    out = tmp_path / "out"
    assert Supervisor(recipe(tiny, tmp_path), install_signals=False).run() == ExitCode.OK
    assert health_events(out) == []


def memorise_then_noise(path: Path, learn: int, noise: int, seed: int = 0) -> Path:
    """A chat dataset whose first `learn` samples teach one sentence and whose later `noise` samples are random
    words: the loss falls while the sentence is learnt, then climbs and stays up on the noise (a real divergence
    a data pipeline fault would cause). Kept in this order by --dataset_shuffle false."""
    import random
    rng = random.Random(seed)
    words = [''.join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    rows = [{"messages": [{"role": "user", "content": "Say it."},
                          {"role": "assistant", "content": "the quick brown fox jumps over the lazy dog " * 4}]}
            for _ in range(learn)]
    rows += [{"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=8))},
                           {"role": "assistant", "content": " ".join(rng.choices(words, k=40))}]} for _ in range(noise)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("on_divergence", ["stop", "rollback"])
def test_a_real_divergence_is_stopped_or_rolled_back_then_stopped_on_recurrence(tiny, tmp_path, on_divergence):
    data = memorise_then_noise(tmp_path / "data.jsonl", learn=4 * 30, noise=4 * 60)
    out = tmp_path / "out"
    # The tiny model learns little: the sentence takes its loss from 7.35 to ~6.3, the noise brings it back to
    # ~7.15 (+14 %) and holds it there. The default tolerance (+50 %, for real models' noisy levels) would let
    # that pass; a tiny model's tolerance is 10 % (its levels move < 2 % while it learns).
    r = recipe(tiny, tmp_path, f"data.dataset=[{json.dumps(str(data))}]", "optim.iterations=90", "optim.lr=5e-3",
               "checkpoint.save_steps=10", "checkpoint.keep_local=20", f'health.on_divergence="{on_divergence}"',
               "health.divergence_tolerance=0.1",
               "extra_args.dataset_shuffle=false", "extra_args.train_dataloader_shuffle=false")
    sup = Supervisor(r, install_signals=False)
    assert sup.run() == ExitCode.GAVE_UP
    diverged = events(out, "loss_divergence")
    assert diverged, [e["kind"] for e in events(out)]
    # the window that first shows the level risen holds the first noise steps (from step 31 on)
    assert diverged[0]["data"]["last_step"] > 30 >= diverged[0]["data"]["first_step"] > 10
    if on_divergence == "stop":
        assert [e["data"]["action"] for e in diverged] == ["stop"] and len(attempts(out)) == 1
    else:
        assert [e["data"]["action"] for e in diverged] == ["rollback", "stop"]
        assert "same symptom again" in sup.exit_reason
        assert attempts(out)[1].resumed_from == str(out / f"checkpoint-{diverged[0]['data']['relaunch_from']}")
    assert "loss_divergence" in sup.exit_reason
