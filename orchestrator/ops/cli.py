"""Command line: import, plan, run, watch, demo, status, history, classify, verify, sync, report, simulate, install-service.

Exit codes: 0 ok, 1 internal error, 2 bad input (nothing launched), 3 gave up. Every command that
takes a recipe takes `--set dotted.key=value` overrides, validated like the file.
"""
from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import click

from orchestrator.config.recipe import Problem, Recipe, RecipeError, load
from orchestrator.store.rundir import DriftRefused
from orchestrator.types import ExitCode

RECIPE = click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
SET = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe key.")
JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _wants_json() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.params.get("as_json"))


def fail(message: str, code: ExitCode = ExitCode.BAD_INPUT, problems: tuple[Problem, ...] = ()) -> None:
    """One `orchestrator: error:` line per problem on stderr; with --json also the error as JSON on stdout."""
    if _wants_json():
        click.echo(json.dumps({"error": message, "problems": [p.as_dict() for p in problems]}, indent=2))
    for line in message.splitlines() or [""]:
        click.echo(f"orchestrator: error: {line}", err=True)
    sys.exit(int(code))


def load_recipe(path: Path, overrides: tuple[str, ...]) -> Recipe:
    from orchestrator.config.render.command import rendering_problems

    try:
        return load(path, list(overrides), checks=[rendering_problems])
    except RecipeError as e:
        fail(str(e), problems=e.problems)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="orchestrator")
def main() -> None:
    """Keep multi-day ms-swift LoRA fine-tunes of large MoE models alive."""


@main.command(name="import")
@click.argument("script")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the recipe here (default: stdout).")
@click.option("--var", "variables", multiple=True, metavar="NAME=VALUE", help="A shell variable the script uses.")
@click.option("--force", is_flag=True, help="Replace an existing --output file.")
@JSON
def import_cmd(script: str, output: Path | None, variables: tuple[str, ...], force: bool, as_json: bool) -> None:
    """Turn SCRIPT (a shell script or pasted command running megatron/swift sft; - reads stdin) into a recipe."""
    from orchestrator.ops.importer import main as import_main

    sys.exit(import_main(script, output, variables, force, as_json))


@main.command()
@RECIPE
@SET
@JSON
@click.option("--no-probe", is_flag=True, help="Skip the write-speed probe of output_dir and persistent_dir.")
def plan(recipe: Path, overrides: tuple[str, ...], as_json: bool, no_probe: bool) -> None:
    """Validate RECIPE; print the exact command, the recipe hash, memory and storage budgets and pre-flight checks."""
    from orchestrator.ops.plan import plan as make_plan
    from orchestrator.ops.plan import plan_text

    p = make_plan(load_recipe(recipe, overrides), probe=not no_probe)
    click.echo(json.dumps(p, indent=2) if as_json else plan_text(p, recipe))
    sys.exit(0 if p["would_run"] else int(ExitCode.BAD_INPUT))


@main.command()
@RECIPE
@SET
def run(recipe: Path, overrides: tuple[str, ...]) -> None:
    """Run RECIPE supervised: launch, watch, classify, recover, restart, until done."""
    r = load_recipe(recipe, overrides)
    sys.exit(int(supervise(r)))


@main.command(name="watch")
@RECIPE
@SET
@click.option("--log", "logs", multiple=True, type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="A file the trainer's output goes to (default: its stdout/stderr file, through /proc).")
@click.option("--pid", type=int, help="The trainer's pid, when several write to the recipe's output_dir.")
@click.option("--take-over", "take_over", is_flag=False, flag_value="crash", default=None,
              type=click.Choice(["crash", "hang"]), metavar="[=hang]",
              help="When the trainer ends badly, supervise the run from there (=hang: also stop a hung one).")
def watch_cmd(recipe: Path, overrides: tuple[str, ...], logs: tuple[Path, ...], pid: int | None,
              take_over: str | None) -> None:
    """Watch a trainer started by hand (nohup, tmux): judge it as `run` would and advise; launch, signal,
    rename or delete nothing unless --take-over. Exit 0: completed; 3: ended badly; 2: bad input."""
    from orchestrator.ops.report import summary
    from orchestrator.ops.watching import BadInput, watch

    r = load_recipe(recipe, overrides)
    try:
        code = watch(r, str(recipe), logs, pid, take_over, echo=lambda line: click.echo(line, err=True))
    except (BadInput, RecipeError) as e:
        fail(str(e), problems=getattr(e, "problems", ()))
    click.echo(summary(r))
    sys.exit(int(code))


