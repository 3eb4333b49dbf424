"""`orchestrator install-service`: render the systemd units and install one run as a service.

The unit templates live here (a wheel has no systemd/ folder); systemd/ in the repository holds
them rendered with the default paths, and tests/test_service.py keeps the two identical.
One template unit serves every run: the instance name selects /etc/orchestrator/<name>.toml.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_EXE = "/opt/orchestrator/venv/bin/orchestrator"
DEFAULT_ETC_DIR = "/etc/orchestrator"
DEFAULT_UNIT_DIR = "/etc/systemd/system"
NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")

_HEADER = """\
# Rendered by `orchestrator install-service` from orchestrator/ops/service.py (systemd/ in the repo
# holds the default rendering). ExecStart= is the orchestrator of the venv that ran it
# (default {default_exe}).
# Recipe: {etc}/NAME.toml; environment: {etc}/NAME.env. See runbooks/operations.md.
"""

SERVICE_TEMPLATE = _HEADER + """\
#   systemctl enable --now orchestrator@NAME ; journalctl -u orchestrator@NAME -f

[Unit]
Description=orchestrator training supervisor for run %i
Wants=network-online.target
# Ordering only (no dependency): start after the driver helpers when the node has them.
After=network-online.target nvidia-persistenced.service nvidia-fabricmanager.service
# Trainer crashes are handled inside the supervisor and do not count here; five exits of the
# supervisor itself within an hour mean it is broken: stop and leave the unit failed.
StartLimitIntervalSec=3600
StartLimitBurst=5

[Service]
Type=notify
NotifyAccess=main
# The main loop sends WATCHDOG=1 from its passes (every WatchdogSec/2 at most); deliberate waits
# keep pinging. A loop stuck for WatchdogSec gets SIGABRT: PYTHONFAULTHANDLER prints every
# thread's stack to the journal, the trainer left in the cgroup is killed and Restart= starts a
# fresh supervisor, which resumes. 5 min: a blocking step (terminate grace + stack dump) must fit
# in WatchdogSec/2, and minutes of detection cost nothing against a multi-day run.
WatchdogSec=300
TimeoutAbortSec=120
# READY=1 is sent once the recipe is loaded; a long restore asks for more (EXTEND_TIMEOUT_USEC).
TimeoutStartSec=30min
ExecStart={exec_start} run {etc}/%i.toml
WorkingDirectory=/var/lib/orchestrator
StateDirectory=orchestrator
EnvironmentFile=-{etc}/%i.env
Environment=PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# Exit codes: 0 complete (or stopped on request), 2 bad input, 3 gave up. Restarting cannot fix
# 2 or 3, and 0 is listed so a completed run is not launched again by Restart=always.
Restart=always
RestartSec=90
RestartPreventExitStatus=0 2 3
SuccessExitStatus=0
# Stop: SIGTERM to the supervisor only; it stops the trainer (SIGTERM, grace_s, SIGKILL), runs the
# final sync and exits 0. Whatever is left in the cgroup then (or after TimeoutStopSec) gets SIGKILL.
KillMode=mixed
KillSignal=SIGTERM
TimeoutStopSec=900
# A kernel OOM kill of one trainer process is a crash the supervisor classifies and recovers
# from (host_oom_killed); systemd's default OOMPolicy=stop would stop the whole unit instead.
OOMPolicy=continue
# 8 ranks x (threads + dataloader workers) can exceed the default per-unit task limit.
TasksMax=infinity
LimitNOFILE=1048576
# NCCL and GPUDirect pin host memory.
LimitMEMLOCK=infinity
# Core dumps of processes mapping hundreds of GiB would fill the disk checkpoints need.
LimitCORE=0
StandardOutput=journal
StandardError=journal
SyslogIdentifier=orchestrator-%i
# Deliberately NO sandboxing: PrivateDevices= and DevicePolicy=closed hide /dev/nvidia*;
# ProtectKernelTunables=/ProtectKernelModules= break the driver's /proc and module loading;
# MemoryDenyWriteExecute= breaks CUDA/Triton JIT; ProtectSystem=strict and PrivateTmp= break the
# output, cache and /dev/shm paths the trainer writes. Runs as root (GPU cleanup may have to kill
# other users' processes); set User= in a drop-in if your node allows it.

[Install]
WantedBy=multi-user.target
"""

SYNC_SERVICE_TEMPLATE = _HEADER + """\
# Optional: publish verified checkpoints to persistent storage from outside the supervisor.
# Started by orchestrator-sync@NAME.timer.

[Unit]
Description=orchestrator checkpoint sync for run %i
Wants=network-online.target
After=network-online.target

