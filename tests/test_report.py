"""report.py / html_report.py: history, status (JSON and the live rich view) and the HTML report, from
real supervised fake-trainer runs, plus the CLI round trips."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.ops import report, status_view
from orchestrator.host.journal import Journal, journal_path
from orchestrator.store.published import publish_dir
from orchestrator.config.recipe import load
from orchestrator.store.rundir import state_dir
from orchestrator.types import Attempt, CrashClass, Progress
from html_page import Page
from supervised import cli, fake_recipe, journal, logged_steps, supervise

FAULTS = "fla_backward_oom@15,cuda_fatal@27,nccl_error@33"
CLASSES = ["fla_backward_oom", "cuda_fatal", "nccl_error"]
OLD_STATUS_KEYS = {"run", "state", "step", "max_steps", "attempt", "updated_at", "exit_reason", "last_crash",
                   "last_checkpoint", "goodput", "events"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One finished run: 40 steps, three crashes, four attempts. Returns (recipe path, output dir)."""
    tmp = tmp_path_factory.mktemp("run")
    recipe = fake_recipe(tmp, faults=FAULTS)
    code, _ = supervise(recipe)
    assert code == 0
    return recipe, tmp / "out"


@pytest.fixture
def opened(run):
    recipe, out = run
    j = journal(out)
    yield load(recipe), j
    j.close()


# ------------------------------------------------------------------------------------------ history

def test_history_data_has_every_attempt_and_goodput(opened):
    r, j = opened
    d = report.history_data(r, j)
    a = d["attempts"]
    assert [x["n"] for x in a] == [1, 2, 3, 4]
    assert [x["class"] for x in a] == CLASSES + [None]
    assert [x["start_step"] for x in a] == [0, 10, 20, 30]
    assert [x["end_step"] for x in a] == [14, 26, 32, 40]
    assert a[0]["resumed_from"] is None and a[1]["resumed_from"].endswith("checkpoint-10")
    assert a[1]["signal"] == 6 and a[1]["exit_code"] is None and a[0]["exit_code"] == 1 and a[3]["exit_code"] == 0
    assert all(x["evidence"] for x in a[:3])
    g = d["goodput"]
    assert 0 < g["ratio"] < 1
    assert g["productive_s"] + sum(g["lost_s"].values()) == pytest.approx(g["total_s"], abs=0.5)
    assert d["state"] == "completed" and d["recipe_hash"]


def test_history_table_and_summary(opened, run):
    r, j = opened
    table = report.history_table(report.history_data(r, j))
    for cls in CLASSES:
        assert cls in table
    assert "sig 6" in table and "goodput" in table
    s = report.summary(r)
    assert "completed: step 40/40, 4 attempt(s)" in s and "fla_backward_oom x1" in s


# ------------------------------------------------------------------------------------------ status

def test_status_data_keeps_old_fields_and_adds_the_live_ones(opened):
    r, j = opened
    d = report.status_data(r, j)
    assert OLD_STATUS_KEYS <= d.keys()
    assert isinstance(d["goodput"], float)
    assert d["state"] == "completed" and d["step"] == 40 and d["max_steps"] == 40 and d["fraction"] == 1.0
    assert d["eta_s"] is None, "no ETA for a finished run"
    assert d["attempts"] == 4 and d["crashes"] == 3
    c = d["last_crash"]
    assert c["class"] == "nccl_error" and c["n"] == 3 and c["step"] == 32 and "nccl" in c["evidence"][0].lower()
    ck = d["last_checkpoint"]
    assert ck["step"] == 40 and ck["verified"] and ck["synced"] and ck["age_s"] >= 0
    assert d["sync"] == {"enabled": True, "destination": str(publish_dir(r.run.persistent_dir, "t", d["recipe_hash"])),
                         "last_synced_step": 40,
                         "lag_steps": 0, "lag_s": 0.0}
    loss = d["loss"]
    assert loss["last_step"] == 40 and loss["trend"] == "down" and loss["min"] <= loss["last"]
    assert len(loss["recent"]) == report.LOSS_WINDOW
    assert set(d["goodput_detail"]["lost_s"]) >= {"startup", "lost_progress", "wait"}
    assert d["step_s"] and d["step_s"] > 0
    assert d["set_aside_pending"] == [] and d["standings"][40] in ("healthy", "published")