def supervise(r: Recipe, on_start=None) -> ExitCode:
    from orchestrator.ops.report import summary
    from orchestrator.loop.supervisor import Supervisor

    sup = Supervisor(r, echo=lambda line: click.echo(line, err=True))
    if on_start:
        on_start(sup)
    try:
        code = sup.run()
    except RecipeError as e:
        fail(str(e), ExitCode.GAVE_UP if isinstance(e, DriftRefused) else ExitCode.BAD_INPUT, e.problems)
    click.echo(summary(sup.recipe))
    return code


@main.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".demo"),
              show_default=True, help="Where the tiny model, data, run and the demo's recipe file go.")
@click.option("--crash-at", type=int, default=15, show_default=True,
              help="SIGKILL the trainer at this step of the first attempt (0: no injected crash).")
@click.option("--watch", "watch_mode", is_flag=True,
              help="Start the trainer by hand (nohup) and `watch --take-over` it instead of running it supervised.")
@SET
def demo(workdir: Path, crash_at: int, watch_mode: bool, overrides: tuple[str, ...]) -> None:
    """Build a tiny MoE locally and run the demo recipe supervised, with one injected crash.

    The recipe it runs is written to WORKDIR/demo-cpu.toml (--set overrides folded in): give it to
    status, history, report and run. With --watch the trainer is started by hand instead, as a user would,
    and watched (`orchestrator watch --take-over`): the crash is advised, then the run taken over."""
    import shutil
    from importlib.resources import files

    from orchestrator.ops import demo as guide
    from orchestrator.ops import tiny
    from orchestrator.store.rundir import state_dir

    workdir = workdir.resolve()
    packaged = Path(str(files("orchestrator") / "data" / "demo-cpu.toml"))
    # Bad --set values fail here, before the build, attributed to --set.
    load_recipe(packaged, (f"model.path={json.dumps(str(workdir / 'tiny-moe'))}",
                           f"data.dataset=[{json.dumps(str(workdir / 'data.jsonl'))}]", *overrides))
    click.echo(f"building the tiny MoE model and dataset in {workdir} (offline) ...")
    tiny.build(workdir)
    shutil.rmtree(workdir / "run", ignore_errors=True)  # a fresh demo run each time
    path = guide.write_recipe(packaged, workdir, overrides)
    r = load_recipe(path, ())
    click.echo(f"wrote the demo recipe to {path}")
    click.echo(f"{'watching' if watch_mode else 'running'} {r.run.name}: {r.optim.iterations} steps, checkpoint "
               f"every {r.checkpoint.save_steps}"
               + (" (chosen at each launch)" if r.checkpoint.save_steps == "auto" else "")
               + (f"; a SIGKILL will hit the trainer once it reaches step {crash_at}" if crash_at else ""))
    started: list = []
    guide.keep_node_history_apart(workdir)  # the injected crash stays out of the machine's node history

    def on_start(sup) -> None:
        started.append(sup)
        if crash_at:
            guide.inject_kill(sup, crash_at, say=click.echo,
                              then=guide.WATCHED_THEN if watch_mode else guide.SUPERVISED_THEN)
    if watch_mode:
        from orchestrator.ops.report import summary
        from orchestrator.ops.watching import BadInput

        try:
            code = guide.watch_by_hand(r, path, on_start, say=click.echo, echo=lambda line: click.echo(line, err=True))
        except BadInput as e:
            fail(str(e))
        click.echo(summary(r))
    else:
        code = supervise(r, on_start=on_start)
    out = Path(started[0].recipe.run.output_dir)  # where it really ran (a drifted recipe runs beside it)
    click.echo(guide.next_steps(path, state_dir(out) / "report.html", Path.cwd()))
    sys.exit(int(code))