[Service]
Type=oneshot
ExecStart={exec_start} sync {etc}/%i.toml --once
EnvironmentFile=-{etc}/%i.env
Environment=PYTHONUNBUFFERED=1
# Copying checkpoints must not slow the training it protects.
Nice=10
IOSchedulingClass=idle
StandardOutput=journal
StandardError=journal
SyslogIdentifier=orchestrator-sync-%i
"""

SYNC_TIMER_TEMPLATE = _HEADER + """\
# Optional: runs orchestrator-sync@NAME.service 5 minutes after the timer starts, then 5 minutes
# after each sync started (at once after a longer one); never two syncs at the same time.

[Unit]
Description=periodic orchestrator checkpoint sync for run %i

[Timer]
OnActiveSec=5min
OnUnitActiveSec=5min

[Install]
WantedBy=timers.target
"""

TEMPLATES = {
    "orchestrator@.service": SERVICE_TEMPLATE,
    "orchestrator-sync@.service": SYNC_SERVICE_TEMPLATE,
    "orchestrator-sync@.timer": SYNC_TIMER_TEMPLATE,
}

ENV_TEMPLATE = """\
# Environment of orchestrator@{name} (systemd EnvironmentFile=: KEY=VALUE per line, no shell
# expansion). Read at each start: `systemctl restart orchestrator@{name}` after editing.
# The trainer inherits it; training settings belong in the recipe's [env] vars instead.
PYTHONUNBUFFERED=1
# CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7
# HF_HUB_OFFLINE=1
# HF_HOME=/data/hf-cache
# TMPDIR=/data/tmp
# NCCL_DEBUG=WARN
"""

# Recipe keys holding paths, which `recipe.load` resolves relative to the recipe file: a copy in
# etc_dir would silently resolve them against etc_dir instead.
_PATH_KEYS = (("run", "output_dir"), ("run", "persistent_dir"), ("model", "path"))
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./+@:=,-]+")


class InstallError(ValueError):
    """Bad input for install-service (exit code 2): a clear message, nothing written."""


@dataclass(frozen=True)
class InstallResult:
    name: str
    unit: str                                      # orchestrator@NAME.service
    files: list[tuple[str, str]]                   # (path, content) written (or, dry run, to write)
    commands: list[str]                            # what the operator runs next
    notes: list[str] = field(default_factory=list)
    dry_run: bool = False

    def text(self) -> str:
        verb = "would write" if self.dry_run else "wrote"
        out = []
        for path, content in self.files:
            out.append(f"# {verb} {path}")
            if self.dry_run:
                out.append(content.rstrip("\n"))
        out += [f"# note: {n}" for n in self.notes]
        out.append("# next:" if not self.dry_run else "# then run:")
        out += self.commands
        return "\n".join(out) + "\n"


def validate_name(name: str) -> str:
    if not NAME_RE.fullmatch(name or "") or name.startswith(".") or len(name) > 200:
        raise InstallError(f"invalid service instance name {name!r}: use letters, digits, '_', '.' "
                           f"and '-' (not starting with '.'), e.g. --name qwen3-235b-lora")
    return name


def default_exe() -> list[str]:
    """The orchestrator that is running now: the venv's console script, else `python -m orchestrator`."""
    # Not resolved: a venv's python is a symlink and resolving it would leave the venv.
    sibling = Path(os.path.abspath(sys.executable)).parent / "orchestrator"
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return [str(sibling)]
    found = shutil.which("orchestrator")
    if found:
        return [os.path.abspath(found)]
    return [os.path.abspath(sys.executable), "-m", "orchestrator"]


def _exec_word(word: str, *, command: bool = False) -> str:
    """One ExecStart= word: % escaped, quoted when it has spaces or quotes; $ escaped in the
    arguments only (systemd expands $VARS there, not in the command path)."""
    if "\n" in word or "\0" in word:
        raise InstallError(f"unsupported character in {word!r}")
    esc = word.replace("%", "%%") if command else word.replace("%", "%%").replace("$", "$$")
    if _PLAIN_WORD.fullmatch(word):
        return esc
    return '"' + esc.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _exec_start(exe: str | Sequence[str]) -> str:
    words = [exe] if isinstance(exe, str) else list(exe)
    if not words or not os.path.isabs(words[0]):
        raise InstallError(f"the orchestrator executable must be an absolute path, got {words[:1]}")
    return " ".join(_exec_word(w, command=i == 0) for i, w in enumerate(words))


def _check_etc_dir(etc_dir: str) -> str:
    if not os.path.isabs(etc_dir) or not _PLAIN_WORD.fullmatch(etc_dir):
        raise InstallError(f"--etc-dir must be an absolute path of letters, digits and _./+@:=,- "
                           f"(it is written into the unit unquoted), got {etc_dir!r}")
    return etc_dir.rstrip("/") or "/"


