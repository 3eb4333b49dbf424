"""A real Prometheus on loopback for tests (shared by test_alert_rules.py and test_prometheus_e2e.py)."""
from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PROMETHEUS = shutil.which("prometheus")
ALERT_RULES = Path(__file__).resolve().parents[2] / "monitoring" / "alerts.yml"  # the shipped rules, as they are
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.load(r)


def poll(pred: Callable[[], object], deadline_s: float, what: str, every: float = 0.25):
    """Call pred until it returns something truthy (errors count as not yet)."""
    end = time.monotonic() + deadline_s
    last_err: Exception | None = None
    while time.monotonic() < end:
        try:
            got = pred()
            if got:
                return got
        except (OSError, ValueError) as e:  # not listening yet / not ready
            last_err = e
        time.sleep(every)
    pytest.fail(f"timed out after {deadline_s}s waiting for {what} (last error: {last_err})")


@contextlib.contextmanager
def running_prometheus(tmp_path: Path, targets: list[str], rule_files: list[Path]) -> Iterator[str]:
    """Start prometheus on loopback scraping `targets` every 1 s; yields its base URL; always killed."""
    port = free_port()
    config = {  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": "orchestrator", "static_configs": [{"targets": targets}]}],
    }
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(json.dumps(config))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                return True  # exited: stop polling, fail below with its log
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
                return r.status == 200

        poll(ready, 30, "prometheus to become ready")
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def query(base: str, promql: str) -> list[dict]:
    data = get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    return data["data"]["result"]


def scalar(base: str, promql: str) -> float | None:
    """The value of a query that returns one sample (None when it returns none)."""
    res = query(base, promql)
    return float(res[0]["value"][1]) if res else None


def firing(base: str, alertname: str) -> list[dict]:
    alerts = get_json(f"{base}/api/v1/alerts")["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == alertname and a["state"] == "firing"]
