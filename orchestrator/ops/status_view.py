"""`orchestrator status` in a terminal: one rich panel built from report.status_data, refreshed with --watch."""
from __future__ import annotations

import sqlite3
import time

from orchestrator.config.recipe import Recipe
from orchestrator.host.journal import Journal
from orchestrator.ops.report import LOST_SHOWN_S, StepLog, costs_line, fmt_duration, output_dir_of, status_data

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


STATE_STYLE = {"running": "bold green", "completed": "bold green", "gave_up": "bold red", "crashed": "bold red",
               "backoff": "bold yellow", "stopped": "bold yellow"}


def status_renderable(d: dict):
    """The live view: one rich renderable built from status_data()."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    state = d["state"] or "?"
    t.add_row("state", Text.assemble((state, STATE_STYLE.get(state, "bold")),
                                     f"   attempt {d['attempt'] or 0} of {d['attempts']}, {d['crashes']} crash(es)"))
    if d["exit_reason"]:
        t.add_row("reason", Text(d["exit_reason"], style="red"))
    mx = d["max_steps"]
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=mx or 1, completed=d["step"] or 0, width=40),
                Text(f"{d['step'] if d['step'] is not None else '?'}/{mx or '?'}"
                     + (f"  {d['fraction']:.0%}" if d["fraction"] is not None else "")
                     + (f"  ETA {fmt_duration(d['eta_s'])}" if d["eta_s"] is not None else "")
                     + (f"  ({d['step_s']:.3g} s/step)" if d["step_s"] else "")))
    t.add_row("step", bar)
    if (loss := d["loss"]) is not None:
        arrow, style = {"down": ("↓", "green"), "up": ("↑", "red"), "flat": ("→", "yellow")}[loss["trend"]]
        t.add_row("loss", Text.assemble((sparkline(loss["recent"]), "magenta"), " ", (arrow, style),
                                        f"  last {loss['last']:.4g} (step {loss['last_step']})  min {loss['min']:.4g}",
                                        (f"  NaN at step {loss['nan_step']}", "bold red") if loss["nan_step"] else ""))
    if (c := d["last_crash"]) is not None:
        ago = f", {fmt_duration(time.time() - c['ended_at'])} ago" if c["ended_at"] else ""
        t.add_row("last crash", Text.assemble((c["class"], "bold red"),
                                              f"  attempt {c['n']} at step {c['step'] if c['step'] is not None else '?'}{ago}"))
        if c["evidence"]:
            t.add_row("", Text(c["evidence"][0][:200], style="dim"))
    if (ck := d["last_checkpoint"]) is not None:
        t.add_row("checkpoint", Text.assemble(f"step {ck['step']}, {fmt_duration(ck['age_s'])} old, ",
                                              ("verified", "green"), ", ",
                                              ("synced", "green") if ck["synced"] else ("not synced", "yellow")))
    else:
        t.add_row("checkpoint", Text("none yet", style="yellow"))
    if d["invalid_checkpoints"]:
        t.add_row("", Text(f"invalid: steps {', '.join(map(str, d['invalid_checkpoints']))}", style="red"))
    s = d["sync"]
    if s["enabled"]:
        last = s["last_synced_step"]
        t.add_row("sync", f"last synced step {last if last is not None else '-'}"
                  + (f", lag {s['lag_steps']} steps / {fmt_duration(s['lag_s'])}" if s["lag_steps"] else ", up to date"))
    else:
        t.add_row("sync", Text("off (no run.persistent_dir)", style="dim"))
    g = d["goodput_detail"]
    lost = ", ".join(f"{k} {fmt_duration(v)}" for k, v in g["lost_s"].items() if v >= LOST_SHOWN_S)
    t.add_row("goodput", f"{g['ratio']:.1%} of {fmt_duration(g['total_s'])}" + (f"  lost: {lost}" if lost else ""))
    t.add_row("costs", costs_line(d["costs"]))
    if (h := d.get("health")) and h["last"]:
        last = h["last"]
        t.add_row("health", Text.assemble((", ".join(f"{k} ×{n}" for k, n in h["counts"].items()), "bold yellow"),
                                          f"  last: {last['kind']}: {last['message'][:160]}"))
    for req in d.get("set_aside_pending", []):
        left = "published copies" if req.get("local_done") else "local and published copies"
        what = f"checkpoint-{req['from_step']}" + ("" if req.get("only_step") else " on")
        t.add_row("set aside", Text(f"{what} ({req['reason']}): {left} still to move (retried every pass)",
                                    style="bold yellow"))
    if d.get("watching"):
        t.add_row("watching", Text(f"pid {d['watching']} (started by hand; `orchestrator watch` advises)", style="cyan"))
    for adv in d.get("advice", [])[-3:]:
        t.add_row("advice", Text.assemble((adv["text"][:200], "bold yellow"), f"  to act: {adv['command']}"))
    events = Table.grid(padding=(0, 1))
    for e in d["events"][-5:]:
        events.add_row(Text(time.strftime("%H:%M:%S", time.localtime(e["at"])), style="dim"),
                       Text(e["kind"], style="cyan"), Text(e["message"]))
    title = f"[bold]{d['run']}[/]" + (f"  recipe {d['recipe_hash'][:12]}" if d["recipe_hash"] else "")
    return Panel(Group(t, Text(""), events), title=title, subtitle=d["output_dir"], expand=False)


def status_view(r: Recipe, j: Journal, watch: bool = False, *, console=None, refresh_s: float = 2.0) -> None:
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    steps = StepLog(output_dir_of(r, j.get_all()) / "logging.jsonl")
    if not watch:
        console.print(status_renderable(status_data(r, j, steps=steps)))
        return
    try:
        with Live(status_renderable(status_data(r, j, steps=steps)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(refresh_s)  # a display refresh interval, not synchronisation
                try:
                    live.update(status_renderable(status_data(r, j, steps=steps)), refresh=True)
                except sqlite3.OperationalError:  # a busy journal: keep the last view, retry next tick
                    continue
    except KeyboardInterrupt:
        pass
