"""The demo as a guided first run: the recipe it runs, written to its workdir so every other command
takes it; the injected crash (SIGKILL the whole trainer tree once the first attempt reaches a step, as
the kernel's OOM killer would), told at the step it really happened; and the commands to try next.

`demo --watch` shows watch mode instead: the trainer started by hand as a user would (`nohup swift sft ...
> train.log 2>&1 &`, its own session), then `orchestrator watch --take-over` of it; the injected SIGKILL is
classified and advised by the watcher, and the run taken over by a supervisor, which resumes and completes it."""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.host.launch import local as launcher
from orchestrator.domain import progress
from orchestrator.config.recipe import Recipe, apply_overrides
from orchestrator.config.render.command import render_command
from orchestrator.types import ExitCode

RECIPE_NAME = "demo-cpu.toml"
# The demo's own files, relative to the written recipe (the workdir), so the recipe works from anywhere.
WORKDIR_PATHS = ('model.path="tiny-moe"', 'data.dataset=["data.jsonl"]', 'run.output_dir="run/out"',
                 'run.persistent_dir="run/persistent"')
POLL_S = 0.05  # how often the injector reads the trainer's logging.jsonl (a demo step takes ~0.05 s)
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


# ------------------------------------------------------------------------------------------ the recipe file

def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, str)):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else "nan" if math.isnan(v) else "inf" if v > 0 else "-inf"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    return v.isoformat()  # TOML dates and times


def toml_key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else json.dumps(k)


def to_toml(data: dict) -> str:
    """A recipe's data as TOML: top-level tables, anything deeper as inline tables."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for name, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{toml_key(name)}]"] + [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def write_recipe(packaged: Path, workdir: Path, overrides: tuple[str, ...]) -> Path:
    """The recipe the demo runs, as a file in the workdir: the packaged demo recipe with the workdir's
    paths and the --set overrides folded in. `status`, `history`, `report` and `run` take it as is."""
    data = apply_overrides(tomllib.loads(packaged.read_text(encoding="utf-8")), [*WORKDIR_PATHS, *overrides])
    path = workdir / RECIPE_NAME
    header = ("# Written by `orchestrator demo` from its packaged recipe"
              + (f" with --set {' --set '.join(overrides)}" if overrides else "")
              + ".\n# Relative paths are relative to this file.\n")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(header + to_toml(data), encoding="utf-8")
    tmp.replace(path)
    return path


def keep_node_history_apart(workdir: Path) -> Path:
    """Point this process's node history (host/node_history.py) at the demo's own directory and return it: the
    injected SIGKILL is no fault of this machine, and every later real run's save_steps = "auto" reads the
    machine's history (node.json in /var/lib/orchestrator or ~/.local/state/orchestrator)."""
    directory = workdir / "node-state"
    os.environ["ORCHESTRATOR_NODE_STATE_DIR"] = str(directory)
    return directory


# ------------------------------------------------------------------------------------------ the injected crash

@dataclass
class Injection:
    """What the injector did: `step` is the trainer's last logged step when the SIGKILL took it."""

    asked_step: int
    thread: threading.Thread | None = None
    step: int | None = None
    at: float | None = None
    killed: list[int] = field(default_factory=list)


SUPERVISED_THEN = ("The supervisor now classifies the crash and resumes from the newest verified checkpoint;"
                   " the steps after that checkpoint are redone and charged to goodput's lost_progress.")
WATCHED_THEN = ("The watcher now classifies the crash and advises what `run` would do; with --take-over it then"
                " hands the run to a supervisor, which resumes from the newest verified checkpoint.")


