"""Command line: plan, run, demo, status, history, classify, verify, sync, report, install-service.

Exit codes: 0 ok, 1 internal error, 2 bad input (nothing launched), 3 gave up. Every command that
takes a recipe takes `--set dotted.key=value` overrides, validated like the file.
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from orchestrator.recipe import Recipe, RecipeError, load
from orchestrator.types import ExitCode

RECIPE = click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
SET = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe key.")
JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def fail(message: str, code: ExitCode = ExitCode.BAD_INPUT) -> None:
    click.echo(f"orchestrator: error: {message}", err=True)
    sys.exit(int(code))


def load_recipe(path: Path, overrides: tuple[str, ...]) -> Recipe:
    try:
        return load(path, list(overrides))
    except RecipeError as e:
        fail(str(e))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="orchestrator")
def main() -> None:
    """Keep multi-day ms-swift LoRA fine-tunes of large MoE models alive."""


@main.command()
@RECIPE
@SET
@JSON
@click.option("--no-probe", is_flag=True, help="Skip the write-speed probe of output_dir and persistent_dir.")
def plan(recipe: Path, overrides: tuple[str, ...], as_json: bool, no_probe: bool) -> None:
    """Validate RECIPE; print the exact command, the recipe hash, memory and storage budgets and pre-flight checks."""
    from orchestrator.plan import plan as make_plan

    p = make_plan(load_recipe(recipe, overrides), probe=not no_probe)
    if as_json:
        click.echo(json.dumps(p, indent=2))
        return
    click.echo("# environment")
    for k, v in p["env"].items():
        click.echo(f"export {k}={shlex.quote(v)}")
    click.echo("# command")
    click.echo(shlex.join(p["argv"]))
    click.echo(f"# recipe hash {p['recipe_hash']}")
    m = p["memory"]
    cap = f" of {m['capacity_gib']:.0f} GiB" if m["capacity_gib"] else ""
    click.echo(f"# memory per GPU ~{m['total_gib']:.1f} GiB{cap}: weights {m['base_weights_gib']:.1f}, "
               f"LoRA {m['lora_gib']:.2f}, activations {m['activations_gib']:.1f}, optimizer on GPU "
               f"{m['optimizer_gpu_gib']:.2f} (on CPU {m['optimizer_cpu_gib']:.2f}), runtime {m['overhead_gib']:.0f}")
    for note in m["notes"]:
        click.echo(f"#   note: {note}")
    _print_storage(p["storage"])
    click.echo("# pre-flight checks")
    for c in p["checks"]:
        click.echo(f"  [{'ok' if c['ok'] else 'NOT OK'}] {c['name']}: {c['detail']}")


def _print_storage(s: dict) -> None:
    from orchestrator.storage import gib

    parts = ", ".join(f"{k} {gib(v)}" for k, v in s["per_save_bytes"].items())
    click.echo(f"# storage per save {gib(sum(s['per_save_bytes'].values()))}: {parts}")
    if s["final_merged_bytes"]:
        click.echo(f"#   merged model after the last step (checkpoint.merge = \"final\"): {gib(s['final_merged_bytes'])}")
    click.echo(f"#   output_dir needs {gib(s['local_bytes'])}: keep_local {s['keep_local']} ({s['keep_local_source']}) "
               "+ 1 being written" + ("; then the merged export" if s["final_merged_bytes"] else ""))
    if s["persistent_bytes"] is not None:
        click.echo(f"#   persistent_dir needs {gib(s['persistent_bytes'])}; publishing {gib(s['published_per_save_bytes'])} "
                   f"every {s['save_interval_s'] / 60:.0f} min needs {s['publish_bytes_per_s'] / 2**20:,.0f} MiB/s "
                   f"(step {s['step_time_s']:g} s: {s['step_time_source']})")
    for name, d in s["disks"].items():
        speed = f"writes {d['write_bytes_per_s'] / 2**20:,.0f} MiB/s, {d['seconds_per_save']:,.0f} s per save" \
            if d["write_bytes_per_s"] else d["probe"]
        click.echo(f"#   {name} {d['path']}: {gib(d['free_bytes'])} free; {speed}")
    for note in s["notes"]:
        click.echo(f"#   note: {note}")


@main.command()
@RECIPE
@SET
def run(recipe: Path, overrides: tuple[str, ...]) -> None:
    """Run RECIPE supervised: launch, watch, classify, recover, restart, until done."""
    r = load_recipe(recipe, overrides)
    sys.exit(int(supervise(r)))


def supervise(r: Recipe, on_start=None) -> ExitCode:
    from orchestrator.report import summary
    from orchestrator.supervisor import Supervisor

    sup = Supervisor(r, echo=lambda line: click.echo(line, err=True))
    if on_start:
        on_start(sup)
    try:
        code = sup.run()
    except RecipeError as e:
        fail(str(e), ExitCode.GAVE_UP if type(e).__name__ == "DriftRefused" else ExitCode.BAD_INPUT)
    click.echo(summary(sup.recipe))
    return code


@main.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".demo"),
              show_default=True, help="Where the tiny model, data and run go.")
@click.option("--crash-at", type=int, default=15, show_default=True,
              help="SIGKILL the trainer at this step of the first attempt (0: no injected crash).")
@SET
def demo(workdir: Path, crash_at: int, overrides: tuple[str, ...]) -> None:
    """Build a tiny MoE locally and run the demo recipe supervised, with one injected crash."""
    import shutil
    from importlib.resources import files

    from orchestrator import tiny
    from orchestrator.demo import inject_kill

    workdir = workdir.resolve()
    click.echo(f"building the tiny MoE model and dataset in {workdir} (offline) ...")
    info = tiny.build(workdir)
    shutil.rmtree(workdir / "run", ignore_errors=True)  # a fresh demo run each time
    path = Path(str(files("orchestrator") / "data" / "demo-cpu.toml"))
    r = load_recipe(path, (f"model.path={json.dumps(info['model'])}", f"data.dataset=[{json.dumps(info['data'])}]",
                           f"run.output_dir={json.dumps(str(workdir / 'run' / 'out'))}",
                           f"run.persistent_dir={json.dumps(str(workdir / 'run' / 'persistent'))}", *overrides))
    click.echo(f"running {r.run.name}: {r.optim.iterations} steps, checkpoint every {r.checkpoint.save_steps}"
               + (f", SIGKILL injected at step {crash_at}" if crash_at else ""))
    sys.exit(int(supervise(r, on_start=(lambda sup: inject_kill(sup, crash_at)) if crash_at else None)))


def _journal_for(recipe: Path, overrides: tuple[str, ...]):
    from orchestrator.journal import Journal, journal_path
    from orchestrator.rundir import place, state_dir
    from orchestrator.recipe import recipe_hash, semantic_view

    r = load_recipe(recipe, overrides)
    try:
        out = place(r.run.output_dir, recipe_hash(r), semantic_view(r), "fresh").output_dir
    except RecipeError:
        out = Path(r.run.output_dir)
    path = journal_path(state_dir(out))
    if not path.exists():
        fail(f"{out}: no journal yet (has `orchestrator run {recipe}` started?)")
    return r, Journal(path, readonly=True)


@main.command()
@RECIPE
@SET
@JSON
@click.option("--watch", is_flag=True, help="Refresh every 2 s until interrupted.")
def status(recipe: Path, overrides: tuple[str, ...], as_json: bool, watch: bool) -> None:
    """Live state of a run (reads the journal; works while the supervisor runs)."""
    from orchestrator.report import status_data, status_view

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
    from orchestrator.report import history_data, history_table

    r, j = _journal_for(recipe, overrides)
    data = history_data(r, j)
    click.echo(json.dumps(data, indent=2, default=str) if as_json else history_table(data))


@main.command(name="classify")
@click.argument("logfile", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--exit-code", type=int, default=None, help="The trainer's exit code (negative: signal).")
@JSON
def classify_cmd(logfile: Path, exit_code: int | None, as_json: bool) -> None:
    """Classify a crash log offline."""
    from orchestrator.classify import classify
    from orchestrator.types import ExitStatus

    try:
        text = logfile.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        fail(f"{logfile}: cannot read ({e.strerror})")
    crash = classify(text, ExitStatus.from_returncode(exit_code) if exit_code is not None else None)
    if as_json:
        click.echo(json.dumps({"class": crash.cls.value, "evidence": list(crash.evidence), "phase": crash.phase.value}))
    else:
        click.echo(f"{crash.cls.value} ({crash.phase.value})")
        for line in crash.evidence:
            click.echo(f"  {line}")


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--recipe", type=click.Path(dir_okay=False, path_type=Path), help="Check LoRA rank/targets against it.")
@click.option("--checksum", is_flag=True, help="Also compare every file's sha256 with the manifest.")
@JSON
def verify(path: Path, recipe: Path | None, checksum: bool, as_json: bool) -> None:
    """Verify a checkpoint (directory, safetensors file, or an output dir's newest). Exit 2 if bad."""
    from orchestrator.checkpoints import LoraExpect, verify_report

    expect, backend = None, None
    if recipe:
        r = load_recipe(recipe, ())
        expect, backend = LoraExpect(r.lora.rank, r.lora.alpha, tuple(r.lora.target_modules)), r.run.backend
    rep = verify_report(path, expect, checksum, backend=backend)
    if as_json:
        click.echo(json.dumps(rep))
    else:
        click.echo(f"{'ok' if rep['ok'] else 'NOT OK'}: {path} (step {rep['step']})")
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
    from orchestrator.sidecar import sync_recipe

    r = load_recipe(recipe, overrides)
    if not r.run.persistent_dir:
        fail("run.persistent_dir is not set in the recipe: nothing to sync to")
    result = sync_recipe(r)
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
    from orchestrator.report import write_html

    r, j = _journal_for(recipe, overrides)
    click.echo(write_html(r, j, output))


@main.command(name="install-service")
@RECIPE
@click.option("--name", help="systemd instance name (default: run.name).")
@click.option("--dry-run", is_flag=True, help="Print what would be written; write nothing.")
@click.option("--unit-dir", default="/etc/systemd/system", show_default=True)
@click.option("--etc-dir", default="/etc/orchestrator", show_default=True)
def install_service_cmd(recipe: Path, name: str | None, dry_run: bool, unit_dir: str, etc_dir: str) -> None:
    """Install RECIPE as the systemd service orchestrator@NAME."""
    from orchestrator.service import install_service

    r = load_recipe(recipe, ())
    try:
        result = install_service(recipe, name=name or r.run.name, unit_dir=unit_dir, etc_dir=etc_dir, dry_run=dry_run)
    except (ValueError, OSError) as e:
        fail(str(e))
    click.echo(result.text())


@main.command(name="build-tiny")
@click.argument("workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".demo"))
def build_tiny(workdir: Path) -> None:
    """Build the tiny MoE model, tokenizer and chat dataset locally (no network)."""
    from orchestrator import tiny

    click.echo(json.dumps(tiny.build(workdir.resolve())))
