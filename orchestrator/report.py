"""What a person reads about a run: the end-of-run summary, `history`, `status`. Reads the journal."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from orchestrator import goodput
from orchestrator.journal import Journal, journal_path
from orchestrator.recipe import Recipe
from orchestrator.rundir import state_dir
from orchestrator.types import Attempt


def attempt_times(attempts: list[Attempt], ckpts: list[dict], completed: bool) -> list[goodput.AttemptTimes]:
    out = []
    for i, a in enumerate(attempts):
        end = a.ended_at
        kept = [c["verified_at"] for c in ckpts if c["ok"] and c["verified_at"] and a.started_at <= c["verified_at"]
                and (end is None or c["verified_at"] <= end + 5)]
        out.append(goodput.AttemptTimes(a.started_at, end, a.first_step_at, a.last_step_at,
                                        max(kept, default=None), a.hang_detected_at,
                                        completed and i == len(attempts) - 1))
    return out


def goodput_of(j: Journal, now: float | None = None) -> goodput.Goodput:
    kv = j.get_all()
    attempts = j.attempts()
    done = kv.get("state") in ("completed",)
    now = now or time.time()
    end = kv.get("updated_at") if kv.get("state") in ("completed", "stopped", "gave_up") else now
    spans = [goodput.Span(s, e, k) for s, e, k in j.spans()]
    return goodput.account(attempt_times(attempts, j.checkpoints(), done), spans, now=end or now)


def history_data(r: Recipe, j: Journal) -> dict:
    g = goodput_of(j)
    return {
        "run": r.run.name,
        "recipe_hash": j.get_all().get("recipe_hash"),
        "attempts": [{"n": a.n, "started_at": a.started_at, "ended_at": a.ended_at, "pid": a.pid, "port": a.port,
                      "exit_code": a.exit_code, "signal": a.signal, "class": a.cls.value if a.cls else None,
                      "evidence": list(a.evidence), "start_step": a.start_step, "end_step": a.end_step,
                      "resumed_from": a.resumed_from, "log": a.log_path} for a in j.attempts()],
        "goodput": {"ratio": round(g.ratio, 4), "total_s": round(g.total_s, 1),
                    "productive_s": round(g.productive_s, 1), "lost_s": {k: round(v, 1) for k, v in g.lost.items()}},
    }


def history_table(data: dict) -> str:
    rows = [f"{'#':>3} {'exit':>8} {'class':<20} {'steps':<13} resumed from"]
    for a in data["attempts"]:
        ex = f"sig {a['signal']}" if a["signal"] is not None else ("" if a["exit_code"] is None else str(a["exit_code"]))
        steps = f"{a['start_step'] or 0}->{a['end_step'] if a['end_step'] is not None else '?'}"
        rows.append(f"{a['n']:>3} {ex:>8} {a['class'] or '-':<20} {steps:<13} {a['resumed_from'] or '-'}")
    g = data["goodput"]
    lost = ", ".join(f"{k} {v:.0f}s" for k, v in g["lost_s"].items() if v >= 0.5)
    rows.append(f"goodput {g['ratio']:.1%} of {g['total_s']:.0f}s" + (f" (lost: {lost})" if lost else ""))
    return "\n".join(rows)


def status_data(r: Recipe, j: Journal) -> dict:
    kv = j.get_all()
    attempts = j.attempts()
    last_crash = next((a for a in reversed(attempts) if a.cls), None)
    ckpts = [c for c in j.checkpoints() if c["ok"]]
    newest = ckpts[-1] if ckpts else None
    return {
        "run": r.run.name, "state": kv.get("state"), "step": kv.get("step"), "max_steps": r.optim.iterations,
        "attempt": kv.get("attempt"), "updated_at": kv.get("updated_at"), "exit_reason": kv.get("exit_reason"),
        "last_crash": {"n": last_crash.n, "class": last_crash.cls.value, "evidence": list(last_crash.evidence)}
        if last_crash else None,
        "last_checkpoint": {"step": newest["step"], "age_s": time.time() - newest["verified_at"],
                            "synced": newest["synced_at"] is not None} if newest else None,
        "goodput": round(goodput_of(j).ratio, 4),
        "events": j.events(10),
    }


def status_view(r: Recipe, j: Journal, watch: bool = False) -> None:
    from rich.console import Console

    console = Console()
    while True:
        d = status_data(r, j)
        console.print(f"[bold]{d['run']}[/]  state [bold]{d['state']}[/]  step {d['step']}  attempt {d['attempt']}"
                      f"  goodput {d['goodput']:.1%}")
        if d["last_checkpoint"]:
            c = d["last_checkpoint"]
            console.print(f"  last checkpoint: step {c['step']}, {c['age_s']:.0f}s ago, synced: {c['synced']}")
        if d["last_crash"]:
            console.print(f"  last crash: attempt {d['last_crash']['n']} {d['last_crash']['class']}")
        for e in d["events"][-5:]:
            console.print(f"  {time.strftime('%H:%M:%S', time.localtime(e['at']))} {e['kind']}: {e['message']}")
        if not watch:
            return
        time.sleep(2)  # a display refresh interval, not synchronisation


def summary(r: Recipe) -> str:
    path = journal_path(state_dir(r.run.output_dir))
    if not path.exists():
        return "no journal: nothing ran"
    j = Journal(path, readonly=True)
    try:
        data, kv = history_data(r, j), j.get_all()
    finally:
        j.close()
    classes = Counter(a["class"] for a in data["attempts"] if a["class"])
    last_step = max((a["end_step"] or 0 for a in data["attempts"]), default=0)
    lines = [f"summary: {r.run.name} {kv.get('state')}: step {last_step}/{r.optim.iterations or '?'}, "
             f"{len(data['attempts'])} attempt(s), crashes: "
             + (", ".join(f"{c} x{n}" for c, n in classes.items()) or "none"),
             history_table(data)]
    if kv.get("exit_reason"):
        lines.append(f"reason: {kv['exit_reason']}")
    return "\n".join(lines)


def write_html(r: Recipe, j: Journal, output: Path | None) -> str:
    raise NotImplementedError
