"""The report's throughput panel plots what the throughput detector judges (issue 35, item 5): seconds per step
between step records (ops/step_speed.py, fed through domain/health/throughput.ThroughputTracker), its median and the
baseline, not the trainer's since-start average. From synthetic ms-swift logging.jsonl runs written the way
ms-swift writes them (train_speed(s/it) = elapsed / (step - start step), elapsed_time in whole seconds)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from html_page import Page
from supervised import fake_recipe

from orchestrator.config.recipe import load
from orchestrator.domain.health.throughput import ThroughputParams, ThroughputTracker
from orchestrator.host.journal import Journal, journal_path
from orchestrator.ops import report, step_speed
from orchestrator.ops.html_report import render, throughput_chart
from orchestrator.store.rundir import state_dir
from orchestrator.types import Attempt

MAX, EVERY, SAVE_EVERY, SAVE_S = 400, 5, 100, 30.0


def fmt_time(s: float) -> str:  # swift.utils.format_time
    t = round(s)
    h, m, sec = t // 3600, t % 3600 // 60, t % 60
    return f"{h}h {m}m {sec}s" if h else f"{m}m {sec}s" if m else f"{sec}s"


def swift_log(step_s, steps=range(1, MAX + 1), start: int = 0, saves=()) -> tuple[list[str], list[tuple[int, float]]]:
    """ms-swift logging.jsonl lines of one process (every EVERY steps) for step times step_s(step), a save of
    SAVE_S after each step in `saves`; also the (step, elapsed) each line was written at."""
    el, lines, times = 0.0, [], []
    for k in steps:
        el += step_s(k) + (SAVE_S if k - 1 in saves else 0.0)
        if k % EVERY == 0:
            times.append((k, el))
            lines.append(json.dumps({"loss": 1.0, "grad_norm": 0.5, "learning_rate": 1e-5,
                                     "global_step/max_steps": f"{k}/{MAX}", "elapsed_time": fmt_time(el),
                                     "remaining_time": "0s", "train_speed(s/it)": round(el / (k - start), 6)}))
    return lines, times


def five_x_slower(k: int) -> float:
    return 1.0 if k <= 120 else 5.0   # steps 121-400 (70 % of the run) five times slower


def write_run(tmp: Path, lines: list[str], events: list[tuple[str, str, dict]]):
    r = load(fake_recipe(tmp, iterations=MAX, save_steps=SAVE_EVERY))
    out = Path(r.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "logging.jsonl").write_text("".join(line + "\n" for line in lines))
    j = Journal(journal_path(state_dir(out)))
    now = time.time()
    j.record_attempt(Attempt(1, now - 3000, start_step=0, end_step=MAX, ended_at=now, exit_code=0))
    for s in range(SAVE_EVERY, MAX + 1, SAVE_EVERY):
        j.record_checkpoint(s, str(out / f"checkpoint-{s}"), True, loss=1.0)
    for kind, message, data in events:
        j.event(kind, message, **data)
    j.put(state="completed", step=MAX, attempt=1, output_dir=str(out), recipe_hash="abc", updated_at=now)
    j.close()
    return r, Journal(journal_path(state_dir(out)), readonly=True)


def drop_found_by_the_detector(times: list[tuple[int, float]]) -> list[tuple[str, str, dict]]:
    """The throughput_drop the detector finds on these step times (what the loop journals)."""
    tr = ThroughputTracker(ThroughputParams())
    for s in range(SAVE_EVERY, MAX + 1, SAVE_EVERY):
        tr.pause(s)
    found = [f for step, at in times for f in tr.observe(step, at)]
    assert [f.kind for f in found] == ["throughput_drop"]
    return [(f.kind, f.message, f.record()) for f in found]


def test_a_5x_slow_spell_shows_in_the_plotted_line_not_only_in_its_marker(tmp_path):
    lines, times = swift_log(five_x_slower, saves=range(SAVE_EVERY, MAX, SAVE_EVERY))
    r, j = write_run(tmp_path, lines, drop_found_by_the_detector(times))
    try:
        d = report.report_data(r, j)
    finally:
        j.close()
    sp = d["speed"]
    cur = dict(sp["current"])
    before = [v for s, v in cur.items() if s <= 120]
    after = [v for s, v in cur.items() if s >= 170]
    assert before and after
    assert all(v == pytest.approx(1.0, rel=0.02) for v in before)
    assert all(v == pytest.approx(5.0, rel=0.02) for v in after), "the judged line shows the 5x slow spell"
    assert [b for *_, b in sp["baselines"]] == [pytest.approx(1.0, rel=0.02)]
    # the saves (30 s each) are pauses, not training: no measurement holds one
    assert max(v for _, v in sp["measured"]) == pytest.approx(5.0, rel=0.02)
    # what the panel used to plot: the trainer's average since its start, still far below 5x at step 170
    own = dict(d["step_times"])
    assert own[170] < 2.6 < cur[170]
    page = Page(render(d))
    assert not page.errors
    judged = page.find("polyline", "judged")
    assert len(judged) == 1
    ys = [float(p.split(",")[1]) for p in judged[0]["points"].split()]
    assert max(ys) - min(ys) > 100, "the line moves with the slowdown (the plot is 162 px high)"
    assert len(page.find("line", "baseline")) == 1 and len(page.find("rect", "slow")) == 1
    assert [m["data-kind"] for m in page.find("g", "throughput")] == ["throughput_drop"]


def test_a_steady_run_plots_a_flat_line_at_its_baseline(tmp_path):
    lines, _ = swift_log(lambda k: 2.0 + 0.2 * ((k * 7919) % 5 - 2) / 2, saves=range(SAVE_EVERY, MAX, SAVE_EVERY))
    r, j = write_run(tmp_path, lines, [])
    try:
        sp = report.report_data(r, j)["speed"]
    finally:
        j.close()
    assert sp["current"] and all(v == pytest.approx(2.0, rel=0.06) for _, v in sp["current"])
    (_, _, base), = sp["baselines"]
    assert base == pytest.approx(2.0, rel=0.06)
    assert max(v for _, v in sp["current"]) < base * sp["slowdown_ratio"]


def test_elapsed_time_parses_every_swift_form():
    assert step_speed.elapsed_seconds("4s") == 4
    assert step_speed.elapsed_seconds("3m 4s") == 184
    assert step_speed.elapsed_seconds("2h 0m 5s") == 7205
    assert step_speed.elapsed_seconds("1d 1h 1m 1s") == 90061
    assert step_speed.elapsed_seconds(None) is None and step_speed.elapsed_seconds("soon") is None


def test_attempts_are_split_and_timed_from_their_own_start_step():
    first, _ = swift_log(lambda k: 1.0, steps=range(1, 121))
    # a resume from checkpoint-100: a new process, its average over the steps since 100
    second, times2 = swift_log(lambda k: 3.0, steps=range(101, 201), start=100)
    segs = step_speed.timed_steps(first + second, [0, 100])
    assert [len(s) for s, _ in segs] == [24, 20] and not any(coarse for _, coarse in segs)
    assert segs[1][0] == [pytest.approx(t) for t in times2]
    # without train_speed (or when it disagrees with elapsed_time) the whole seconds of elapsed_time are used
    bare = [re.sub(r', "train_speed\(s/it\)": [0-9.]+', "", line) for line in first]
    (steps, coarse), = step_speed.timed_steps(bare, [0])
    assert coarse and steps[-1] == (120, 120.0)
    wrong = [re.sub(r'"train_speed\(s/it\)": [0-9.]+', '"train_speed(s/it)": 9.0', line) for line in first]
    (steps, coarse), = step_speed.timed_steps(wrong, [0])
    assert coarse and steps[-1] == (120, 120.0)
    j = step_speed.judged(segs, set(), ThroughputParams())
    assert [round(b, 3) for *_, b in j["baselines"]] == [1.0, 1.0], "the slower resumed attempt keeps the first's"
    assert j["current"][-1][1] == pytest.approx(3.0)


def test_the_panel_clips_a_lone_slow_measurement_and_says_what_it_plots():
    speed = {"measured": [(s, 1.0) for s in range(20, 100)] + [(100, 400.0)],
             "current": [(s, 1.0) for s in range(40, 101)], "baselines": [(1, 100, 1.0)], "slowdown_ratio": 1.5}
    svg = throughput_chart({"max_steps": 100, "speed": speed, "health": []})
    assert not Page(svg).errors
    assert "judged s/step (median)" in svg and "drop threshold (1.5x)" in svg
    ys = [float(c) for c in re.findall(r'<circle cx="[0-9.]+" cy="([0-9.]+)"', svg)]
    assert min(ys) >= 14.0, "the outlier is clipped at the top of the plot, not scaling the rest flat"
