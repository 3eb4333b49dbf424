"""What a person reads about a run: the end-of-run summary, `history`, `status` (its data; the live rich view
is status_view.py) and the HTML `report` (rendered by html_report.py).

Reads the journal read-only (WAL: works while the supervisor writes) and the trainer's logging.jsonl
in the run's real output_dir (kv "output_dir": a drifted recipe runs in <output_dir>-<hash8>).
"""
from __future__ import annotations

import math
import sqlite3
import time
from collections import Counter
from pathlib import Path

from orchestrator.config.recipe import Recipe
from orchestrator.domain import goodput, progress
from orchestrator.domain.costs import mean_save
from orchestrator.host.journal_goodput import goodput_of
from orchestrator.domain.health.throughput import ThroughputParams
from orchestrator.domain.verdict import NO_OOM_RECORD
from orchestrator.host.journal import Journal, journal_path
from orchestrator.ops import step_speed
from orchestrator.store.published import publish_dir
from orchestrator.store.published import published_steps as own_published_steps
from orchestrator.store.rundir import state_dir
from orchestrator.types import Attempt, HealthKind, Progress

TERMINAL = ("completed", "stopped", "gave_up")
LOSS_WINDOW = 40          # losses shown in the status sparkline
LOST_SHOWN_S = 0.05       # smaller lost figures are rounding noise (a short demo loses tenths of a second)


def goodput_dict(g: goodput.Goodput, digits: int = 1) -> dict:
    return {"ratio": round(g.ratio, 4), "total_s": round(g.total_s, digits),
            "productive_s": round(g.productive_s, digits), "lost_s": {k: round(v, digits) for k, v in g.lost.items()}}


def output_dir_of(r: Recipe, kv: dict) -> Path:
    return Path(kv.get("output_dir") or r.run.output_dir)


class StepLog:
    """Step records of a logging.jsonl, read incrementally (so `status --watch` reads only what is
    new). The file is appended across attempts: after a resume the last record per step wins."""

    def __init__(self, path: Path):
        self.path, self.offset, self.by_step = path, 0, {}
        self.attempt: list[Progress] = []  # records since the step last went back: the latest attempt's

    def _add(self, p: Progress) -> None:
        if self.attempt and p.step <= self.attempt[-1].step:  # a resume (or fresh restart) rewinds the step
            self.attempt = []
        self.attempt.append(p)
        self.by_step[p.step] = p

    def refresh(self) -> dict[int, Progress]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return self.by_step
        if size < self.offset:  # truncated or replaced: start over
            self.offset, self.by_step, self.attempt = 0, {}, []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        cut = data.rfind(b"\n") + 1  # a half-written last line waits for the next refresh
        self.offset += cut
        for line in data[:cut].decode("utf-8", errors="replace").splitlines():
            p = progress.parse_jsonl_line(line)
            if p is not None:
                self._add(p)
        return self.by_step

    def records(self) -> list[Progress]:
        return [self.by_step[s] for s in sorted(self.refresh())]

    def attempt_records(self) -> list[Progress]:
        """The latest attempt's records, in the order it logged them."""
        self.refresh()
        return list(self.attempt)


def attempt_row(a: Attempt) -> dict:
    return {"n": a.n, "started_at": a.started_at, "ended_at": a.ended_at, "pid": a.pid, "port": a.port,
            "exit_code": a.exit_code, "signal": a.signal, "class": a.cls.value if a.cls else None,
            "evidence": list(a.evidence), "start_step": a.start_step, "end_step": a.end_step,
            "resumed_from": a.resumed_from, "log": a.log_path,
            "startup_s": a.startup_s, "save_s": a.save_s, "save_count": a.save_count or 0,
            "system": a.system, "kind": a.kind}


def costs_data(attempts: list[Attempt], kv: dict) -> dict:
    """What starts and saves cost this run (costs.py, measured per attempt) and the interval in use."""
    starts = [a.startup_s for a in attempts if a.startup_s is not None]
    save, n = mean_save((a.save_s, a.save_count) for a in attempts)
    return {"startup_s_last": starts[-1] if starts else None,
            "startup_s_mean": sum(starts) / len(starts) if starts else None, "starts": len(starts),
            "save_s_mean": save, "saves": n, "save_interval_steps": kv.get("save_interval")}


def costs_line(c: dict) -> str:
    start = (f"start-up {fmt_duration(c['startup_s_last'])} last, {fmt_duration(c['startup_s_mean'])} mean of "
             f"{c['starts']}" if c["starts"] else "start-up not measured yet")
    save = (f"save {fmt_duration(c['save_s_mean'])} mean of {c['saves']}" if c["saves"] else "no save measured yet")
    every = f"; saving every {c['save_interval_steps']} steps" if c["save_interval_steps"] else ""
    return f"{start}; {save}{every}"


