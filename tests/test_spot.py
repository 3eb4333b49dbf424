"""Spot interruption notice sources: real files and real commands, an injected clock."""
from __future__ import annotations

import logging
import sys
import time

import pytest

from orchestrator.host.spot import AnyNotice, CommandNotice, FileNotice, NullNotice, from_config, from_recipe

PY = sys.executable


def py(code: str) -> list[str]:
    return [PY, "-c", code]


def test_null_notice():
    assert NullNotice().check(0.0) is None


def test_file_notice_appears(tmp_path):
    path = tmp_path / "spot-notice"
    n = FileNotice(path)
    assert n.check(0.0) is None
    path.write_text("terminate at 2025-01-01T00:02:00Z\nsecond line\n")
    reason = n.check(1.0)
    assert reason and str(path) in reason and "terminate at 2025-01-01T00:02:00Z" in reason
    assert "second line" not in reason
    path.unlink()                               # the operator withdraws a manual notice
    assert n.check(2.0) is None


def test_file_notice_empty_or_unreadable(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("")
    assert FileNotice(empty).check(0.0) == f"spot notice file {empty} appeared"
    d = tmp_path / "a-directory"
    d.mkdir()
    assert "appeared (unreadable" in FileNotice(d).check(0.0)


def test_command_notice_matches(tmp_path):
    n = CommandNotice(py('print("{\\"action\\": \\"terminate\\", \\"time\\": \\"12:00\\"}")'),
                      "terminate|stop", interval_s=5)
    reason = n.check(0.0)
    assert reason and '"action": "terminate"' in reason


def test_command_notice_no_match_and_nonzero_exit():
    assert CommandNotice(py('print("FALSE")'), "^TRUE", interval_s=5).check(0.0) is None
    # curl -f on a 404: no output, exit 22 -> no notice; exit status alone is never a notice
    assert CommandNotice(py("import sys; sys.exit(22)"), ".*", interval_s=5).check(0.0) is None
    # a match still counts when the command exits non-zero
    assert CommandNotice(py('print("TRUE"); raise SystemExit(1)'), "^TRUE", interval_s=5).check(0.0)


def test_command_is_not_run_through_a_shell(tmp_path):
    marker = tmp_path / "pwned"
    n = CommandNotice(["echo", f"hello; touch {marker}"], "touch", interval_s=1)
    assert "hello; touch" in n.check(0.0)    # the literal argument, echoed back
    assert not marker.exists()


def test_command_failures_do_not_raise(tmp_path, caplog):
    missing = CommandNotice([str(tmp_path / "no-such-binary")], "x", interval_s=1)
    with caplog.at_level(logging.WARNING, logger="orchestrator.host.spot"):
        assert missing.check(0.0) is None
        assert missing.check(10.0) is None
    assert len([r for r in caplog.records if "no-such-binary" in r.getMessage()]) == 1  # warned once
    not_exec = tmp_path / "plain-file"
    not_exec.write_text("")
    assert CommandNotice([str(not_exec)], "x", interval_s=1).check(0.0) is None


def test_command_timeout_does_not_raise_or_hang(tmp_path):
    # A wrapper whose child keeps the pipe open: the timeout must kill both and return promptly.
    pidfile = tmp_path / "child.pid"
    script = ("import subprocess, sys, time;"
              f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']);"
              f"open({str(pidfile)!r}, 'w').write(str(c.pid));"
              "print('terminate', flush=True); time.sleep(30)")
    n = CommandNotice(py(script), "nomatch", interval_s=1, timeout_s=1.5)
    t0 = time.monotonic()
    assert n.check(0.0) is None
    assert time.monotonic() - t0 < 6
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and alive(child):
        time.sleep(0.05)
    if alive(child):
        pytest.fail("the command's child survived the timeout")


def alive(pid: int) -> bool:
    # A killed orphan stays a zombie until its new parent reaps it (maybe never, in a container).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_interval_respected_with_injected_clock(tmp_path):
    counter = tmp_path / "runs"
    flag = tmp_path / "reclaim"
    code = (f"import os; open({str(counter)!r}, 'a').write('x');"
            f"print('preempted' if os.path.exists({str(flag)!r}) else 'ok')")
    n = CommandNotice(py(code), "preempted", interval_s=30)
    runs = lambda: len(counter.read_text()) if counter.exists() else 0  # noqa: E731
    assert n.check(100.0) is None and runs() == 1
    assert n.check(110.0) is None and runs() == 1      # within the interval: not run again
    assert n.check(129.9) is None and runs() == 1
    flag.write_text("")
    assert n.check(129.9) is None and runs() == 1      # the notice waits for the next poll
    reason = n.check(130.0)
    assert reason and "preempted" in reason and runs() == 2
    flag.unlink()
    assert n.check(200.0) == reason and runs() == 2    # latched: a reclaim is not undone
    assert n.runs == 2


def test_interval_survives_a_clock_step_back(tmp_path):
    n = CommandNotice(py('print("ok")'), "preempted", interval_s=30)
    assert n.check(1_000.0) is None and n.runs == 1
    assert n.check(10.0) is None and n.runs == 2       # wall clock stepped back: poll, don't go blind


def test_any_notice():
    class Fixed:
        def __init__(self, r):
            self.r = r

        def check(self, now):
            return self.r

    assert AnyNotice([Fixed(None), Fixed(None)]).check(0) is None
    assert AnyNotice([Fixed(None), Fixed("b"), Fixed("c")]).check(0) == "b"


def test_from_config(tmp_path):
    assert isinstance(from_config("none"), NullNotice)
    assert isinstance(from_config(""), NullNotice)
    f = from_config("file", file=str(tmp_path / "x"))
    assert isinstance(f, FileNotice) and f.path == tmp_path / "x"
    c = from_config("command", command=["curl", "-sf", "http://169.254.169.254/"], pattern="terminate",
                    interval_s=7)
    assert isinstance(c, CommandNotice) and c.interval_s == 7 and c.timeout_s == 7
    assert from_config("command", command=["x"], pattern="y", interval_s=60).timeout_s == 10
    assert from_config("command", command=["x"], pattern="y", interval_s=60, timeout_s=3).timeout_s == 3
    assert isinstance(from_config("auto"), NullNotice)
    assert isinstance(from_config("auto", file="/x"), FileNotice)
    assert isinstance(from_config("auto", command=["x"], pattern="y"), CommandNotice)
    both = from_config("AUTO", file="/x", command=["x"], pattern="y")
    assert isinstance(both, AnyNotice) and len(both.sources) == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="cloud"), "kind must be"),
    (dict(kind="file"), "needs a file"),
    (dict(kind="command", pattern="x"), "list of arguments"),
    (dict(kind="command", command="curl -s http://x", pattern="x"), "never run through a shell"),
    (dict(kind="command", command=["curl", ""], pattern="x"), "list of arguments"),
    (dict(kind="command", command=["curl"]), "needs a pattern"),
    (dict(kind="command", command=["curl"], pattern="(unclosed"), "not a valid regular expression"),
    (dict(kind="command", command=["curl"], pattern="x", interval_s=0), "must be > 0"),
    (dict(kind="command", command=["curl"], pattern="x", timeout_s=-1), "must be > 0"),
])
def test_from_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        from_config(**kwargs)


def test_from_recipe_section(tmp_path):
    from types import SimpleNamespace as NS
    assert isinstance(from_recipe(NS(spot_notice_file=None, spot_notice_command=None,
                                     spot_notice_pattern="terminat")), NullNotice)
    f = from_recipe(NS(spot_notice_file=str(tmp_path / "n"), spot_notice_command=None, spot_notice_pattern="x"))
    assert isinstance(f, FileNotice)
    c = from_recipe(NS(spot_notice_file=None, spot_notice_command=["curl", "-sf", "http://x"],
                       spot_notice_pattern="terminat|reclaim", spot_notice_interval_s=15))
    assert isinstance(c, CommandNotice) and c.interval_s == 15 and c.pattern.pattern == "terminat|reclaim"
    assert isinstance(from_recipe(NS()), NullNotice)


def test_from_recipe_with_the_real_recipe_model():
    recipe = pytest.importorskip("orchestrator.config.recipe")
    s = recipe.SupervisorSection(spot_notice_command=["curl", "-sf", "http://169.254.169.254/"])
    n = from_recipe(s)
    assert isinstance(n, CommandNotice) and n.pattern.search("instance-action: terminate")
    assert isinstance(from_recipe(recipe.SupervisorSection()), NullNotice)