def _journal_for(recipe: Path, overrides: tuple[str, ...]):
    from orchestrator.config.recipe import recipe_hash, semantic_view
    from orchestrator.host.journal import Journal, journal_path
    from orchestrator.host.journal_health import damaged_line, diagnose
    from orchestrator.store.rundir import place, state_dir

    r = load_recipe(recipe, overrides)
    try:
        out = place(r.run.output_dir, recipe_hash(r), semantic_view(r), "fresh").output_dir
    except RecipeError:
        out = Path(r.run.output_dir)
    path = journal_path(state_dir(out))
    if not path.exists():
        fail(f"{out}: no journal yet (has `orchestrator run {recipe}` started?)")
    problem = diagnose(path)
    if problem is not None:
        fail(damaged_line(path, problem))
    try:
        return r, Journal(path, readonly=True)
    except sqlite3.Error as e:  # its place refuses even reading (diagnose calls that no damage)
        fail(f"{path}: cannot be read ({e}); check the file's and its directory's permissions and mount")


@main.command()
@RECIPE
@SET
@JSON
@click.option("--watch", is_flag=True, help="Refresh every 2 s until interrupted.")
def status(recipe: Path, overrides: tuple[str, ...], as_json: bool, watch: bool) -> None:
    """Live state of a run (reads the journal; works while the supervisor runs)."""
    from orchestrator.ops.report import status_data
    from orchestrator.ops.status_view import status_view

    r, j = _journal_for(recipe, overrides)
    if as_json:
        click.echo(json.dumps(status_data(r, j), indent=2, default=str))
    else:
        status_view(r, j, watch=watch)


@main.command()
@RECIPE
@SET
@JSON
def history(recipe: Path, overrides: tuple[str, ...], as_json: bool) -> None:
    """Every attempt of a run: exit, class, steps, resume point; goodput."""
    from orchestrator.ops.report import history_data, history_table

    r, j = _journal_for(recipe, overrides)
    data = history_data(r, j)
    click.echo(json.dumps(data, indent=2, default=str) if as_json else history_table(data))


@main.command(name="classify")
@click.argument("logfile", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--exit-code", type=int, default=None, help="The trainer's exit code (negative: signal).")
@click.option("--phase", type=click.Choice(["startup", "training"]), default=None,
              help="Whether the attempt had completed a training step (when you know it; else read from the log).")
@JSON
def classify_cmd(logfile: Path, exit_code: int | None, phase: str | None, as_json: bool) -> None:
    """Classify a crash log offline."""
    from orchestrator.domain.classify import classify
    from orchestrator.types import ExitStatus, Phase

    try:
        text = logfile.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        fail(f"{logfile}: cannot read ({e.strerror})")
    crash = classify(text, ExitStatus.from_returncode(exit_code) if exit_code is not None else None,
                     Phase(phase) if phase else None)
    if as_json:
        click.echo(json.dumps({"class": crash.cls.value, "evidence": list(crash.evidence), "phase": crash.phase.value}))
    else:
        click.echo(f"{crash.cls.value} ({crash.phase.value})")
        for line in crash.evidence:
            click.echo(f"  {line}")


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--recipe", type=click.Path(dir_okay=False, path_type=Path), help="Check LoRA rank/targets against it.")
@click.option("--checksum", is_flag=True, help="Also compare every file's sha256 with the manifest (exit 2 when "
              "there is no usable manifest to compare with; with --recipe, its hash too).")
@JSON
def verify(path: Path, recipe: Path | None, checksum: bool, as_json: bool) -> None:
    """Verify a checkpoint (directory, safetensors file, or an output dir's newest). Exit 2 if bad, or when
    --checksum cannot compare (no usable manifest: the result says why)."""
    from orchestrator.config.recipe import recipe_hash
    from orchestrator.store.checkpoints import LoraExpect, verify_report

    expect, backend, h = None, None, None
    if recipe:
        r = load_recipe(recipe, ())
        expect, backend = LoraExpect(r.lora.rank, r.lora.alpha, tuple(r.lora.target_modules)), r.run.backend
        h = recipe_hash(r)
    rep = verify_report(path, expect, checksum, backend=backend, recipe_hash=h)
    if as_json:
        click.echo(json.dumps(rep))
    else:
        what = ", ".join(x for x in (rep["kind"] and f"{rep['kind']} sft checkpoint",
                                     rep["step"] is not None and f"step {rep['step']}",
                                     rep["ok"] and rep["checksums"] == "compared" and "sha256 as in its manifest")
                        if x)
        click.echo(f"{'ok' if rep['ok'] else 'NOT OK'}: {path}" + (f" ({what})" if what else ""))
        for p in rep["problems"]:
            click.echo(f"  {p}")
    sys.exit(0 if rep["ok"] else int(ExitCode.BAD_INPUT))


@main.command()
@RECIPE
@SET
@click.option("--once", is_flag=True, required=True, help="One pass, for cron/timers.")
@JSON
def sync(recipe: Path, overrides: tuple[str, ...], once: bool, as_json: bool) -> None:
    """Publish verified checkpoints to persistent_dir (atomic, incremental)."""
    from orchestrator.store.publisher import sync_recipe

    r = load_recipe(recipe, overrides)
    if not r.run.persistent_dir:
        fail("run.persistent_dir is not set in the recipe: nothing to sync to")
    try:
        result = sync_recipe(r)
    except RecipeError as e:  # another supervisor publishes into this run's directory
        fail(str(e))
    if as_json:
        click.echo(json.dumps(result, default=str))
    else:
        click.echo(f"published {result['copied']} checkpoint(s), {result['bytes']} bytes; problems: {len(result['problems'])}")
        for p in result["problems"]:
            click.echo(f"  {p}")
    sys.exit(0 if not result["problems"] else 1)


@main.command()
@RECIPE
@SET
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="HTML file (default: <output_dir>/.orchestrator/report.html).")
def report(recipe: Path, overrides: tuple[str, ...], output: Path | None) -> None:
    """Write a self-contained HTML report: loss curve, crashes and restarts, goodput."""
    from orchestrator.ops.report import write_html

    r, j = _journal_for(recipe, overrides)
    click.echo(write_html(r, j, output))