def health_summary(events: list[dict]) -> dict:
    """How many health events of each kind, and the newest one (for status)."""
    return {"counts": dict(Counter(ev["kind"] for ev in events)), "last": events[-1] if events else None}


def history_data(r: Recipe, j: Journal) -> dict:
    kv, rows = j.get_all(), j.attempts()
    return {"run": r.run.name, "recipe_hash": kv.get("recipe_hash"), "state": kv.get("state"),
            "output_dir": str(output_dir_of(r, kv)), "attempts": [attempt_row(a) for a in rows],
            "costs": costs_data(rows, kv),
            # every health event with its numbers (first_step, last_step, window, level, threshold, value, ...)
            "health": j.events_of(tuple(HealthKind)), "advice": advice_of(j),
            "goodput": goodput_dict(goodput_of(j)),
            "sync": sync_state(r, ckpts := j.checkpoints(), time.time(), synced_steps(ckpts, published_steps(r, kv)),
                               kv.get("recipe_hash"))}


def history_table(data: dict) -> str:
    rows = [f"{'#':>3} {'exit':>8} {'class':<20} {'steps':<13} resumed from"]
    for a in data["attempts"]:
        ex = f"sig {a['signal']}" if a["signal"] is not None else ("" if a["exit_code"] is None else str(a["exit_code"]))
        observed = a.get("kind") == "observed"   # watched, not launched: where it started is not known
        steps = ("export" if a.get("kind") == "export" else
                 f"{'?' if observed and a['start_step'] is None else a['start_step'] or 0}->"
                 f"{a['end_step'] if a['end_step'] is not None else '?'}")
        rows.append(f"{a['n']:>3} {ex:>8} {a['class'] or '-':<20} {steps:<13} "
                    + ("(observed: started by hand)" if observed else a['resumed_from'] or '-'))
    g = data["goodput"]
    lost = ", ".join(f"{k} {fmt_duration(v)}" for k, v in g["lost_s"].items() if v >= LOST_SHOWN_S)
    rows.append(f"goodput {g['ratio']:.1%} of {fmt_duration(g['total_s'])}" + (f" (lost: {lost})" if lost else ""))
    for ev in data.get("health", []):
        rows.append(f"health: {ev['kind']}: {ev['message']}")
    for adv in data.get("advice", []):
        rows.append(f"advice: {adv['text']} (to act: {adv['command']})")
    if "costs" in data:
        rows.append(f"costs: {costs_line(data['costs'])}")
    if (s := data.get("sync", {})).get("enabled"):
        last = s["last_synced_step"]
        rows.append(f"sync: last synced step {last if last is not None else '-'} in {s['destination']}"
                    + (f", {s['lag_steps']} steps behind" if s["lag_steps"] else ""))
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------ status

def loss_summary(records: list[Progress], n: int = LOSS_WINDOW) -> dict | None:
    finite = [(p.step, p.loss) for p in records if p.loss is not None and math.isfinite(p.loss)]
    if not finite:
        return None
    recent = [v for _, v in finite[-n:]]
    # Least-squares slope over the window, relative to its mean: noise-tolerant direction.
    k = len(recent)
    xm, ym = (k - 1) / 2, sum(recent) / k
    den = sum((i - xm) ** 2 for i in range(k))
    slope = sum((i - xm) * (v - ym) for i, v in enumerate(recent)) / den if den else 0.0
    change = slope * (k - 1) / abs(ym) if ym else 0.0
    trend = "down" if change < -0.01 else "up" if change > 0.01 else "flat"
    last_bad = next((p.step for p in reversed(records) if p.loss is not None and not math.isfinite(p.loss)), None)
    return {"recent": [round(v, 6) for v in recent], "last": finite[-1][1], "last_step": finite[-1][0],
            "min": min(v for _, v in finite), "trend": trend, "nan_step": last_bad}


def step_seconds(current: list[Progress], attempts: list[Attempt]) -> float | None:
    """Seconds per step of the latest attempt (after a resume, its own rate, not the earlier attempts'):
    the trainer's own figure (it times its own process), else the attempt's journal times; before the
    attempt has a rate of its own, the earlier attempts' together."""
    own = next((p.step_s for p in reversed(current[-5:]) if p.step_s), None)
    if own:
        return own
    def rate(rows: list[Attempt]) -> float | None:
        done = [((a.last_step_at - a.first_step_at), (a.end_step - (a.start_step or 0))) for a in rows
                if a.first_step_at and a.last_step_at and a.end_step and a.end_step > (a.start_step or 0)]
        secs, steps = sum(d[0] for d in done), sum(d[1] for d in done)
        return secs / steps if steps and secs > 0 else None
    return (rate(attempts[-1:]) or rate(attempts[:-1])) if attempts else None