def render_unit(template: str = "orchestrator@.service", *, exe: str | Sequence[str] = DEFAULT_EXE,
                etc_dir: str = DEFAULT_ETC_DIR) -> str:
    """One unit file (a key of TEMPLATES) with the real executable and config directory."""
    try:
        text = TEMPLATES[template]
    except KeyError:
        raise InstallError(f"no unit template {template!r}; known: {', '.join(TEMPLATES)}") from None
    return text.format(exec_start=_exec_start(exe), etc=_check_etc_dir(etc_dir), default_exe=DEFAULT_EXE)


def _relative_paths(data: dict) -> list[str]:
    keys = [f"{s}.{k}" for s, k in _PATH_KEYS
            if isinstance(v := data.get(s, {}).get(k), str) and v and not os.path.isabs(v)]
    for key in ("dataset", "val_dataset"):
        for d in data.get("data", {}).get(key, []) or []:
            if isinstance(d, str) and (d.startswith(".") or d.endswith((".json", ".jsonl", ".csv"))) \
                    and not os.path.isabs(d):
                keys.append(f"data.{key} ({d})")
    return keys


def install_service(recipe_path: str | os.PathLike, *, name: str | None = None,
                    unit_dir: str = DEFAULT_UNIT_DIR, etc_dir: str = DEFAULT_ETC_DIR,
                    exe: str | Sequence[str] | None = None, dry_run: bool = False,
                    sync_timer: bool = False) -> InstallResult:
    """Write the unit template, a copy of the recipe as etc_dir/NAME.toml and etc_dir/NAME.env.

    The name defaults to the recipe's run.name, else the file name. The recipe is copied, not
    linked, so edits to the original do not reach the service until installed again (the old
    copy is kept as NAME.toml.bak-<time>). An existing .env file is never overwritten: the
    operator owns it. Raises InstallError for bad input; nothing is written in a dry run.
    """
    src = Path(recipe_path)
    try:
        recipe_text = src.read_text(encoding="utf-8")
        data = tomllib.loads(recipe_text)
    except OSError as e:
        raise InstallError(f"{src}: cannot read the recipe ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise InstallError(f"{src}: TOML syntax error: {e}") from None
    if name is None:
        run_name = data.get("run", {}).get("name")
        name = run_name if isinstance(run_name, str) and NAME_RE.fullmatch(run_name) else src.stem
    validate_name(name)
    relative = _relative_paths(data)
    if relative:
        raise InstallError(f"{src}: relative paths would resolve against {etc_dir} once installed: "
                           f"{', '.join(relative)}; make them absolute")
    etc = _check_etc_dir(etc_dir)
    exe_words = default_exe() if exe is None else exe
    templates = list(TEMPLATES) if sync_timer else ["orchestrator@.service"]

    files: list[tuple[str, str]] = []   # the recipe first: a unit without its recipe is useless
    notes: list[str] = []
    recipe_dest = os.path.join(etc, f"{name}.toml")
    backup = None
    if os.path.exists(recipe_dest):
        if Path(recipe_dest).read_bytes() == recipe_text.encode("utf-8"):
            notes.append(f"{recipe_dest} is already this recipe")
        else:
            backup = f"{recipe_dest}.bak-{time.strftime('%Y%m%d-%H%M%S')}"
            notes.append(f"{recipe_dest} differs and is replaced (previous copy kept as {backup}); "
                         f"a running service sees the change at its next start (recipe drift policy applies)")
            files.append((recipe_dest, recipe_text))
    else:
        files.append((recipe_dest, recipe_text))
    env_dest = os.path.join(etc, f"{name}.env")
    if os.path.exists(env_dest):
        notes.append(f"{env_dest} exists and is kept")
    else:
        files.append((env_dest, ENV_TEMPLATE.format(name=name)))
    files += [(os.path.join(unit_dir, t), render_unit(t, exe=exe_words, etc_dir=etc)) for t in templates]

    unit = f"orchestrator@{name}.service"
    commands = ["systemctl daemon-reload", f"systemctl enable --now {unit}"]
    if sync_timer:
        commands.append(f"systemctl enable --now orchestrator-sync@{name}.timer")
    commands.append(f"journalctl -u {unit} -f")
    result = InstallResult(name, unit, files, commands, notes, dry_run)
    if dry_run:
        return result
    try:
        if backup:
            shutil.copy2(recipe_dest, backup)
        for path, content in files:
            _write_atomic(path, content, mode=0o600 if path == env_dest else 0o644)
    except OSError as e:
        raise InstallError(f"cannot write {e.filename or ''}: {e.strerror or e} "
                           f"(run as root, or see --dry-run / --unit-dir / --etc-dir)") from None
    return result


def _write_atomic(path: str, content: str, mode: int) -> None:
    # Write-then-rename: systemd (or a starting service) never reads a half-written file.
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(content)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
