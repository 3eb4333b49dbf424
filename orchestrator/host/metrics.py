"""Prometheus metrics for one supervised run.

`Metrics` owns a private CollectorRegistry (never the process-global one, so tests and several
instances never collide). The supervisor pushes values in as things happen; a scrape only reads
gauges that were already set, so scraping costs nothing beyond text formatting. `tick(now)` must be
called from the supervisor loop at least once a minute: it refreshes the time-derived gauges
(checkpoint age, heartbeat, GPUs-not-clear duration, sync lag), and a stale heartbeat is exactly
how OrchestratorSupervisorDown notices a wedged loop behind a live HTTP thread.

Label values are pre-created (every State, CrashClass, lost-time cause and supervisor-raised
alert) so that series exist at 0 from the first scrape: rate()/increase() need a 0 sample to see the
first crash.
monitoring/alerts.yml and monitoring/grafana-dashboard.json use only names exposed here
(tests/test_alert_rules.py checks that).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily

from orchestrator.domain.health.kinds import KINDS
from orchestrator.domain.goodput import LOST_CAUSES
from orchestrator.config.schema import SupervisorSection
from orchestrator.types import Alert, CrashClass, GpuSnapshot, HealthKind, Progress, State

# The alerts whose state only the supervisor knows: it raises and clears them through alert(), as
# orchestrator_alert_active{alert}. Every other Alert is derived by Prometheus from the metrics here.
#   disk_full           raised with policy's WAIT_FOR_SPACE decision; cleared once enough space is free
#   checkpoint_invalid  raised by run_checkpoints when a checkpoint newer than every verified one fails
#                       verification; cleared when a newer one verifies ok
#   throughput_drop     raised by the throughput_drop health event; cleared by throughput_recovered
#   progress_unreadable raised by the progress_unreadable health event; cleared by the next step record understood
#   (health kinds)      what domain/health/kinds.py KINDS marks `raises`: throughput_drop, progress_unreadable
RAISED_BY_SUPERVISOR: frozenset[Alert] = frozenset(
    {Alert.DISK_FULL, Alert.CHECKPOINT_INVALID, Alert.NODE_EXCLUDED}
    | {e.alert for e in KINDS.values() if e.raises and e.alert is not None})

DEFAULT_LISTEN = "127.0.0.1:9400"


def parse_listen(listen: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' or ':port' (= 127.0.0.1) -> (host, port). Loopback unless told."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics listen address must be HOST:PORT, got {listen!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


class _LostSeconds:
    """orchestrator_lost_seconds_total{cause}: totals recomputed by goodput.py from the journal.

    A custom collector because prometheus_client Counters can only inc(), and the supervisor
    hands over absolute totals. Kept monotonic here so rate() never sees a false reset.
    """

    def __init__(self) -> None:
        self.totals = dict.fromkeys(LOST_CAUSES, 0.0)

    def update(self, lost: Mapping[str, float]) -> None:
        for cause, seconds in lost.items():
            self.totals[cause] = max(self.totals.get(cause, 0.0), float(seconds))

    def collect(self):
        fam = CounterMetricFamily(
            "orchestrator_lost_seconds",
            "Wall-clock seconds not spent on kept training, by cause (see orchestrator/domain/goodput.py).",
            labels=["cause"],
        )
        for cause, seconds in list(self.totals.items()):
            fam.add_metric([cause], seconds)
        yield fam


class Metrics:
    """Everything the supervisor reports to Prometheus. Thread-safe (publishing runs in its own thread).

    started_at: when the run started (from the journal; default now): the checkpoint age before
    the first checkpoint_saved(). Heartbeat and "last progress" start at construction time, so a
    restarted supervisor gets a fresh grace period instead of inheriting the run's age.
    sync_enabled: a checkpoint not yet synced makes the sync lag grow in tick(), so a dead sync
    thread shows up (without it, only sync_done() sets the lag).
    max_crashes_per_hour: the recipe's crash-loop limit, exported so OrchestratorCrashLoop fires where
    the policy starts backing off.
    """

    def __init__(
        self,
        *,
        started_at: float | None = None,
        sync_enabled: bool = False,
        max_crashes_per_hour: int = SupervisorSection.model_fields["max_crashes_per_hour"].default,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        created = clock()
        self._started_at = created if started_at is None else started_at
        self._sync_enabled = sync_enabled
        self._last_ckpt_at: float | None = None
        self._unsynced_since: float | None = None
        self._reported_lag = 0.0
        self._not_clear_since: float | None = None
        self._last_step: int | None = None
        self._last_bad_step: int | None = None
        self._server = None
        self.registry = r = CollectorRegistry(auto_describe=True)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            # prometheus_client appends _total: "orchestrator_restarts" is exposed as ..._total.
            return Counter(name, doc, labels, registry=r)

        self._info = gauge("orchestrator_info", "Constant 1; labels identify the run.",
                           ("run", "recipe_hash", "backend", "model"))
        self._state = gauge("orchestrator_state", "1 for the supervisor's current state, 0 for all others.",
                            ("state",))
        self._crashes = counter("orchestrator_crashes", "Trainer crashes, by crash class.", ("class",))
        self._restarts = counter("orchestrator_restarts", "Trainer relaunches after a crash or hang.")
        self._advice = counter("orchestrator_advice", "Watch mode (`orchestrator watch`): what `run` would have "
                               "done about a verdict, advised instead, by action.", ("action",))
        gauge("orchestrator_max_crashes_per_hour",
              "The recipe's supervisor.max_crashes_per_hour: more crashes in an hour (port_in_use aside) "
              "is a crash loop.").set(max_crashes_per_hour)
        self._step = gauge("orchestrator_training_step", "Last logged training step.")
        self._max_steps = gauge("orchestrator_training_max_steps", "Total training steps (0 if unknown).")
        self._loss = gauge("orchestrator_loss", "Last logged training loss.")
        self._grad_norm = gauge("orchestrator_grad_norm", "Last logged gradient norm.")
        self._lr = gauge("orchestrator_learning_rate", "Last logged learning rate.")
        self._step_s = gauge("orchestrator_step_seconds", "Last logged seconds per training step.")
        self._progress_ts = gauge("orchestrator_last_progress_timestamp_seconds",
                                  "Unix time the training step last advanced (supervisor start before any).")
        self._nan = counter("orchestrator_nan", "Logged steps whose loss or grad norm was NaN/inf.")
        self._skipped = counter("orchestrator_skipped_steps",
                                "Updates skipped on an fp16 overflow (a NaN/inf grad norm with a finite loss, or "
                                "Megatron's `number of skipped iterations`): not NaN steps.")
        # a health kind's own counter (domain/health/kinds.py KINDS): the resume checks', read by alert rules
        self._kind_counters = {k: counter(*e.counter) for k, e in KINDS.items() if e.counter is not None}
        self._ckpt_age = gauge("orchestrator_checkpoint_age_seconds",
                               "Seconds since the last saved checkpoint (since run start before any).")
        self._ckpt_step = gauge("orchestrator_last_checkpoint_step", "Step of the last saved checkpoint.")
        self._ckpt_invalid = counter("orchestrator_checkpoint_invalid",
                                     "Checkpoints that failed verification.")
        self._sync_lag = gauge("orchestrator_sync_lag_seconds",
                               "Age of the oldest local checkpoint newer than the newest published one, seconds.")
        self._publish_interval = gauge("orchestrator_publish_interval_seconds",
                                       "checkpoint.publish_interval_s: the newest save is published at most this often.")
        self._sync_bytes = counter("orchestrator_sync_bytes", "Bytes copied by checkpoint sync.")
        self._pruned = counter("orchestrator_local_checkpoints_pruned",
                               "Local checkpoints and merged copies deleted by retention, by reason.", ("reason",))
        self._gpu_used = gauge("orchestrator_gpu_memory_used_bytes", "GPU memory in use (NVML), bytes.",
                               ("gpu",))
        self._gpu_total = gauge("orchestrator_gpu_memory_total_bytes", "GPU memory size (NVML), bytes.",
                                ("gpu",))
        self._gpus_clear = gauge("orchestrator_gpus_clear",
                                 "1 if the last GPU verification found the GPUs clear, else 0.")
        self._gpus_not_clear_s = gauge("orchestrator_gpus_not_clear_seconds",
                                       "Seconds the GPUs have been found not clear (0 when clear).")
        self._goodput = gauge("orchestrator_goodput_ratio", "Productive training time / total run time.")
        self._save_s = gauge("orchestrator_checkpoint_save_seconds",
                             "Seconds the last measured checkpoint save stopped training (costs.py).")
        self._startup_s = gauge("orchestrator_startup_seconds", "Seconds from the last launch to its first step.")
        self._save_interval = gauge("orchestrator_save_interval_steps",
                                    "Checkpoint interval of the running attempt, steps (chosen when save_steps = auto).")
        self._hang_timer = gauge("orchestrator_hang_timeout_seconds",
                                 "The running attempt's hang timer: no new step for this long is a hang.")
        self._health = counter("orchestrator_health_events",
                               "Run-health events, by kind (types.HealthKind).", ("kind",))
        self._throughput = gauge("orchestrator_throughput_ratio",
                                 "Training throughput now / the attempt's baseline (1: baseline speed, 0.5: half).")
        self._loss_level = gauge("orchestrator_loss_level",
                                 "The loss level: median of the last health.divergence_window logged losses.")
        self._lost = _LostSeconds()
        r.register(self._lost)
        self._alert = gauge("orchestrator_alert_active", "1 while the supervisor raises this alert.",
                            ("alert",))
        self._heartbeat = gauge("orchestrator_supervisor_heartbeat_timestamp_seconds",
                                "Unix time of the supervisor loop's last tick.")

        for s in State:
            self._state.labels(s.value).set(0)
        for c in CrashClass:
            self._crashes.labels(c.value)
        for k in HealthKind:
            self._health.labels(k.value)
        self._throughput.set(1)
        for a in Alert:
            if a in RAISED_BY_SUPERVISOR:
                self._alert.labels(a.value).set(0)
        self._gpus_clear.set(1)
        self._progress_ts.set(created)
        self.tick(created)

    # -- serving ---------------------------------------------------------------------------

    def serve(self, listen: str = DEFAULT_LISTEN) -> int:
        """Start the /metrics HTTP server in a daemon thread; returns the bound port."""
        if self._server is not None:
            raise RuntimeError("metrics server already running")
        host, port = parse_listen(listen)
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def exposition(self) -> bytes:
        """The text a scrape would return (for tests and `orchestrator status --metrics`)."""
        return generate_latest(self.registry)

    # -- what the supervisor reports -------------------------------------------------------

    def set_info(self, run: str, recipe_hash: str, backend: str, model: str) -> None:
        self._info.clear()
        self._info.labels(run, recipe_hash, backend, model).set(1)

    def set_state(self, state: State) -> None:
        state = State(state)  # also accepts the plain string read back from the journal
        with self._lock:
            for s in State:
                self._state.labels(s.value).set(1 if s is state else 0)

    def observe_progress(self, p: Progress, skipped: int = 0) -> None:
        """Sets the gauges from one step record and counts a NaN step; `skipped`: the updates the attempt's
        SkippedSteps found the record skipped (an fp16 overflow), counted as skipped steps, not NaN."""
        now = self._clock()
        with self._lock:
            if p.step != self._last_step:
                self._last_step = p.step
                self._progress_ts.set(now)
                self._alert.labels(Alert.PROGRESS_UNREADABLE.value).set(0)  # a step record understood again
            judged = (p.loss,) if skipped else (p.loss, p.grad_norm)  # a skipped update's grad norm is no NaN
            bad = any(v is not None and not math.isfinite(v) for v in judged)
            if (bad or skipped) and p.step != self._last_bad_step:  # stdout and logging.jsonl report the same step
                self._last_bad_step = p.step
                if bad:
                    self._nan.inc()
                else:
                    self._skipped.inc(skipped)
        self._step.set(p.step)
        if p.max_steps is not None:
            self._max_steps.set(p.max_steps)
        for g, v in ((self._loss, p.loss), (self._grad_norm, p.grad_norm), (self._lr, p.lr),
                     (self._step_s, p.step_s)):
            if v is not None:
                g.set(v)

    def health_event(self, kind: str) -> None:
        """One run-health event (a Finding's kind): counted, with what KINDS says it raises: its own counter, the
        supervisor alert it raises or clears."""
        if kind not in KINDS:
            raise ValueError(f"{kind!r} is not a health event kind ({', '.join(HealthKind)})")
        effects = KINDS[HealthKind(kind)]
        self._health.labels(kind).inc()
        if own := self._kind_counters.get(HealthKind(kind)):
            own.inc()
        if effects.raises and effects.alert is not None:
            self.alert(effects.alert, True)
        if effects.clears is not None:
            self.alert(effects.clears, False)

    def throughput(self, ratio: float) -> None:
        """Throughput now / the attempt's baseline (the throughput detector sets it each pass)."""
        self._throughput.set(ratio)

    def loss_level(self, level: float | None) -> None:
        """The loss level of HealthWatch.loss_level (None until a window of losses is in: left as it was)."""
        if level is not None and math.isfinite(level):
            self._loss_level.set(level)

    def crash(self, cls: CrashClass) -> None:
        self._crashes.labels(CrashClass(cls).value).inc()

    def advice(self, action: str) -> None:
        self._advice.labels(action).inc()

    def restart(self) -> None:
        self._restarts.inc()

    def checkpoint_saved(self, step: int, at: float) -> None:
        """A verified checkpoint exists. Also call it at start-up for the newest one on disk
        (with sync enabled it then counts as unsynced until the next sync_done())."""
        with self._lock:
            if self._last_ckpt_at is None or at >= self._last_ckpt_at:
                self._last_ckpt_at = at
                self._ckpt_step.set(step)
            if self._sync_enabled and self._unsynced_since is None:
                self._unsynced_since = at

    def save_cost(self, seconds: float) -> None:
        self._save_s.set(seconds)

    def startup_cost(self, seconds: float) -> None:
        self._startup_s.set(seconds)

    def save_interval(self, steps: int) -> None:
        self._save_interval.set(steps)

    def hang_timer(self, seconds: float) -> None:
        self._hang_timer.set(seconds)

    def publish_interval(self, seconds: float) -> None:
        self._publish_interval.set(seconds)

    def checkpoint_invalid(self) -> None:
        self._ckpt_invalid.inc()

    def pruned(self, pressure: bool) -> None:
        self._pruned.labels("disk_pressure" if pressure else "retention").inc()

    def sync_done(self, bytes_copied: int, lag_s: float) -> None:
        """A sync finished; lag_s = age of the newest checkpoint now present at the destination."""
        self._sync_bytes.inc(max(0, bytes_copied))
        with self._lock:
            self._reported_lag = max(0.0, lag_s)
            self._unsynced_since = None
            self._sync_lag.set(self._reported_lag)

    def gpu_memory(self, snapshot: GpuSnapshot) -> None:
        if snapshot.error is not None:
            # No reading: drop the series rather than keep stale numbers on the dashboard.
            self._gpu_used.clear()
            self._gpu_total.clear()
            return
        for g in snapshot.gpus:
            self._gpu_used.labels(str(g.index)).set(g.memory_used_bytes)
            self._gpu_total.labels(str(g.index)).set(g.memory_total_bytes)

    def gpus_clear(self, clear: bool, at: float) -> None:
        """Result of a GPU verification (after cleanup, before relaunch)."""
        with self._lock:
            self._gpus_clear.set(1 if clear else 0)
            if clear:
                self._not_clear_since = None
                self._gpus_not_clear_s.set(0)
            elif self._not_clear_since is None:
                self._not_clear_since = at

    def goodput(self, ratio: float, lost: Mapping[str, float]) -> None:
        self._goodput.set(ratio)
        self._lost.update(lost)

    def alert(self, alert: Alert, active: bool) -> None:
        """Raise (or clear) one of the RAISED_BY_SUPERVISOR alerts (Decision.alert, say)."""
        if not isinstance(alert, Alert):
            raise TypeError(f"alert must be an Alert member, got {alert!r}")
        if alert not in RAISED_BY_SUPERVISOR:
            raise ValueError(f"{alert} is derived by Prometheus from the metrics (monitoring/alerts.yml), "
                             "not raised by the supervisor")
        self._alert.labels(alert.value).set(1 if active else 0)

    def tick(self, now: float) -> None:
        with self._lock:
            ref = self._last_ckpt_at if self._last_ckpt_at is not None else self._started_at
            self._ckpt_age.set(max(0.0, now - ref))
            self._heartbeat.set(now)
            if self._not_clear_since is not None:
                self._gpus_not_clear_s.set(max(0.0, now - self._not_clear_since))
            if self._unsynced_since is not None:
                self._sync_lag.set(max(self._reported_lag, now - self._unsynced_since))
