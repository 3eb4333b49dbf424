"""The supervisor on the in-memory host (fake_host.py): a recipe's base sections, and drivers for the
state machine's table tests. The `world` fixture (conftest.py) makes supervisors from them."""
from __future__ import annotations

import sys

from fake_host import FakeHost
from orchestrator.config.recipe import load
from orchestrator.host.journal import Journal, journal_path
from orchestrator.loop.supervisor import Supervisor
from orchestrator.store.rundir import state_dir
from orchestrator.types import State

MAX = 10


OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB"


BASE = {
    "run": {"entrypoint": [sys.executable]},
    "optim": {"iterations": MAX},
    "supervisor": {"wait_s": 90, "force_wait_s": 120, "nccl_settle_s": 30, "hang_timeout_s": 600,
                   "startup_timeout_s": 1800, "min_free_gib": 0.01, "poll_s": 0.5, "port_range": [29500, 29509]},
    "metrics": {"enabled": False},
}


def drive(sup: Supervisor, until: State, limit: int = 20) -> State:
    for _ in range(limit):
        if sup.state is until:
            return sup.state
        sup.step()
    raise AssertionError(f"never reached {until.value}; stuck in {sup.state.value}")


def running(sup: Supervisor, host: FakeHost):
    drive(sup, State.RUNNING)
    return host.trainers[-1]


def crashed(sup: Supervisor, host: FakeHost, *lines: str, code: int = 1, at_step: int = 5):
    """A trainer that trained to `at_step`, printed `lines` and exited with `code`: one RUNNING pass."""
    t = running(sup, host)
    if at_step:
        t.steps(1, at_step, MAX)
    t.write(*lines)
    t.exit(code=code)
    assert sup.step() is State.CRASHED
    return t


def journal(sup: Supervisor) -> Journal:
    return Journal(journal_path(state_dir(sup.ctx.out)), readonly=True)


def supervisors(write_recipe):
    """Yields make(**sections) -> (Supervisor, FakeHost); shuts every one down afterwards, as the process exit
    would (the lock and the journal released)."""
    made = []

    def make(**sections) -> tuple[Supervisor, FakeHost]:
        over = {k: {**BASE.get(k, {}), **sections.get(k, {})} for k in {*BASE, *sections}}
        host = FakeHost()
        sup = Supervisor(load(write_recipe(**over)), host=host, install_signals=False)
        made.append(sup)
        return sup, host

    yield make
    for sup in made:
        sup.shutdown()
