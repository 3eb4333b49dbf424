"""`orchestrator watch`: find the trainer someone started by hand, check what was given, watch it
(loop/watch.py), and hand the run to a supervisor when asked to take over."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.config.recipe import Recipe
from orchestrator.host import trainer_find
from orchestrator.types import ExitCode


class BadInput(Exception):
    """What was given names no watchable run: one line for `orchestrator: error:`, exit 2."""


def pick(r: Recipe, pid: int | None) -> trainer_find.Candidate:
    """The trainer to watch: `pid` when given (it must write to the recipe's output_dir), else the one
    running trainer that does. Raises BadInput naming what was looked for."""
    out = Path(r.run.output_dir)
    if pid is not None:
        c = trainer_find.describe(pid)
        if c is None:
            raise BadInput(f"--pid {pid}: no running megatron/swift sft (or torchrun of one) with an --output_dir "
                           "has this pid")
        if os.path.realpath(c.output_dir) != os.path.realpath(out):
            raise BadInput(f"--pid {pid} writes to {c.output_dir}, not to the recipe's run.output_dir {out}")
        return c
    found = trainer_find.find(out)
    if not found:
        raise BadInput(f"no running megatron/swift sft (or torchrun of one) writes to {out} (looked for "
                       "--output_dir in every process's command line); is it running, and is this its recipe "
                       "(`orchestrator import` of the script that started it)?")
    if len(found) > 1:
        raise BadInput(f"several trainers write to {out}: pids {', '.join(str(c.pid) for c in found)}; "
                       "name one with --pid")
    return found[0]


def logs_of(given: tuple[Path, ...], c: trainer_find.Candidate) -> list[Path]:
    """The log files to read: those given (each must be readable), else the trainer's stdout and stderr when
    they are regular files ([]: logging.jsonl alone shows progress)."""
    for p in given:
        try:
            with open(p, "rb"):
                pass
        except OSError as e:
            raise BadInput(f"--log {p}: cannot read ({e.strerror or e})") from None
    return [p.resolve() for p in given] if given else trainer_find.output_files(c.pid)


def watch(r: Recipe, recipe_arg: str, given_logs: tuple[Path, ...], pid: int | None, take_over: str | None,
          echo: Callable[[str], None], on_start: Callable[[Any], None] | None = None) -> ExitCode:
    """Watches the run's hand-started trainer; with take_over, supervises the run once it ended badly.
    `on_start` is given the Watch before it runs (the demo's injected crash)."""
    from orchestrator.loop.watch import HAND_OFF, Watch, hand_off

    c = pick(r, pid)
    logs = logs_of(given_logs, c)
    echo(f"watching pid {c.pid}: {c.command[:200]}")
    echo(f"  log: {', '.join(map(str, logs))}" if logs else
         "  log: its output goes to no regular file (a terminal?): progress from logging.jsonl only; pass --log "
         "FILE for crash classification")
    trainer = trainer_find.WatchedTrainer.attach(c.pid, c.create_time, logs[0] if logs else
                                                 Path(r.run.output_dir) / "logging.jsonl")
    w = Watch(r, trainer, logs, recipe_arg=recipe_arg, take_over=take_over, echo=echo)
    if on_start:
        on_start(w)
    result = w.run()
    if result == HAND_OFF:
        echo("taking over: supervising the run from here (orchestrator run)")
        return hand_off(r, echo)
    assert isinstance(result, ExitCode)
    return result
