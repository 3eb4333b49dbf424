"""Metrics: exact exposed names, pre-created labels, and what each supervisor call changes."""
from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.domain.goodput import LOST_CAUSES
from orchestrator.domain.health.kinds import KINDS
from orchestrator.host.metrics import RAISED_BY_SUPERVISOR, Metrics, parse_listen
from orchestrator.types import Alert, CrashClass, GpuInfo, GpuSnapshot, HealthKind, Progress, State

REQUIRED = {
    "orchestrator_crashes_total", "orchestrator_restarts_total", "orchestrator_training_step",
    "orchestrator_training_max_steps", "orchestrator_loss", "orchestrator_grad_norm",
    "orchestrator_learning_rate", "orchestrator_step_seconds", "orchestrator_checkpoint_age_seconds",
    "orchestrator_last_checkpoint_step", "orchestrator_checkpoint_invalid_total",
    "orchestrator_sync_lag_seconds", "orchestrator_sync_bytes_total", "orchestrator_state",
    "orchestrator_gpu_memory_used_bytes", "orchestrator_goodput_ratio", "orchestrator_lost_seconds_total",
    "orchestrator_info", "orchestrator_max_crashes_per_hour",
}


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def m(clock: Clock) -> Metrics:
    return Metrics(started_at=1000.0, clock=clock)


def val(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def sample_names(m: Metrics) -> set[str]:
    fams = text_string_to_metric_families(m.exposition().decode())
    return {s.name for f in fams for s in f.samples}


def test_exposes_the_required_names(m: Metrics):
    m.set_info("run", "abc", "megatron", "Qwen3-235B-A22B")
    m.gpu_memory(GpuSnapshot(gpus=(GpuInfo(0, "H200", 10, 1),)))
    assert REQUIRED <= sample_names(m)


def test_every_metric_has_help_and_no_global_registry_use(m: Metrics):
    fams = list(text_string_to_metric_families(m.exposition().decode()))
    assert fams
    for f in fams:
        assert f.documentation.strip(), f.name
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("orchestrator_")]
    Metrics()  # a second instance does not collide (own registry)


def test_state_is_one_hot_with_all_labels_precreated(m: Metrics):
    assert {s.value: val(m, "orchestrator_state", state=s.value) for s in State} == dict.fromkeys(
        (s.value for s in State), 0.0)
    m.set_state(State.RUNNING)
    m.set_state(State.VERIFYING)
    values = {s: val(m, "orchestrator_state", state=s.value) for s in State}
    assert values.pop(State.VERIFYING) == 1.0
    assert set(values.values()) == {0.0}


def test_crashes_precreated_at_zero_and_counted(m: Metrics):
    for c in CrashClass:
        assert val(m, "orchestrator_crashes_total", **{"class": c.value}) == 0.0
    m.crash(CrashClass.NCCL_ERROR)
    m.crash(CrashClass.NCCL_ERROR)
    m.crash("disk_full")  # a StrEnum value read back from the journal
    assert val(m, "orchestrator_crashes_total", **{"class": "nccl_error"}) == 2.0
    assert val(m, "orchestrator_crashes_total", **{"class": "disk_full"}) == 1.0
    with pytest.raises(ValueError):
        m.crash("not_a_class")


def test_restart_counter(m: Metrics):
    m.restart()
    assert val(m, "orchestrator_restarts_total") == 1.0


def test_progress_sets_gauges_and_partial_records_keep_the_rest(m: Metrics, clock: Clock):
    m.observe_progress(Progress(step=10, max_steps=1000, loss=1.5, grad_norm=0.7, lr=1e-4, step_s=12.5))
    clock.t = 1060.0
    m.observe_progress(Progress(step=11, loss=1.4))
    assert val(m, "orchestrator_training_step") == 11
    assert val(m, "orchestrator_training_max_steps") == 1000
    assert val(m, "orchestrator_loss") == 1.4
    assert val(m, "orchestrator_grad_norm") == 0.7
    assert val(m, "orchestrator_learning_rate") == 1e-4
    assert val(m, "orchestrator_step_seconds") == 12.5
    assert val(m, "orchestrator_last_progress_timestamp_seconds") == 1060.0


