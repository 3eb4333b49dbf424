"""Spot/preemptible interruption notices: is this machine about to be reclaimed?

The supervisor calls `check(now)` on every pass; a reason string means "stop the trainer with a
save and run the final sync now, within the notice window". Sources are operator-configured,
because every cloud announces it differently:

    FileNotice     a file appears (written by a cloud agent, a cron job, or an operator by hand)
    CommandNotice  a command's stdout matches a regex, e.g. curl against the metadata endpoint
                     AWS  ["curl","-sf","-m","2","http://169.254.169.254/latest/meta-data/spot/instance-action"]
                          pattern "terminate|stop|hibernate"   (404 -> no output while no notice)
                     GCP  ["curl","-sf","-m","2","-H","Metadata-Flavor: Google",
                           "http://metadata.google.internal/computeMetadata/v1/instance/preempted"]
                          pattern "^TRUE"
    NullNotice     never (on-demand machines)

Checks never raise: a failing or hanging command is logged and treated as "no notice".
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

_MAX_OUTPUT = 64 * 1024   # metadata answers are tiny; never hold a runaway command's output
_REASON_MAX = 200


class SpotNotice(Protocol):
    def check(self, now: float) -> str | None:
        """A reason string when the instance is being reclaimed, else None."""


class NullNotice:
    def check(self, now: float) -> str | None:
        return None

    def __repr__(self) -> str:
        return "NullNotice()"


class FileNotice:
    """The file's existence is the notice (removing it withdraws it: the operator's switch)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def check(self, now: float) -> str | None:
        try:
            with self.path.open("rb") as f:
                head = f.read(4096)
        except FileNotFoundError:
            return None
        except OSError as e:   # present but unreadable (a directory, permissions): still a notice
            return f"spot notice file {self.path} appeared (unreadable: {e.strerror or e})"
        first = head.decode("utf-8", "replace").strip().splitlines()[:1]
        detail = f": {first[0].strip()[:_REASON_MAX]}" if first and first[0].strip() else ""
        return f"spot notice file {self.path} appeared{detail}"

    def __repr__(self) -> str:
        return f"FileNotice({str(self.path)!r})"


class CommandNotice:
    """Runs `argv` (never through a shell) at most every `interval_s`; a regex match on its stdout
    is the notice. The exit status is ignored (curl -f exits non-zero on the usual 404). Between
    runs the last answer is returned, and a notice, once seen, is kept: a reclaim is not undone.
    """

    def __init__(self, argv: Sequence[str], pattern: str, interval_s: float = 5.0,
                 timeout_s: float | None = None) -> None:
        self.argv = list(argv)
        self.pattern = re.compile(pattern, re.MULTILINE)
        self.interval_s = interval_s
        # Bounded so a hung endpoint cannot stall the main loop (and starve the watchdog).
        self.timeout_s = timeout_s if timeout_s is not None else min(max(interval_s, 0.1), 10.0)
        self._last_run: float | None = None
        self._reason: str | None = None
        self._last_error: str | None = None
        self.runs = 0

    def check(self, now: float) -> str | None:
        if self._reason is not None:
            return self._reason
        if self._last_run is not None and 0 <= now - self._last_run < self.interval_s:  # <0: clock stepped back
            return None
        self._last_run = now
        self.runs += 1
        out = self._run()
        if out is None:
            return None
        # A match must be non-empty: a pattern like ".*" must not read an empty answer as a notice.
        m = next((m for m in self.pattern.finditer(out) if m.group(0).strip()), None)
        if m:
            line = out[out.rfind("\n", 0, m.start()) + 1:].split("\n", 1)[0].strip()
            self._reason = f"spot notice from {self.argv[0]}: {line[:_REASON_MAX]}"
            log.warning("%s", self._reason)
        return self._reason

    def _run(self) -> str | None:
        try:
            # Own session, so a timeout kills whatever a wrapper script started, too.
            p = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        except (OSError, ValueError) as e:  # not found, not executable, bad argv
            self._error(str(e))
            return None
        try:
            out, _ = p.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            p.kill()
            p.wait()
            p.stdout.close()
            self._error(f"timed out after {self.timeout_s:g}s")
            return None
        self._last_error = None
        return out[:_MAX_OUTPUT].decode("utf-8", "replace")

    def _error(self, what: str) -> None:
        # Once per distinct problem: a command failing every 5 s must not flood the journal.
        if what != self._last_error:
            log.warning("spot notice command %s: %s", self.argv, what)
            self._last_error = what

    def __repr__(self) -> str:
        return f"CommandNotice({self.argv!r}, {self.pattern.pattern!r}, interval_s={self.interval_s:g})"


class AnyNotice:
    """Several sources at once: the first that reports a notice wins."""

    def __init__(self, sources: Sequence[SpotNotice]) -> None:
        self.sources = list(sources)

    def check(self, now: float) -> str | None:
        for s in self.sources:
            reason = s.check(now)
            if reason:
                return reason
        return None

    def __repr__(self) -> str:
        return f"AnyNotice({self.sources!r})"


def from_config(kind: str, file: str | None = None, command: Sequence[str] | None = None,
                pattern: str | None = None, interval_s: float = 5.0, *,
                timeout_s: float | None = None) -> SpotNotice:
    """Build a notice source. kind: "none", "file", "command", or "auto" (whatever of file and
    command is given; both -> either fires; neither -> none). Raises ValueError on bad settings."""
    kind = (kind or "none").strip().lower()
    if kind not in ("none", "file", "command", "auto"):
        raise ValueError(f"spot notice kind must be none, file, command or auto, got {kind!r}")
    if kind == "auto":
        sources: list[SpotNotice] = []
        if file:
            sources.append(from_config("file", file=file))
        if command:
            sources.append(from_config("command", command=command, pattern=pattern,
                                       interval_s=interval_s, timeout_s=timeout_s))
        return sources[0] if len(sources) == 1 else AnyNotice(sources) if sources else NullNotice()
    if kind == "none":
        return NullNotice()
    if kind == "file":
        if not file:
            raise ValueError("spot notice kind 'file' needs a file path")
        return FileNotice(file)
    if isinstance(command, str) or not command or not all(isinstance(a, str) and a for a in command):
        raise ValueError("spot notice kind 'command' needs the command as a list of arguments, "
                         "e.g. [\"curl\", \"-sf\", URL] (it is never run through a shell)")
    if not pattern:
        raise ValueError("spot notice kind 'command' needs a pattern (a regular expression on its output)")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"spot notice pattern {pattern!r} is not a valid regular expression ({e})") from None
    if not interval_s > 0 or (timeout_s is not None and not timeout_s > 0):
        raise ValueError("spot notice interval_s and timeout_s must be > 0")
    return CommandNotice(command, pattern, interval_s, timeout_s)


def from_recipe(section: object) -> SpotNotice:
    """From the recipe's [supervisor] table: spot_notice_file, spot_notice_command (argv list),
    spot_notice_pattern, and optionally spot_notice_interval_s / spot_notice_timeout_s.
    Either or both sources may be set; none -> NullNotice."""
    return from_config("auto", file=getattr(section, "spot_notice_file", None),
                       command=getattr(section, "spot_notice_command", None),
                       pattern=getattr(section, "spot_notice_pattern", None),
                       interval_s=getattr(section, "spot_notice_interval_s", None) or 5.0,
                       timeout_s=getattr(section, "spot_notice_timeout_s", None))