def published_steps(r: Recipe, kv: dict) -> set[int] | None:
    """Steps of this run's own published copies (its publish dir, its recipe hash; sync renames a copy into
    place only when complete). None when persistent_dir is unreadable, or the run has none configured."""
    h = kv.get("recipe_hash")
    if not r.run.persistent_dir or not h:
        return None
    return own_published_steps(r.run.persistent_dir, r.run.name, h)


def synced_steps(ckpts: list[dict], published: set[int] | None) -> set[int]:
    """What is synced now: the run's own copies in persistent_dir; the journal's record only where that
    directory cannot be read (another run's copy of the same step never counts)."""
    return published if published is not None else {c["step"] for c in ckpts if c["ok"] and c["synced_at"]}


def sync_state(r: Recipe, ckpts: list[dict], now: float, synced: set[int], recipe_hash: str | None) -> dict:
    if not r.run.persistent_dir:
        return {"enabled": False}
    good = [c for c in ckpts if c["ok"]]
    last = max((c["step"] for c in good if c["step"] in synced), default=None)
    behind = [c for c in good if c["step"] not in synced and (last is None or c["step"] > last)]
    newest = good[-1]["step"] if good else None
    dest = publish_dir(r.run.persistent_dir, r.run.name, recipe_hash) if recipe_hash else r.run.persistent_dir
    return {"enabled": True, "destination": str(dest), "last_synced_step": last,
            "lag_steps": (newest - (last or 0)) if behind else 0,
            "lag_s": round(max(0.0, now - behind[0]["verified_at"]), 1) if behind and behind[0]["verified_at"] else 0.0}


def status_data(r: Recipe, j: Journal, *, now: float | None = None, steps: StepLog | None = None) -> dict:
    now = now or time.time()
    kv = j.get_all()
    out = output_dir_of(r, kv)
    attempts = j.attempts()
    steps = steps or StepLog(out / "logging.jsonl")
    records = steps.records()
    last_crash = next((a for a in reversed(attempts) if a.cls), None)
    ckpts = j.checkpoints()
    good = [c for c in ckpts if c["ok"]]
    newest = good[-1] if good else None
    synced = synced_steps(ckpts, published_steps(r, kv))
    sync = sync_state(r, ckpts, now, synced, kv.get("recipe_hash"))
    g = goodput_of(j, now)
    step = kv.get("step") if kv.get("step") is not None else (records[-1].step if records else None)
    max_steps = r.optim.iterations or next((p.max_steps for p in reversed(records) if p.max_steps), None)
    step_s = step_seconds(steps.attempt_records(), attempts)
    live = kv.get("state") not in TERMINAL
    eta = (max_steps - step) * step_s if live and step_s and step is not None and max_steps else None
    return {
        "run": r.run.name, "state": kv.get("state"), "step": step, "max_steps": max_steps,
        "attempt": kv.get("attempt"), "updated_at": kv.get("updated_at"), "exit_reason": kv.get("exit_reason"),
        "last_crash": {"n": last_crash.n, "class": last_crash.cls.value, "evidence": list(last_crash.evidence),
                       "step": last_crash.end_step, "ended_at": last_crash.ended_at} if last_crash else None,
        "last_checkpoint": {"step": newest["step"], "age_s": now - newest["verified_at"],
                            "synced": newest["step"] in synced,
                            "verified": True, "path": newest["path"], "loss": newest["loss"]} if newest else None,
        "invalid_checkpoints": [c["step"] for c in ckpts if not c["ok"]],
        "goodput": round(g.ratio, 4),
        "events": j.events(10),
        "health": health_summary(j.events_of(tuple(HealthKind))),
        # added for the live view
        "recipe_hash": kv.get("recipe_hash"), "output_dir": str(out), "attempts": len(attempts),
        "crashes": len([a for a in attempts if a.cls]),
        "fraction": min(1.0, step / max_steps) if step is not None and max_steps else None,
        "step_s": step_s, "eta_s": eta, "loss": loss_summary(records), "sync": sync,
        "goodput_detail": goodput_dict(g, 3), "costs": costs_data(attempts, kv),
        # watch mode (`orchestrator watch`): the trainer watched, and what `run` would have done
        "watching": kv.get("watching"), "advice": advice_of(j),
        # checkpoints being set aside (store/standing.py): what is still to move, and each checkpoint's standing
        "set_aside_pending": kv.get("set_aside_pending") or [],
        "standings": {c["step"]: c.get("standing") for c in ckpts if c.get("standing")},
    }


def advice_of(j: Journal) -> list[dict]:
    """Watch mode's advice events, oldest first: what `run` would have done, and the command that does it."""
    return [{"at": ev["at"], "action": ev["data"].get("action"), "text": ev["message"],
             "command": ev["data"].get("command")} for ev in j.events_of(("advice",))]


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "?"
    if s < 10:
        return f"{max(0.0, s):.1f}s"
    s = int(s)
    d, h, m = s // 86400, s % 86400 // 3600, s % 3600 // 60
    return f"{d}d {h}h" if d else f"{h}h {m:02d}m" if h else f"{m}m {s % 60:02d}s" if m else f"{s}s"