def test_a_restarted_supervisor_gets_a_fresh_grace_period(clock: Clock):
    clock.t = 90_000.0
    m = Metrics(started_at=1000.0, clock=clock)  # the run began long before this supervisor
    assert val(m, "orchestrator_last_progress_timestamp_seconds") == 90_000.0
    assert val(m, "orchestrator_supervisor_heartbeat_timestamp_seconds") == 90_000.0
    assert val(m, "orchestrator_checkpoint_age_seconds") == 89_000.0
    m.set_state("running")
    assert val(m, "orchestrator_state", state="running") == 1.0


def test_progress_timestamp_moves_only_when_the_step_advances(m: Metrics, clock: Clock):
    assert val(m, "orchestrator_last_progress_timestamp_seconds") == 1000.0  # supervisor start
    m.observe_progress(Progress(step=5))
    clock.t = 2000.0
    m.observe_progress(Progress(step=5, loss=1.0))  # the same step from logging.jsonl
    assert val(m, "orchestrator_last_progress_timestamp_seconds") == 1000.0


@pytest.mark.parametrize("loss,grad_norm,counted", [
    (float("nan"), None, 1), (None, float("inf"), 1), (1.0, 2.0, 0), (None, None, 0),
])
def test_non_finite_steps_are_counted_once_per_step(m: Metrics, loss, grad_norm, counted):
    m.observe_progress(Progress(step=7, loss=loss, grad_norm=grad_norm))
    m.observe_progress(Progress(step=7, loss=loss, grad_norm=grad_norm))  # stdout + jsonl
    assert val(m, "orchestrator_nan_total") == counted


def test_nan_loss_is_exposed_as_nan(m: Metrics):
    m.observe_progress(Progress(step=1, loss=float("nan")))
    assert math.isnan(val(m, "orchestrator_loss"))


def test_resume_checks_have_counters_of_their_own(m: Metrics):
    """The loss check and the step check count apart (the nan_or_divergence alert reads both)."""
    m.health_event("resume_divergence")
    assert val(m, "orchestrator_resume_divergence_total") == 1.0
    assert val(m, "orchestrator_resumed_at_wrong_step_total") == 0.0
    m.health_event("resumed_at_wrong_step")
    assert val(m, "orchestrator_resume_divergence_total") == 1.0
    assert val(m, "orchestrator_resumed_at_wrong_step_total") == 1.0


def test_checkpoint_age_from_run_start_then_from_last_checkpoint(m: Metrics):
    m.tick(1500.0)
    assert val(m, "orchestrator_checkpoint_age_seconds") == 500.0
    m.checkpoint_saved(100, at=1600.0)
    m.checkpoint_saved(50, at=1200.0)  # an older one found later does not win
    m.tick(1700.0)
    assert val(m, "orchestrator_checkpoint_age_seconds") == 100.0
    assert val(m, "orchestrator_last_checkpoint_step") == 100
    m.tick(1500.0)  # clock stepped back: never negative
    assert val(m, "orchestrator_checkpoint_age_seconds") == 0.0


def test_checkpoint_invalid_counter(m: Metrics):
    m.checkpoint_invalid()
    assert val(m, "orchestrator_checkpoint_invalid_total") == 1.0


def test_heartbeat_follows_tick(m: Metrics):
    assert val(m, "orchestrator_supervisor_heartbeat_timestamp_seconds") == 1000.0
    m.tick(1234.0)
    assert val(m, "orchestrator_supervisor_heartbeat_timestamp_seconds") == 1234.0


def test_sync_bytes_and_reported_lag(m: Metrics):
    m.sync_done(1000, 30.0)
    m.sync_done(500, 12.0)
    assert val(m, "orchestrator_sync_bytes_total") == 1500
    assert val(m, "orchestrator_sync_lag_seconds") == 12.0
    m.checkpoint_saved(10, at=1100.0)
    m.tick(5000.0)  # sync not enabled: a checkpoint alone does not make a lag
    assert val(m, "orchestrator_sync_lag_seconds") == 12.0


def test_sync_lag_grows_while_a_checkpoint_waits_for_sync(clock: Clock):
    m = Metrics(started_at=1000.0, clock=clock, sync_enabled=True)
    m.checkpoint_saved(10, at=1100.0)
    m.tick(1400.0)
    assert val(m, "orchestrator_sync_lag_seconds") == 300.0
    m.checkpoint_saved(20, at=1300.0)  # the oldest unsynced checkpoint sets the lag
    m.tick(3100.0)
    assert val(m, "orchestrator_sync_lag_seconds") == 2000.0
    m.sync_done(10, 5.0)
    m.tick(3200.0)
    assert val(m, "orchestrator_sync_lag_seconds") == 5.0