@main.command(name="sbatch")
@RECIPE
@SET
@click.option("--dry-run", is_flag=True, help="Print the batch script; submit nothing.")
def sbatch_cmd(recipe: Path, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Write RECIPE's Slurm batch script (parallel.nnodes nodes) and submit it with sbatch."""
    from orchestrator.host.launch import sbatch

    r = load_recipe(recipe, overrides)
    text = sbatch.script(r, recipe, overrides)
    if dry_run:
        click.echo(text, nl=False)
        return
    path = Path(r.run.output_dir) / f"{r.run.name}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    try:
        job = sbatch.submit(path)
    except (OSError, RuntimeError) as e:
        fail(f"{e}; check that you are on a Slurm login node", ExitCode.BAD_INPUT)
    click.echo(f"submitted {path} as job {job}")


@main.command(name="install-service")
@RECIPE
@click.option("--name", help="systemd instance name (default: run.name).")
@click.option("--dry-run", is_flag=True, help="Print what would be written; write nothing.")
@click.option("--unit-dir", default="/etc/systemd/system", show_default=True)
@click.option("--etc-dir", default="/etc/orchestrator", show_default=True)
def install_service_cmd(recipe: Path, name: str | None, dry_run: bool, unit_dir: str, etc_dir: str) -> None:
    """Install RECIPE as the systemd service orchestrator@NAME."""
    from orchestrator.ops.service import install_service

    r = load_recipe(recipe, ())
    try:
        result = install_service(recipe, name=name or r.run.name, unit_dir=unit_dir, etc_dir=etc_dir, dry_run=dry_run)
    except (ValueError, OSError) as e:
        fail(str(e))
    click.echo(result.text())


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path), required=False)
@SET
@JSON
@click.option("--mix", type=click.Choice(["field", "harsh"]), default="field", show_default=True,
              help="The crash mix (orchestrator/domain/simulate/model.py FIELD, HARSH).")
