"""Normal supervised runs raise no health finding: a real supervisor runs the fake trainer through crashes and
resumes, and its logging.jsonl is fed to HealthWatch attempt by attempt as the loop will feed it (redone
steps, resume windows, the loss and grad-norm detectors)."""
from __future__ import annotations

import pytest
from supervised import fake_recipe, journal, supervise

from orchestrator.config.schema import HealthSection
from orchestrator.domain import progress
from orchestrator.domain.health.watch import HealthWatch


@pytest.mark.parametrize("faults", ["fla_backward_oom@15,cuda_fatal@27,nccl_error@33", "host_oom_killed@12"])
def test_a_supervised_run_with_crashes_and_resumes_raises_nothing(tmp_path, faults):
    code, _ = supervise(fake_recipe(tmp_path, faults=faults, iterations=60))
    assert code == 0
    j = journal(tmp_path / "out")
    try:
        attempts = j.attempts()
    finally:
        j.close()
    records = [p for p in map(progress.parse_jsonl_line, (tmp_path / "out" / "logging.jsonl").read_text()
                                                          .splitlines()) if p is not None]
    watch = HealthWatch(HealthSection())
    watch.attempt(None)
    found, previous, n = [], None, 0
    for p in records:
        if previous is not None and p.step <= previous:  # the next attempt's first record
            n += 1
            watch.attempt(attempts[n].start_step)
        previous = p.step
        found += watch.observe(p)
    assert n == len(attempts) - 1 >= 1, "every resume was seen"
    assert found == []