def test_gpu_memory_per_gpu_and_dropped_on_error(m: Metrics):
    snap = GpuSnapshot(gpus=tuple(GpuInfo(i, "H200", 140 << 30, i << 30) for i in range(8)))
    m.gpu_memory(snap)
    assert val(m, "orchestrator_gpu_memory_used_bytes", gpu="3") == 3 << 30
    assert val(m, "orchestrator_gpu_memory_total_bytes", gpu="7") == 140 << 30
    m.gpu_memory(GpuSnapshot(error="NVML_ERROR_DRIVER_NOT_LOADED"))
    assert val(m, "orchestrator_gpu_memory_used_bytes", gpu="3") is None


def test_gpus_not_clear_duration(m: Metrics):
    assert val(m, "orchestrator_gpus_clear") == 1.0
    m.gpus_clear(False, at=2000.0)
    m.gpus_clear(False, at=2120.0)  # still the same episode
    m.tick(2300.0)
    assert val(m, "orchestrator_gpus_clear") == 0.0
    assert val(m, "orchestrator_gpus_not_clear_seconds") == 300.0
    m.gpus_clear(True, at=2400.0)
    m.tick(2500.0)
    assert (val(m, "orchestrator_gpus_clear"), val(m, "orchestrator_gpus_not_clear_seconds")) == (1.0, 0.0)


def test_goodput_ratio_and_lost_seconds_stay_monotonic(m: Metrics):
    for cause in LOST_CAUSES:
        assert val(m, "orchestrator_lost_seconds_total", cause=cause) == 0.0
    m.goodput(0.8, {"startup": 100.0, "lost_progress": 50.0})
    m.goodput(0.9, {"startup": 90.0, "hang": 5.0})
    assert val(m, "orchestrator_goodput_ratio") == 0.9
    assert val(m, "orchestrator_lost_seconds_total", cause="startup") == 100.0
    assert val(m, "orchestrator_lost_seconds_total", cause="lost_progress") == 50.0
    assert val(m, "orchestrator_lost_seconds_total", cause="hang") == 5.0


def test_info_labels_are_replaced(m: Metrics):
    m.set_info("a", "h1", "megatron", "m1")
    m.set_info("a", "h2", "megatron", "m1")
    assert val(m, "orchestrator_info", run="a", recipe_hash="h2", backend="megatron", model="m1") == 1
    assert val(m, "orchestrator_info", run="a", recipe_hash="h1", backend="megatron", model="m1") is None


def alert_series(m: Metrics) -> dict[str, float]:
    fams = text_string_to_metric_families(m.exposition().decode())
    return {s.labels["alert"]: s.value for f in fams for s in f.samples if s.name == "orchestrator_alert_active"}


def test_supervisor_alerts_are_precreated_raised_and_cleared(m: Metrics):
    # Exactly the alerts the supervisor owns exist, at 0: no series that nothing ever raises.
    assert alert_series(m) == {a.value: 0.0 for a in RAISED_BY_SUPERVISOR}
    assert RAISED_BY_SUPERVISOR == {Alert.DISK_FULL, Alert.CHECKPOINT_INVALID, Alert.NODE_EXCLUDED,
                                    Alert.THROUGHPUT_DROP, Alert.PROGRESS_UNREADABLE}
    m.alert(Alert.DISK_FULL, True)
    assert alert_series(m) == {"disk_full": 1.0, "checkpoint_invalid": 0.0, "node_excluded": 0.0,
                               "throughput_drop": 0.0, "progress_unreadable": 0.0}
    m.alert(Alert.DISK_FULL, False)
    assert val(m, "orchestrator_alert_active", alert="disk_full") == 0.0


def test_alert_takes_only_a_supervisor_owned_member(m: Metrics):
    with pytest.raises(TypeError, match="Alert member"):
        m.alert("disk_full", True)  # type: ignore[arg-type]
    for a in set(Alert) - RAISED_BY_SUPERVISOR:
        with pytest.raises(ValueError, match="derived by Prometheus"):
            m.alert(a, True)
    assert set(alert_series(m).values()) == {0.0}


