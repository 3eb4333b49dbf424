"""The `orchestrator report` page: one self-contained HTML file (inline CSS and SVG, no scripts, no
external resources) rendered from report.report_data(). Every string from logs or the journal is
escaped: crash evidence is arbitrary trainer output.
"""
from __future__ import annotations

import html
import math
import time
from pathlib import Path

from orchestrator.domain.goodput import LOST_CAUSES
from orchestrator.domain.health.kinds import KINDS

MAX_POINTS = 20_000  # beyond this the loss polyline is thinned (a browser copes, a reader cannot tell)
W, H = 960, 380
ML, MR, MT, MB = 64, 24, 90, 44  # plot margins; the top one holds crash labels

CLASS_COLORS = {
    "cold_start_oom": "#f28e2b", "fla_backward_oom": "#e15759", "oom_during_training": "#ff9d9a",
    "nccl_error": "#4e79a7", "nccl_timeout_hang": "#76b7b2", "port_in_use": "#59a14f",
    "host_oom_killed": "#b07aa1", "disk_full": "#9c755f", "cuda_fatal": "#d62728", "nan_loss": "#edc948",
    "other": "#7f7f7f",
}
HEALTH_COLORS = {k.value: e.colour for k, e in KINDS.items()}   # declared beside each kind
CAUSE_COLORS = {"productive": "#2e9d5b", "startup": "#f2c14e", "lost_progress": "#e4572e", "wait": "#9aa5b1",
                "hang": "#8e44ad", "cleanup": "#3a86ff", "slow": "#c9a227", "other": "#d0d0d0"}

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1000px;
color:#1d2329;background:#fff;padding:0 16px}
h1{font-size:22px;margin:0 0 6px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #e3e6ea;padding-bottom:4px}
dl.meta{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0}
dl.meta dt{color:#5b6570}dl.meta dd{margin:0;font-family:ui-monospace,Menlo,Consolas,monospace;word-break:break-all}
.state{font-weight:600}.state.completed,.state.running{color:#2e9d5b}.state.gave_up{color:#c0392b}
table{border-collapse:collapse;width:100%;font-size:13px}th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eceff2;
vertical-align:top}th{background:#f6f8fa;font-weight:600}td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.nw{white-space:nowrap}
.chip{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px;vertical-align:-1px}
.legend span.item{margin-right:16px;white-space:nowrap;font-size:13px}.ev{color:#5b6570;font-family:ui-monospace,Menlo,
monospace;font-size:12px;word-break:break-word}svg{display:block;width:100%;height:auto}
svg text{font:11px system-ui,sans-serif;fill:#3d4650}.muted{color:#8a939c}
"""


def e(s: object) -> str:
    return html.escape("" if s is None else str(s), quote=True)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def fmt_num(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.3g}"


def fmt_s(s: float) -> str:
    s = float(s)
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def thin(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    if len(points) <= MAX_POINTS:
        return points
    stride = math.ceil(len(points) / MAX_POINTS)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def loss_chart(d: dict) -> str:
    pts = thin(d["losses"])
    health = health_marks(d.get("health", []))
    marks = ([c["step"] for c in d["crashes"]] + [r["step"] for r in d["restarts"]] + [c["step"] for c in d["checkpoints"]]
             + [m[1] for m in health])
    x1 = max([d["max_steps"] or 0, 1] + [s for s, _ in pts] + marks)
    ys = [v for _, v in pts]
    y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
    pad = (y1 - y0) * 0.06 or 0.5
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = W - ML - MR, H - MT - MB

    def X(step: float) -> float:
        return ML + pw * step / x1

    def Y(v: float) -> float:
        return MT + ph * (1 - (v - y0) / (y1 - y0))

    out = [f'<svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="loss over steps">',
           f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="#fbfcfd" stroke="#d5dae0"/>']
    for t in nice_ticks(y0, y1):
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{Y(t):.1f}" y2="{Y(t):.1f}" stroke="#eceff2"/>'
                   f'<text x="{ML - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{fmt_num(t)}</text>')
    for t in nice_ticks(0, x1, 8):
        out.append(f'<line x1="{X(t):.1f}" x2="{X(t):.1f}" y1="{MT + ph}" y2="{MT + ph + 4}" stroke="#8a939c"/>'
                   f'<text x="{X(t):.1f}" y="{MT + ph + 17}" text-anchor="middle">{fmt_num(t)}</text>')
    out.append(f'<text x="{ML + pw / 2}" y="{H - 6}" text-anchor="middle">step</text>'
               f'<text x="14" y="{MT + ph / 2}" transform="rotate(-90 14 {MT + ph / 2})" text-anchor="middle">loss</text>')
    for r in d["restarts"]:
        x = X(r["step"])
        what = f"resumed from {r['resumed_from']}" if r["resumed_from"] else "started fresh"
        tip = f"attempt {r['n']}: restart at step {r['step']}, {what}"
        out.append(f'<g class="restart"><title>{e(tip)}</title>'
                   f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT}" y2="{MT + ph}" stroke="#6c7a89" stroke-width="1.5"'
                   f' stroke-dasharray="5 4"/><rect x="{x - 4:.1f}" y="{MT}" width="8" height="{ph}" fill="transparent"/></g>')
    if pts:
        coords = " ".join(f"{X(s):.1f},{Y(v):.1f}" for s, v in pts)
        out.append(f'<polyline class="loss" fill="none" stroke="#1f5fa8" stroke-width="1.6" stroke-linejoin="round"'
                   f' points="{coords}"><title>loss, {len(pts)} logged steps</title></polyline>')
    else:
        out.append(f'<text x="{ML + pw / 2}" y="{MT + ph / 2}" text-anchor="middle" class="muted">'
                   'no loss logged yet</text>')
    n_band = 0
    for ev, first, last in health:
        x0, x, col = X(first), X(last), HEALTH_COLORS.get(ev["kind"], "#7f7f7f")
        tip = (f"{ev['kind']} (steps {first}-{last}, found {delay_text(first, last)}): {ev['message']}"
               if first != last else f"{ev['kind']}: {ev['message']}")
        band = ""
        if x > x0:   # from the onset to the finding, with the detection delay written in it
            ty, n_band = MT + 44 + 14 * (n_band % 4), n_band + 1   # under the markers, over the curve's start
            band = (f'<rect x="{x0:.1f}" y="{MT}" width="{x - x0:.1f}" height="{ph}" fill="{col}" fill-opacity="0.12"/>'
                    f'<text class="delay" x="{x - 4 if x - ML > 340 else x + 4:.1f}" y="{ty:.1f}"'
                    f' text-anchor="{"end" if x - ML > 340 else "start"}" style="fill:{col};font-weight:600;'
                    f'paint-order:stroke;stroke:#fff;stroke-width:3px">{e(ev["kind"])}: onset {first}, found at {last} ({delay_text(first, last)})</text>')
        out.append(f'<g class="health" data-kind="{e(ev["kind"])}"><title>{e(tip)}</title>{band}'
                   f'<path d="M{x:.1f},{MT + 14:.1f} l6,7 l-6,7 l-6,-7 z" fill="{col}"/>'
                   f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT + 28}" y2="{MT + ph}" stroke="{col}" stroke-width="1"'
                   f' stroke-dasharray="2 3"/></g>')
    for s in d["nan_steps"]:
        out.append(f'<g class="nan"><title>{e(f"step {s}: loss is NaN/inf")}</title><text x="{X(s):.1f}" y="{MT + 12}"'
                   f' text-anchor="middle" style="fill:#c0392b;font-weight:700">×</text></g>')
    for c in d["checkpoints"]:
        x, y = X(c["step"]), MT + ph
        state = ("verified" if c["ok"] else "INVALID: " + "; ".join(c["problems"])) + (", synced" if c["synced"] else "")
        fill = "#2e9d5b" if c["ok"] else "#c0392b"
        tip = f"checkpoint-{c['step']}: {state}"
        out.append(f'<g class="checkpoint"><title>{e(tip)}</title>'
                   f'<path d="M{x:.1f},{y - 11:.1f} l5,9 h-10 z" fill="{fill if c["synced"] or not c["ok"] else "#fff"}"'
                   f' stroke="{fill}" stroke-width="1.5"/></g>')
    for c in d["crashes"]:
        x, col = X(c["step"]), CLASS_COLORS.get(c["class"], "#7f7f7f")
        side, anchor = (-1, "end") if x > ML + pw * 0.8 else (1, "start")  # labels near the right edge lean left
        tip = f"attempt {c['n']} crashed at step {c['step']}: {c['class']}" + (f"\n{c['evidence']}" if c["evidence"] else "")
        out.append(f'<g class="crash" data-class="{e(c["class"])}"><title>{e(tip)}</title>'
                   f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT - 4}" y2="{MT + ph}" stroke="{col}" stroke-width="2.2"/>'
                   f'<circle cx="{x:.1f}" cy="{MT - 4}" r="4" fill="{col}"/>'
                   f'<text x="{x + 4 * side:.1f}" y="{MT - 10}" transform="rotate({-32 * side} {x + 4 * side:.1f} {MT - 10})"'
                   f' text-anchor="{anchor}" style="fill:{col};font-weight:600">{e(c["class"])}</text>'
                   f'<rect x="{x - 5:.1f}" y="{MT - 8}" width="10" height="{ph + 8}" fill="transparent"/></g>')
    out.append("</svg>")
    return "".join(out)


def delay_text(first: int, last: int) -> str:
    """A finding's detection delay: how many steps after its onset it was found."""
    return f"{last - first} step{'s' if last - first != 1 else ''} after the onset"


def slow_spells(events: list[dict], last_step: int) -> list[tuple[int, int]]:
    """The (first, last) steps of each throughput_drop until its throughput_recovered (or the last step)."""
    spells, start = [], None
    for ev in events:
        step = (ev.get("data") or {}).get("step")
        if step is None:
            continue
        if ev["kind"] == "throughput_drop" and start is None:
            start = step
        elif ev["kind"] == "throughput_recovered" and start is not None:
            spells.append((start, step))
            start = None
    return spells + ([(start, last_step)] if start is not None else [])


def throughput_chart(d: dict) -> str:
    """Seconds per step as the throughput detector judges them (report.judged_speed): each measurement, the
    median it compares, the attempt's baseline and the drop threshold; slow spells shaded, each
    throughput_drop / throughput_recovered marked with its measured seconds per step. The trainer's own
    figure, an average since its start, is not plotted: it hides a drop."""
    sp = d.get("speed") or {}
    meas, cur, bases = thin(sp.get("measured", [])), thin(sp.get("current", [])), sp.get("baselines", [])
    ratio = sp.get("slowdown_ratio", 1.5)
    marks = [ev for ev in d.get("health", []) if ev["kind"] in ("throughput_drop", "throughput_recovered")]
    if not meas and not marks:
        return '<p class="muted">no step times logged yet</p>'
    x1 = max([d["max_steps"] or 0, 1] + [s for s, _ in meas] + [(ev.get("data") or {}).get("step", 0) for ev in marks])
    # the judged median, the threshold and the markers set the scale; a lone slow measurement is clipped
    ys = ([v for _, v in cur] + [b * ratio for *_, b in bases]
          + [(ev.get("data") or {}).get(k, 0.0) for ev in marks for k in ("current_s", "baseline_s")])
    y1 = (max(ys) if ys else max(v for _, v in meas)) * 1.15 or 1.0
    h, top = 200, 14   # no crash labels above this one
    pw, ph = W - ML - MR, h - top - 24

    def X(step: float) -> float:
        return ML + pw * step / x1

    def Y(v: float) -> float:
        return top + ph * (1 - min(v, y1) / y1)

    out = [f'<svg viewBox="0 0 {W} {h}" width="{W}" height="{h}" role="img" aria-label="seconds per step">',
           f'<rect x="{ML}" y="{top}" width="{pw}" height="{ph}" fill="#fbfcfd" stroke="#d5dae0"/>']
    for t in nice_ticks(0, y1, 4):
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{Y(t):.1f}" y2="{Y(t):.1f}" stroke="#eceff2"/>'
                   f'<text x="{ML - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{fmt_num(t)}</text>')
    for t in nice_ticks(0, x1, 8):
        out.append(f'<text x="{X(t):.1f}" y="{top + ph + 16}" text-anchor="middle">{fmt_num(t)}</text>')
    out.append(f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" text-anchor="middle">s/step</text>')
    for a, b in slow_spells(marks, int(x1)):
        out.append(f'<rect class="slow" x="{X(a):.1f}" y="{top}" width="{max(X(b) - X(a), 2):.1f}" height="{ph}"'
                   f' fill="#17becf" fill-opacity="0.15"><title>slow: steps {a}-{b}</title></rect>')
    for a, b, base in bases:
        for cls, v, col, what in (("baseline", base, "#2e9d5b", "baseline"),
                                  ("threshold", base * ratio, "#c0392b", f"drop threshold ({ratio:g}x baseline)")):
            out.append(f'<line class="{cls}" x1="{X(a):.1f}" x2="{X(b):.1f}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="{col}"'
                       f' stroke-width="1.2" stroke-dasharray="6 4"><title>{e(f"{what}: {v:.3g} s/step, steps {a}-{b}")}'
                       f'</title></line>')
    if meas:
        dots = "".join(f'<circle cx="{X(s):.1f}" cy="{Y(v):.1f}" r="1.6"/>' for s, v in meas)
        out.append(f'<g class="measured" fill="#9aa5b1"><title>measured seconds per step, {len(meas)} measurements'
                   f'</title>{dots}</g>')
    if cur:
        coords = " ".join(f"{X(s):.1f},{Y(v):.1f}" for s, v in cur)
        out.append(f'<polyline class="judged" fill="none" stroke="#1f5fa8" stroke-width="1.8" points="{coords}">'
                   f'<title>judged seconds per step (median of the recent measurements), {len(cur)} points'
                   f'</title></polyline>')
    for ev in marks:
        data = ev.get("data") or {}
        if "step" in data and "current_s" in data:
            col = HEALTH_COLORS.get(ev["kind"], "#7f7f7f")
            out.append(f'<g class="throughput" data-kind="{e(ev["kind"])}"><title>{e(ev["kind"] + ": " + ev["message"])}</title>'
                       f'<circle cx="{X(data["step"]):.1f}" cy="{Y(data["current_s"]):.1f}" r="4" fill="{col}"/></g>')
    out.append("</svg>")
    legend = [("#1f5fa8", "judged s/step (median)"), ("#9aa5b1", "measured"), ("#2e9d5b", "baseline"),
              ("#c0392b", f"drop threshold ({ratio:g}x)")]
    return "".join(out) + '<p class="legend">' + "".join(
        f'<span class="item"><span class="chip" style="background:{c}"></span>{e(t)}</span>' for c, t in legend) + "</p>"


def health_marks(events: list[dict]) -> list[tuple[dict, int, int]]:
    """The health events that have steps, as (event, first step, last step), to mark on the loss curve."""
    out = []
    for ev in events:
        data = ev.get("data") or {}
        last = data.get("last_step", data.get("first_step"))
        if isinstance(last, int):
            first = data.get("first_step")
            out.append((ev, first if isinstance(first, int) and first <= last else last, last))
    return out


def health_table(events: list[dict]) -> str:
    """Every health event with its numbers."""
    keys = ("first_step", "last_step", "window", "level", "threshold", "value")
    rows = "".join(
        f"<tr><td class=nw>{e(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ev['at'])))}</td>"
        f'<td class=nw><span class="chip" style="background:{HEALTH_COLORS.get(ev["kind"], "#7f7f7f")}"></span>'
        f"{e(ev['kind'])}</td>" + "".join(f"<td class=num>{e((ev.get('data') or {}).get(k, '-'))}</td>" for k in keys)
        + f"<td class=ev>{e(ev['message'])}</td></tr>" for ev in events)
    head = "".join(f"<th class=num>{k.replace('_', ' ')}</th>" for k in keys)
    return f"<table><tr><th>time</th><th>kind</th>{head}<th>message</th></tr>{rows}</table>"


def chart_legend(d: dict) -> str:
    items = [f'<span class="item"><span class="chip" style="background:#1f5fa8"></span>loss '
             f'({len(d["losses"])} steps)</span>',
             '<span class="item"><span class="chip" style="border:1.5px dashed #6c7a89;background:none"></span>'
             f'restart ({len(d["restarts"])})</span>',
             '<span class="item"><span class="chip" style="background:#2e9d5b"></span>checkpoint (filled: synced)</span>']
    seen: dict[str, int] = {}
    for c in d["crashes"]:
        seen[c["class"]] = seen.get(c["class"], 0) + 1
    items += [f'<span class="item"><span class="chip" style="background:{CLASS_COLORS.get(k, "#7f7f7f")}"></span>'
              f'{e(k)} ×{n}</span>' for k, n in seen.items()]
    kinds: dict[str, int] = {}
    for ev in d.get("health", []):
        kinds[ev["kind"]] = kinds.get(ev["kind"], 0) + 1
    items += [f'<span class="item"><span class="chip" style="background:{HEALTH_COLORS.get(k, "#7f7f7f")};'
              f'transform:rotate(45deg)"></span>{e(k)} ×{n}</span>' for k, n in kinds.items()]
    return '<p class="legend">' + "".join(items) + "</p>"


def goodput_section(g: dict) -> str:
    total = g["total_s"] or 0.0
    parts = [("productive", g["productive_s"])] + [(k, g["lost_s"].get(k, 0.0)) for k in LOST_CAUSES]
    out = [f'<p><b>goodput {g["ratio"]:.1%}</b>: {fmt_s(g["productive_s"])} productive of {fmt_s(total)}'
           f' (lost {fmt_s(max(0.0, total - g["productive_s"]))})</p>',
           f'<svg class="goodput" viewBox="0 0 {W} 34" width="{W}" height="34" role="img" aria-label="goodput">']
    x = 0.0
    for name, secs in parts:
        if total <= 0 or secs <= 0:
            continue
        w = W * secs / total
        out.append(f'<rect class="seg" data-cause="{name}" x="{x:.2f}" y="2" width="{w:.2f}" height="30"'
                   f' fill="{CAUSE_COLORS[name]}"><title>{e(f"{name}: {secs:.1f} s ({secs / total:.1%})")}</title></rect>')
        x += w
    out.append("</svg><table><tr><th>time</th><th class=num>seconds</th><th class=num>share</th></tr>")
    for name, secs in parts:
        share = f"{g['ratio'] if name == 'productive' else secs / total:.1%}" if total > 0 else "-"
        out.append(f'<tr><td><span class="chip" style="background:{CAUSE_COLORS[name]}"></span>{name}</td>'
                   f'<td class=num>{secs:.1f}</td><td class=num>{share}</td></tr>')
    out.append(f'<tr><th>total</th><th class=num>{total:.1f}</th><th class=num></th></tr></table>')
    return "".join(out)


def exit_text(a: dict) -> str:
    if a["signal"] is not None:
        return f"signal {a['signal']}"
    return "" if a["exit_code"] is None else f"exit {a['exit_code']}"


def attempts_table(attempts: list[dict]) -> str:
    out = ["<table><tr><th class=num>#</th><th>started</th><th class=num>ran</th><th>steps</th><th>exit</th>"
           "<th>class</th><th class=num>start-up</th><th class=num>saves</th><th>resumed from</th><th>evidence</th></tr>"]
    for a in attempts:
        ran = fmt_s(a["ended_at"] - a["started_at"]) if a["ended_at"] else "running"
        steps = f"{a['start_step'] or 0} → {a['end_step'] if a['end_step'] is not None else '?'}"
        cls = (f'<span class="chip" style="background:{CLASS_COLORS.get(a["class"], "#7f7f7f")}"></span>{e(a["class"])}'
               if a["class"] else '<span class="muted">-</span>')
        ev = a["evidence"][0] if a["evidence"] else ""
        out.append(f"<tr><td class=num>{a['n']}</td><td class=nw>{e(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(a['started_at'])))}"
                   f"</td><td class=num>{e(ran)}</td><td class=nw>{e(steps)}</td><td class=nw>{e(exit_text(a))}</td>"
                   f"<td class=nw>{cls}</td>"
                   f"<td class=num>{e(fmt_s(a['startup_s']) if a.get('startup_s') is not None else '-')}</td>"
                   f"<td class=num>{e(save_text(a))}</td>"
                   f"<td class=ev title=\"{e(a['resumed_from'] or '')}\">{e(Path(a['resumed_from']).name if a['resumed_from'] else '-')}</td>"
                   f"<td class=ev title=\"{e(chr(10).join(a['evidence']))}\">{e(ev[:240])}</td></tr>")
    out.append("</table>")
    return "".join(out)


def save_text(a: dict) -> str:
    """One attempt's measured saves: mean seconds x count."""
    return f"{fmt_s(a['save_s'])} × {a['save_count']}" if a.get("save_s") is not None and a.get("save_count") else "-"


def costs_section(c: dict) -> str:
    """Start-up and save costs as measured (costs.py), and the checkpoint interval in use."""
    start = (f"start-up {fmt_s(c['startup_s_last'])} (last), {fmt_s(c['startup_s_mean'])} mean of {c['starts']}"
             if c["starts"] else "start-up not measured yet")
    save = f"save {fmt_s(c['save_s_mean'])} mean of {c['saves']}" if c["saves"] else "no save measured yet"
    every = f"; a checkpoint every {c['save_interval_steps']} steps" if c.get("save_interval_steps") else ""
    return f"<p>{e(start)}; {e(save)}{e(every)}</p>"


def events_list(events: list[dict]) -> str:
    rows = "".join(f"<tr><td>{e(time.strftime('%H:%M:%S', time.localtime(ev['at'])))}</td><td>{e(ev['kind'])}</td>"
                   f"<td class=ev>{e(ev['message'])}</td></tr>" for ev in events)
    return f"<table><tr><th>time</th><th>kind</th><th>message</th></tr>{rows}</table>"


def advice_list(advice: list[dict]) -> str:
    """Watch mode: what `run` would have done, with the command that does it."""
    rows = "".join(f"<tr><td>{e(time.strftime('%H:%M:%S', time.localtime(a['at'])))}</td><td>{e(a['action'])}</td>"
                   f"<td class=ev>{e(a['text'])}</td><td><code>{e(a['command'])}</code></td></tr>" for a in advice)
    return f"<table><tr><th>time</th><th>action</th><th>advice</th><th>to act</th></tr>{rows}</table>"


def render(d: dict) -> str:
    steps = f"{d['step'] if d['step'] is not None else '?'} / {d['max_steps'] or '?'}"
    meta = [("recipe hash", d["recipe_hash"]), ("backend", d["backend"]), ("model", d["model"]),
            ("steps", steps), ("goodput", f"{d['goodput']['ratio']:.1%}"), ("attempts", len(d["attempts"])), ("crashes", len(d["crashes"])),
            ("output dir", d["output_dir"]),
            ("generated", time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(d["generated_at"])))]
    if d["exit_reason"]:
        meta.insert(0, ("reason", d["exit_reason"]))
    state = d["state"] or "unknown"
    return "".join([
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{e(d['run'])}: orchestrator report</title><style>{CSS}</style></head><body>",
        f'<h1>{e(d["run"])} <span class="state {e(state)}">{e(state)}</span></h1><dl class="meta">',
        "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in meta), "</dl>",
        "<h2>Loss</h2>", loss_chart(d), chart_legend(d),
        *(["<h2>Health</h2>", health_table(d["health"])] if d.get("health") else []),
        "<h2>Throughput</h2>", throughput_chart(d),
        "<h2>Goodput</h2>", goodput_section(d["goodput"]),
        *(["<h2>Costs</h2>", costs_section(d["costs"])] if d.get("costs") else []),
        *(["<h2>Advice</h2>", advice_list(d["advice"])] if d.get("advice") else []),
        "<h2>Attempts</h2>", attempts_table(d["attempts"]),
        "<h2>Recent events</h2>", events_list(d["events"]),
        "</body></html>\n",
    ])