@click.option("--crash-rate", type=float, default=None, help="Training crashes per hour (the mix's proportions kept).")
@click.option("--save-steps", default=None, help="The orchestrator's interval: auto or N (default: the recipe's, else auto).")
@click.option("--write-gib-s", type=float, default=1.0, show_default=True, help="Checkpoint write speed, GiB/s.")
@click.option("--ready-s", type=float, default=None, help="Verified-ready relaunch after an exit, s (default 5).")
@click.option("--fixed-wait", is_flag=True, help="The orchestrator waits its fixed supervisor.wait_s instead.")
@click.option("--startup-s", type=float, default=480.0, show_default=True,
              help="Launch -> first step, s, both loops (the documented 8 minutes; `orchestrator status` shows a "
                   "run's measured start-up).")
@click.option("--startup-ratio", type=float, default=1.0, show_default=True,
              help="The orchestrator's relaunch start-up / the first one's, as measured (1: the same each time).")
@click.option("--seeds", type=int, default=200, show_default=True)
@click.option("--slowdown", "slowdowns", multiple=True, metavar="SHARE:SPEED",
              help="SHARE of the hours (0-1] at SPEED x the baseline (0-1], e.g. 0.1:0.66; repeatable.")
@click.option("--on-slowdown", type=click.Choice(["warn", "restart"]), default="warn", show_default=True,
              help="The orchestrator's health.on_slowdown in the simulation.")
def simulate(recipe: Path | None, overrides: tuple[str, ...], as_json: bool, mix: str, crash_rate: float | None,
             save_steps: str | None, write_gib_s: float, ready_s: float | None, fixed_wait: bool,
             startup_s: float, startup_ratio: float, seeds: int, slowdowns: tuple[str, ...], on_slowdown: str) -> None:
    """ETT of a long run kept alive by the orchestrator vs the field's plain restart loop (a seeded model).

    Save cost from RECIPE's storage budget (default: the shipped Qwen3.5-397B recipe's numbers) at
    --write-gib-s; the plain loop is the field's procedure: the merged copy at every save, every 100
    steps, `sleep 90`, no hang detection."""
    from orchestrator.domain.simulate import report as S
    from orchestrator.domain.simulate.slow_schedule import check_slowdowns, parse_slowdown
    from orchestrator.ops.plan import simulate_inputs

    if save_steps is not None and save_steps != "auto" and not (save_steps.isdigit() and int(save_steps) > 0):
        fail(f"--save-steps must be auto or a positive number of steps, got {save_steps!r}")
    for name, v in (("--crash-rate", crash_rate), ("--write-gib-s", write_gib_s), ("--ready-s", ready_s),
                    ("--startup-s", startup_s), ("--startup-ratio", startup_ratio), ("--seeds", seeds)):
        if v is not None and (v < 0 or (v == 0 and name != "--crash-rate" and name != "--ready-s")):
            fail(f"{name} must be {'>= 0' if name in ('--crash-rate', '--ready-s') else '> 0'}, got {v}")
    try:
        slow = tuple(parse_slowdown(x) for x in slowdowns)
        check_slowdowns(slow)
    except ValueError as e:
        fail(str(e))
    given: dict = {"write_bytes_per_s": write_gib_s * 2**30, "crash_rate_per_h": crash_rate, "startup_s": startup_s,
                   "startup_ratio": startup_ratio, "slowdowns": slow, "on_slowdown": on_slowdown,
                   "ready_s": None if fixed_wait else (S.DEFAULT_READY_S if ready_s is None else ready_s)}
    if recipe is not None:
        given |= simulate_inputs(load_recipe(recipe, overrides))
    steps = save_steps or given.pop("recipe_save_steps", "auto")
    given.pop("recipe_save_steps", None)
    d = S.ett_report(S.MIXES[mix],
                     S.Inputs(save_steps=steps if steps == "auto" else int(steps), **given), seeds)
    click.echo(json.dumps(d, indent=2) if as_json else S.format_report(d))


@main.command(name="build-tiny")
@click.argument("workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".demo"))
def build_tiny(workdir: Path) -> None:
    """Build the tiny MoE model, tokenizer and chat dataset locally (no network)."""
    from orchestrator.ops import tiny

    click.echo(json.dumps(tiny.build(workdir.resolve())))