def test_crash_limit_is_exported_from_the_recipe_value():
    assert val(Metrics(), "orchestrator_max_crashes_per_hour") == 3.0  # the recipe's default
    assert val(Metrics(max_crashes_per_hour=12), "orchestrator_max_crashes_per_hour") == 12.0


@pytest.mark.parametrize("listen,expected", [
    ("127.0.0.1:9400", ("127.0.0.1", 9400)),
    (":9400", ("127.0.0.1", 9400)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
    ("[::1]:9400", ("::1", 9400)),
])
def test_parse_listen(listen, expected):
    assert parse_listen(listen) == expected


@pytest.mark.parametrize("listen", ["9400", "host:", "host:http", "host:70000"])
def test_parse_listen_rejects(listen):
    with pytest.raises(ValueError):
        parse_listen(listen)


def test_serve_on_loopback_returns_the_bound_port(m: Metrics):
    port = m.serve("127.0.0.1:0")
    try:
        assert port > 0
        m.crash(CrashClass.PORT_IN_USE)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body = r.read().decode()
        assert 'orchestrator_crashes_total{class="port_in_use"} 1.0' in body
        with pytest.raises(RuntimeError):
            m.serve("127.0.0.1:0")
    finally:
        m.close()
    m.close()  # idempotent


# --- run health (orchestrator/domain/health/kinds.py KINDS) --------------------------------------------------------

def test_health_event_counts_are_precreated_at_zero_and_counted_by_kind(m: Metrics):
    for kind in HealthKind:
        assert val(m, "orchestrator_health_events_total", kind=kind.value) == 0.0
    m.health_event("loss_spike")
    m.health_event("loss_spike")
    m.health_event("loss_divergence")
    assert val(m, "orchestrator_health_events_total", kind="loss_spike") == 2.0
    assert val(m, "orchestrator_health_events_total", kind="loss_divergence") == 1.0
    with pytest.raises(ValueError, match="not a health event kind"):
        m.health_event("loss_wobble")


@pytest.mark.parametrize("kind", list(HealthKind))
def test_each_kind_raises_what_its_table_row_declares(kind: HealthKind):
    """KINDS is the one place: a kind's event counts under its label, its own counter, and raises or clears
    exactly the supervisor alert its row names (every other alert stays as it was)."""
    m = Metrics()
    for a in RAISED_BY_SUPERVISOR:
        m.alert(a, a == KINDS[kind].clears)   # what the event clears starts raised
    m.health_event(kind)
    e = KINDS[kind]
    assert val(m, "orchestrator_health_events_total", kind=kind.value) == 1.0
    if e.counter is not None:
        assert val(m, e.counter[0] + "_total") == 1.0
    for a in RAISED_BY_SUPERVISOR:   # raised if the row raises it; the cleared one went from 1 to 0
        assert val(m, "orchestrator_alert_active", alert=a.value) == (1.0 if e.raises and a == e.alert else 0.0), a


def test_throughput_drop_raises_its_alert_and_recovery_clears_it(m: Metrics):
    assert val(m, "orchestrator_throughput_ratio") == 1.0  # baseline speed until a detector says otherwise
    m.health_event("throughput_drop")
    m.throughput(0.5)
    assert (val(m, "orchestrator_alert_active", alert="throughput_drop"), val(m, "orchestrator_throughput_ratio")) == (
        1.0, 0.5)
    m.health_event("throughput_recovered")
    m.throughput(1.02)
    assert val(m, "orchestrator_alert_active", alert="throughput_drop") == 0.0


def test_progress_unreadable_is_raised_until_a_step_record_is_understood(m: Metrics):
    m.health_event("progress_unreadable")
    assert val(m, "orchestrator_alert_active", alert="progress_unreadable") == 1.0
    m.observe_progress(Progress(step=7, loss=1.0))
    assert val(m, "orchestrator_alert_active", alert="progress_unreadable") == 0.0


def test_loss_level_is_set_only_from_a_level(m: Metrics):
    assert val(m, "orchestrator_loss_level") == 0.0
    m.loss_level(1.42)
    m.loss_level(None)          # no window of losses yet (a fresh attempt): keep the last level
    m.loss_level(float("nan"))
    assert val(m, "orchestrator_loss_level") == 1.42