def test_status_view_renders_the_pieces(opened):
    r, j = opened
    console = Console(record=True, width=120, force_terminal=True, color_system=None)
    status_view.status_view(r, j, console=console)
    text = console.export_text()
    for piece in ("completed", "40/40", "━", "last crash", "nccl_error", "attempt 3 at step 32",
                  "ncclUnhandledCudaError", "step 40", "verified", "synced", "last synced step 40", "goodput",
                  "attempt 4 of 4, 3 crash(es)", "↓", "min "):
        assert piece in text, f"{piece!r} missing from:\n{text}"
    assert re.search(r"[▁▂▃▄▅▆▇█]{10,}", text), "loss sparkline"


def test_status_while_the_supervisor_runs(tmp_path):
    recipe = fake_recipe(tmp_path, iterations=400, faults="cuda_fatal@12",
                         extra_env={"FAKE_STEP_S": "0.05", "FAKE_STARTUP_S": "0.02"})
    from orchestrator.loop.supervisor import Supervisor

    sup = Supervisor(load(recipe), install_signals=False)
    thread = threading.Thread(target=sup.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the run never got past step 20"
            path = journal_path(state_dir(tmp_path / "out"))
            try:  # not created yet; once there, it has its tables (no "no such table" to tolerate)
                j = Journal(path, readonly=True)
            except FileNotFoundError:
                kv, n = {}, 0
            else:
                try:
                    kv, n = j.get_all(), len(j.attempts())
                finally:
                    j.close()
            if kv.get("state") == "running" and (kv.get("step") or 0) >= 20 and n == 2:
                break
            time.sleep(0.2)
        p = cli("status", str(recipe), "--json", timeout=60)
        assert p.returncode == 0, p.stderr
        d = json.loads(p.stdout)
        assert d["state"] == "running" and 20 <= d["step"] < 400 and d["max_steps"] == 400
        assert d["eta_s"] is not None and d["eta_s"] > 0 and 0 < d["fraction"] < 1
        assert d["last_crash"]["class"] == "cuda_fatal" and d["attempts"] == 2
        assert d["loss"]["last_step"] >= 20
        p = cli("status", str(recipe), timeout=60)
        assert p.returncode == 0 and "running" in p.stdout and "ETA" in p.stdout and "cuda_fatal" in p.stdout
    finally:
        sup.request_stop("test done")
        thread.join(60)
    assert not thread.is_alive()


def test_watch_refreshes_until_ctrl_c(run, tmp_path):
    recipe, _ = run
    # A terminal as far as rich can tell, so each refresh reaches stdout and can be waited for.
    env = dict(os.environ, TTY_COMPATIBLE="1", TERM="xterm", NO_COLOR="1", COLUMNS="120")
    with open(tmp_path / "stderr", "w+") as err:
        p = subprocess.Popen([sys.executable, "-m", "orchestrator", "status", str(recipe), "--watch"],
                             stdout=subprocess.PIPE, stderr=err, env=env)
        out, refreshed = bytearray(), threading.Event()

        def read() -> None:
            for chunk in iter(lambda: os.read(p.stdout.fileno(), 1 << 16), b""):
                out.extend(chunk)
                if out.count("╭".encode()) >= 2:  # the panel's corner: the first view and one refresh
                    refreshed.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            assert refreshed.wait(30), f"--watch never refreshed: {out.decode(errors='replace')[-500:]}"
            assert p.poll() is None, "--watch must keep refreshing"
            p.send_signal(signal.SIGINT)
            assert p.wait(20) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        reader.join(10)
        err.seek(0)
        assert "Traceback" not in err.read()
    assert b"completed" in out


def test_loss_summary_trend_sparkline_and_nan():
    down = [Progress(i, 100, loss=3 - i * 0.05) for i in range(1, 51)]
    s = report.loss_summary(down)
    assert s["trend"] == "down" and s["last_step"] == 50 and len(s["recent"]) == report.LOSS_WINDOW
    assert report.loss_summary([Progress(i, 100, loss=1 + i * 0.05) for i in range(1, 30)])["trend"] == "up"
    assert report.loss_summary([Progress(i, 100, loss=1.0) for i in range(1, 30)])["trend"] == "flat"
    nan = report.loss_summary(down + [Progress(51, 100, loss=math.nan)])
    assert nan["nan_step"] == 51 and nan["last_step"] == 50
    assert report.loss_summary([]) is None
    assert status_view.sparkline([1, 2, 3]) == "▁▅█" and status_view.sparkline([2, 2]) == "▁▁"


def test_steplog_reads_incrementally_last_record_per_step(tmp_path):
    path = tmp_path / "logging.jsonl"
    rec = lambda step, loss: json.dumps({"loss": loss, "iteration": f"{step}/10"}) + "\n"  # noqa: E731
    path.write_text(rec(1, 2.0) + rec(2, 1.9) + '{"loss": 1.8, "itera')  # a half-written last line
    log = report.StepLog(path)
    assert sorted(log.refresh()) == [1, 2]
    with open(path, "a") as f:
        f.write('tion": "3/10"}\n' + rec(2, 1.7))  # the line completes; step 2 is relogged after a resume
    assert [(p.step, p.loss) for p in log.records()] == [(1, 2.0), (2, 1.7), (3, 1.8)]
    assert report.StepLog(tmp_path / "missing.jsonl").records() == []


# ------------------------------------------------------------------------------------------ HTML


def test_report_html_from_a_run_with_three_crashes(opened, run):
    r, j = opened
    _, out = run
    path = Path(report.write_html(r, j, None))
    assert path == out / ".orchestrator" / "report.html" and path.is_file()
    text = path.read_text()
    page = Page(text)
    assert not page.errors and not page.stack, (page.errors, page.stack)
    assert text.startswith("<!DOCTYPE html>")
    # the loss curve: one point per logged step (the last record per step after resumes)
    (line,) = page.find("polyline", "loss")
    assert len(line["points"].split()) == len(set(logged_steps(out))) == 40
    crashes = page.find("g", "crash")
    assert [c["data-class"] for c in crashes] == CLASSES
    for cls, ev in zip(CLASSES, (a.evidence[0] for a in j.attempts()[:3])):
        assert any(cls in t and ev[:60] in t for t in page.titles), f"no crash marker title for {cls}"
    assert len(page.find("g", "restart")) == 3
    assert len(page.find("g", "checkpoint")) == len(j.checkpoints()) == 4
    # goodput: the ratio and the stacked bar
    g = report.history_data(r, j)["goodput"]
    assert f"goodput {g['ratio']:.1%}" in text
    assert [s["data-cause"] for s in page.find("rect", "seg")][0] == "productive"
    for cause in ("startup", "lost_progress", "wait"):
        assert f"</span>{cause}</td>" in text
    # the header and the attempts table
    for piece in (r.run.name, j.get_all()["recipe_hash"], "megatron", "completed", "40 / 40"):
        assert piece in text
    assert text.count("<tr><td class=num>") >= 4
    # self-contained: no scripts, no external resources
    assert not page.find("script") and not page.find("link")
    assert not [a for _, a in page.tags for k in ("src", "href") if "http" in (a.get(k) or "")]


def test_report_escapes_log_text_and_reads_the_drifted_output_dir(tmp_path):
    """Evidence is raw trainer output; and a drifted run lives in <output_dir>-<hash8> (kv output_dir)."""
    recipe = fake_recipe(tmp_path, iterations=20)
    r = load(recipe)
    real = tmp_path / "out-deadbeef"
    real.mkdir()
    (real / "logging.jsonl").write_text("".join(
        json.dumps({"loss": 2 - k / 20, "iteration": f"{k}/20"}) + "\n" for k in range(1, 13)))
    j = Journal(journal_path(state_dir(real)))
    evil = '<script>alert("x")</script><img src="http://evil.invalid/x.png">'
    now = time.time()
    j.record_attempt(Attempt(1, now - 60, start_step=0, end_step=12, ended_at=now - 30, exit_code=1,
                             cls=CrashClass.OTHER, evidence=(evil,), first_step_at=now - 55, last_step_at=now - 31))
    j.record_checkpoint(10, str(real / "checkpoint-10"), True, loss=1.5)
    j.event("crash", evil)
    j.put(state="gave_up", step=12, attempt=1, output_dir=str(real), recipe_hash="abc123", exit_reason=evil,
          updated_at=now)
    j.close()
    ro = Journal(journal_path(state_dir(real)), readonly=True)
    try:
        d = report.status_data(r, ro)
        assert d["loss"]["last_step"] == 12 and d["output_dir"] == str(real)
        assert d["sync"]["enabled"] and d["sync"]["last_synced_step"] is None and d["sync"]["lag_steps"] == 10
        out = Path(report.write_html(r, ro, tmp_path / "nested" / "r.html"))
    finally:
        ro.close()
    text = out.read_text()
    page = Page(text)
    assert not page.errors
    assert not page.find("script") and not page.find("img")
    assert "&lt;script&gt;" in text
    (line,) = page.find("polyline", "loss")
    assert len(line["points"].split()) == 12
    assert [c["data-class"] for c in page.find("g", "crash")] == ["other"]


# ------------------------------------------------------------------------------------------ CLI

def test_cli_round_trips(run, tmp_path):
    recipe, out = run
    p = cli("history", str(recipe), "--json")
    assert p.returncode == 0, p.stderr
    h = json.loads(p.stdout)
    assert [a["class"] for a in h["attempts"]] == CLASSES + [None]
    for a in h["attempts"]:
        assert {"n", "exit_code", "signal", "class", "start_step", "end_step", "resumed_from"} <= a.keys()
    assert {"ratio", "total_s", "productive_s", "lost_s"} <= h["goodput"].keys()
    p = cli("history", str(recipe))
    assert p.returncode == 0 and "cuda_fatal" in p.stdout and "goodput" in p.stdout
    p = cli("status", str(recipe), "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert OLD_STATUS_KEYS <= s.keys() and s["state"] == "completed" and s["last_crash"]["class"] == "nccl_error"
    p = cli("status", str(recipe))
    assert p.returncode == 0 and "completed" in p.stdout and "40/40" in p.stdout
    target = tmp_path / "report.html"
    p = cli("report", str(recipe), "--output", str(target))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(target) and "<svg" in target.read_text()
    p = cli("report", str(recipe))
    assert p.returncode == 0 and Path(p.stdout.strip()) == out / ".orchestrator" / "report.html"


def test_cli_without_a_journal_is_bad_input(tmp_path):
    recipe = fake_recipe(tmp_path)
    for cmd in ("status", "history", "report"):
        p = cli(cmd, str(recipe))
        assert p.returncode == 2 and "no journal yet" in p.stderr


# ------------------------------------------------------------------------------------------ ETA after a resume

def _jsonl(step: int, speed: float | None) -> str:
    rec = {"loss": 7.0, "global_step/max_steps": f"{step}/40"} | ({"train_speed(s/it)": speed} if speed else {})
    return json.dumps(rec) + "\n"


@pytest.mark.parametrize("trainer_times_itself", [True, False])
def test_eta_after_a_resume_uses_the_resumed_attempts_own_rate(tmp_path, trainer_times_itself):
    """Attempt 1 ran at 1 s/step to step 26; attempt 2 resumed from 20 at 3 s/step and is at step 23.
    Its ETA is 17 steps x 3 s, not at the old attempt's rate (whose steps 24-26 are still the newest
    records in logging.jsonl), nor at the average of both."""
    recipe = fake_recipe(tmp_path, iterations=40)
    r = load(recipe)
    out = tmp_path / "out"
    out.mkdir()
    t = 1_800_000_000.0
    one, two = (1.0, 3.0) if trainer_times_itself else (None, None)
    (out / "logging.jsonl").write_text("".join(_jsonl(s, one) for s in range(1, 27))
                                       + "".join(_jsonl(s, two) for s in range(21, 24)))
    j = Journal(journal_path(state_dir(out)))
    j.record_attempt(Attempt(1, t, ended_at=t + 40, cls=CrashClass.HOST_OOM_KILLED, start_step=0, end_step=26,
                             first_step_at=t + 10, last_step_at=t + 35))
    j.record_attempt(Attempt(2, t + 50, start_step=20, end_step=23, first_step_at=t + 60, last_step_at=t + 69))
    j.put(state="running", step=23, updated_at=t + 69)
    try:
        d = report.status_data(r, j, now=t + 70)
    finally:
        j.close()
    assert d["step_s"] == pytest.approx(3.0)
    assert d["eta_s"] == pytest.approx(17 * 3.0)


def test_costs_show_in_status_history_and_the_report(tmp_path):
    """Measured start-up and save seconds (journal attempts.startup_s/save_s/save_count) and the interval in use."""
    r = load(fake_recipe(tmp_path, iterations=20))
    out = Path(r.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    j = Journal(journal_path(state_dir(out)))
    t = time.time() - 3600
    j.record_attempt(Attempt(1, t, ended_at=t + 900, cls=CrashClass.HOST_OOM_KILLED, start_step=0, end_step=26,
                             startup_s=480.0, save_s=100.0, save_count=1))
    j.record_attempt(Attempt(2, t + 1000, start_step=20, startup_s=300.0, save_s=40.0, save_count=3))
    j.record_attempt(Attempt(3, t + 2000, start_step=20))  # not started yet: nothing measured
    j.put(state="running", save_interval=85, output_dir=str(out))
    j.close()
    ro = Journal(journal_path(state_dir(out)), readonly=True)
    try:
        c = report.status_data(r, ro)["costs"]
        assert c == {"startup_s_last": 300.0, "startup_s_mean": 390.0, "starts": 2, "save_s_mean": 55.0, "saves": 4,
                     "save_interval_steps": 85}
        h = report.history_data(r, ro)
        assert h["costs"] == c and [a["save_count"] for a in h["attempts"]] == [1, 3, 0]
        assert json.loads(json.dumps(h))["attempts"][0]["startup_s"] == 480.0
        assert "costs: start-up 5m 00s last, 6m 30s mean of 2; save 55s mean of 4; saving every 85 steps" \
            in report.history_table(h)
        page = Path(report.write_html(r, ro, tmp_path / "r.html")).read_text()
    finally:
        ro.close()
    assert "<h2>Costs</h2>" in page and "save 55.0 s mean of 4" in page and "40.0 s × 3" in page


@pytest.mark.parametrize("cls, evidence, label", [
    ("host_oom_killed", ["SIGKILL; no kernel OOM record for the run's processes", "exit: signal 9"],
     "host_oom_killed (SIGKILL, no kernel OOM record)"),
    ("host_oom_killed", ["SIGKILL; kernel OOM killer killed pid 1234 (python) at 12:03:05"], "host_oom_killed"),
    ("nccl_error", ["ncclUnhandledCudaError"], "nccl_error"),
])
def test_the_console_says_when_a_sigkill_was_no_oom(cls, evidence, label):
    from orchestrator.ops.report import crash_label
    assert crash_label({"class": cls, "evidence": evidence}) == label