def inject_kill(sup, at_step: int, say=print, then: str = SUPERVISED_THEN) -> Injection:
    """SIGKILL the first attempt's trainer tree once its logging.jsonl reaches `at_step`, then tell
    (`say`) at which step it really died: the trainer logs on, a little, between the check and the kill.
    `sup` is a Supervisor, or a Watch (loop/watch.py: its watched trainer is the attempt's); `then` says
    what happens next."""
    inj = Injection(at_step)

    def watch() -> None:
        tail, step = None, None
        while not sup.stop_event.wait(POLL_S):
            a = sup.attempt
            if a is None:
                continue
            if a.n != 1 or a.launched.exited.is_set():
                return  # the first attempt ended before the step: nothing to inject
            tail = tail or launcher.FileTail(Path(sup.ctx.out) / "logging.jsonl")
            step = _last_step(tail, step)
            if step is not None and step >= at_step:
                inj.killed = [p.pid for p in launcher.tree(a.launched.pid)]
                launcher.kill_pids(inj.killed, signal.SIGKILL)
                inj.at = time.time()
                a.launched.exited.wait(30)  # nothing is logged after the SIGKILL: the file now ends where it died
                inj.step = _last_step(tail, step)
                say(f"{time.strftime('%H:%M:%S', time.localtime(inj.at))} demo: injected SIGKILL into the trainer"
                    f" ({len(inj.killed)} process(es)) at step {inj.step}"
                    + (f" (asked for step {at_step}; it logged on until the kill landed)" if inj.step != at_step else "")
                    + f". {then}")
                return

    inj.thread = threading.Thread(target=watch, name="demo-crash", daemon=True)
    inj.thread.start()
    return inj


def _last_step(tail: launcher.FileTail, step: int | None) -> int | None:
    for line in tail.lines(None):
        p = progress.parse_jsonl_line(line)
        if p is not None:
            step = p.step
    return step


# ------------------------------------------------------------------------------------------ started by hand

def start_by_hand(r: Recipe, say=print) -> subprocess.Popen:
    """Starts the recipe's trainer as a user would, outside the orchestrator: `nohup <command> > train.log 2>&1 &`
    in the output_dir, in a session of its own, and tells the command. The caller reaps (or kills) it."""
    out = Path(r.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd = render_command(r, None, r.supervisor.port_range[0])
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
    with open(out / "train.log", "ab") as log:
        proc = subprocess.Popen(["nohup", *launcher.resolve(cmd.argv)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **cmd.env}, cwd=out,
                                start_new_session=True)
    say(f"demo: started the trainer by hand, as you would (pid {proc.pid}), not by the orchestrator:\n"
        f"  cd {shlex.quote(str(out))} && {env} nohup {shlex.join(cmd.argv)} > train.log 2>&1 &")
    return proc


def end_by_hand(proc: subprocess.Popen, say=print) -> None:
    """Reaps the trainer start_by_hand started; one still running (the demo was interrupted) is killed with its
    process group first: the demo leaves nothing running."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        say(f"demo: the demo was interrupted: killed the trainer it started (kill -9 -{proc.pid})")
    proc.wait()


def watch_by_hand(r: Recipe, path: Path, on_start, say=print, echo=print) -> ExitCode:
    """The demo's trainer started by hand, then `orchestrator watch PATH --take-over` of it in this process
    (`on_start` gets the Watch); the trainer is reaped (killed if still running) before it returns."""
    from orchestrator.ops.watching import watch

    trainer = start_by_hand(r, say=say)
    say(f"demo: now `orchestrator watch {path} --take-over`: it finds the trainer through /proc, reads its "
        "train.log, advises what `run` would do, and takes the run over only once the trainer ended badly (with a "
        "run of your own: `orchestrator import train.sh --output my-run.toml`, then `orchestrator watch my-run.toml`)")
    try:
        return watch(r, str(path), (), trainer.pid, "crash", echo=echo, on_start=on_start)
    finally:
        end_by_hand(trainer, say=say)


# ------------------------------------------------------------------------------------------ what to try next

def shown_path(path: Path, cwd: Path) -> str:
    """The path as typed from `cwd` (relative below it, else absolute), shell-quoted."""
    path = Path(os.path.abspath(path))
    try:
        text = str(path.relative_to(cwd))
    except ValueError:
        text = str(path)
    return shlex.quote(text)


def next_steps(recipe: Path, html: Path, cwd: Path) -> str:
    rp = shown_path(recipe, cwd)
    rows = [(f"orchestrator status {rp}", "the run now: state, step, checkpoints, sync, goodput (--watch: live)"),
            (f"orchestrator history {rp}", "every attempt: exit, crash class, steps, resume point; goodput"),
            (f"orchestrator report {rp}", f"an HTML report, written to {shown_path(html, cwd)}"),
            (f"orchestrator run {rp}", "run it again: it is complete, so nothing relaunches (final sync only)"),
            (f"orchestrator plan {rp}", "the exact trainer command, memory estimate and pre-flight checks")]
    width = max(len(c) for c, _ in rows)
    return "\n".join(["", f"the demo recipe is {rp}; next, try:"] + [f"  {c:<{width}}  # {why}" for c, why in rows])
