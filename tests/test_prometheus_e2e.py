"""A real Prometheus scrapes a real supervisor run (fake trainer, injected crashes) and the shipped
crash-loop alert fires. Loopback only; every wait is bounded; Prometheus is always killed."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from orchestrator.config.recipe import load
from orchestrator.loop.supervisor import Supervisor
from prom import ALERT_RULES, firing, free_port, needs_prometheus, poll, query, running_prometheus, scalar
from supervised import fake_recipe

FAULTS = "fla_backward_oom@30,cuda_fatal@60,nccl_error@90,oom_during_training@120"


@pytest.mark.prometheus
@needs_prometheus
def test_crash_loop_alert_fires_for_a_supervised_run(tmp_path: Path):
    port = free_port()
    target = f"127.0.0.1:{port}"
    # Long enough that the run is still going when the alert fires; stopped on request below.
    recipe = fake_recipe(tmp_path, iterations=2000, faults=FAULTS,
                         extra_env={"FAKE_STEP_S": "0.01", "FAKE_STARTUP_S": "0.3"},
                         supervisor={"max_crashes_per_hour": 3})
    sup = Supervisor(load(recipe, [f'metrics.listen="{target}"']), install_signals=False)
    # increase() needs a 0 sample before the first crash: hold the first launch (metrics are
    # already served from pre-flight) until Prometheus has scraped the zero counters.
    scraped, launch = threading.Event(), sup._launch

    def first_launch_after_baseline():
        scraped.wait(60)
        return launch()

    sup._launch = first_launch_after_baseline
    result: dict = {}

    def run():
        try:
            result["code"] = sup.run()
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    with running_prometheus(tmp_path, [target], [ALERT_RULES]) as base:
        thread.start()
        try:
            poll(lambda: query(base, f'orchestrator_crashes_total{{instance="{target}",class="cuda_fatal"}} == 0'),
                 30, "the first scrape of the zero crash counters")
            assert not firing(base, "OrchestratorCrashLoop")
            scraped.set()
            alerts = poll(lambda: firing(base, "OrchestratorCrashLoop"), 90, "OrchestratorCrashLoop to fire")
            assert alerts[0]["labels"]["instance"] == target
            assert alerts[0]["labels"]["severity"] == "critical"
            crashes = poll(lambda: scalar(base, f'sum(orchestrator_crashes_total{{instance="{target}"}}) >= 4'),
                           30, "4 crashes in orchestrator_crashes_total")
            restarts = poll(lambda: scalar(base, f'orchestrator_restarts_total{{instance="{target}"}} >= 4'),
                            30, "4 restarts in orchestrator_restarts_total")
            assert crashes >= 4 and restarts >= 4
            by_class = {r["metric"]["class"]: float(r["value"][1]) for r in
                        query(base, f'orchestrator_crashes_total{{instance="{target}"}} > 0')}
            assert by_class == {"fla_backward_oom": 1, "cuda_fatal": 1, "nccl_error": 1, "oom_during_training": 1}
        finally:
            scraped.set()
            sup.request_stop("test done")
            thread.join(60)
    assert not thread.is_alive(), "the supervisor did not stop"
    assert result.get("code") == 0, result