# ------------------------------------------------------------------------------------------ summary, HTML

def crash_label(a: dict) -> str:
    """A crash's class for the console; a SIGKILL the kernel did not record as an OOM kill says so plainly."""
    if a["class"] == "host_oom_killed" and any(e.startswith(NO_OOM_RECORD) for e in a["evidence"]):
        return "host_oom_killed (SIGKILL, no kernel OOM record)"
    return a["class"]


def summary(r: Recipe) -> str:
    path = journal_path(state_dir(r.run.output_dir))
    if not path.exists():
        return "no journal: nothing ran"
    try:
        j = Journal(path, readonly=True)
        try:
            data, kv = history_data(r, j), j.get_all()
        finally:
            j.close()
    except (sqlite3.DatabaseError, ValueError) as e:  # damaged while the supervisor had it open: the run is over
        return (f"summary: not available: {path}: {e} (the next `orchestrator run` moves it aside and rebuilds it "
                f"from the checkpoints on disk)")
    classes = Counter(crash_label(a) for a in data["attempts"] if a["class"])
    last_step = max((a["end_step"] or 0 for a in data["attempts"]), default=0)
    lines = [f"summary: {r.run.name} {kv.get('state')}: step {last_step}/{r.optim.iterations or '?'}, "
             f"{len(data['attempts'])} attempt(s), crashes: "
             + (", ".join(f"{c} x{n}" for c, n in classes.items()) or "none"),
             history_table(data)]
    if kv.get("exit_reason"):
        lines.append(f"reason: {kv['exit_reason']}")
    return "\n".join(lines)


def report_data(r: Recipe, j: Journal, now: float | None = None) -> dict:
    """Everything the HTML report shows, as plain data."""
    kv = j.get_all()
    out = output_dir_of(r, kv)
    log = StepLog(out / "logging.jsonl")
    st = status_data(r, j, now=now, steps=log)
    records, attempts = log.records(), j.attempts()
    published = published_steps(r, kv)
    return {
        "run": r.run.name, "recipe_hash": kv.get("recipe_hash"), "backend": kv.get("backend") or r.run.backend,
        "model": r.model.path, "state": kv.get("state"), "exit_reason": kv.get("exit_reason"),
        "step": st["step"], "max_steps": st["max_steps"], "output_dir": str(out), "generated_at": time.time(),
        "losses": [(p.step, p.loss) for p in records if p.loss is not None and math.isfinite(p.loss)],
        "step_times": [(p.step, p.step_s) for p in records if p.step_s is not None and math.isfinite(p.step_s)],
        "nan_steps": [p.step for p in records if p.loss is not None and not math.isfinite(p.loss)],
        "crashes": [{"n": a.n, "class": a.cls.value, "evidence": a.evidence[0] if a.evidence else "",
                     "step": a.end_step if a.end_step is not None else (a.start_step or 0), "ended_at": a.ended_at}
                    for a in attempts if a.cls],
        "restarts": [{"n": a.n, "step": a.start_step or 0, "resumed_from": a.resumed_from}
                     for a in attempts if a.n > 1],
        "checkpoints": [{"step": c["step"], "ok": bool(c["ok"]), "synced": c["synced_at"] is not None
                         or c["step"] in (published or ()), "problems": c["problems"]}
                        for c in j.checkpoints()],
        "attempts": [attempt_row(a) for a in attempts],
        "goodput": st["goodput_detail"], "sync": st["sync"], "events": j.events(30), "costs": st["costs"],
        "health": j.events_of(tuple(HealthKind)), "advice": st["advice"],
        "speed": judged_speed(r, out / "logging.jsonl", attempts, j.checkpoints()),
    }


def judged_speed(r: Recipe, path: Path, attempts: list[Attempt], ckpts: list[dict]) -> dict:
    """The seconds per step the throughput detector judges, its median and baseline (step_speed.py),
    rebuilt from the step records' times in logging.jsonl with this recipe's [health] settings."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    segments = step_speed.timed_steps(lines, [a.start_step or 0 for a in attempts])
    params = ThroughputParams.from_health(r.health.slowdown_ratio, r.health.slowdown_window_s)
    return step_speed.judged(segments, {c["step"] for c in ckpts}, params)


def write_html(r: Recipe, j: Journal, output: Path | None) -> str:
    from orchestrator.ops.html_report import render

    data = report_data(r, j)
    path = Path(output) if output else state_dir(data["output_dir"]) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render(data), encoding="utf-8")
    tmp.replace(path)
    return str(path)
