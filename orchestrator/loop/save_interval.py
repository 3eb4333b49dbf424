"""How often a launch saves: the recipe's save_steps, or for "auto" the interval chosen at every (re)launch
from the measured save cost, step time and failure rate of this run and earlier runs on this node
(domain/interval.py decides; this records the choice with its inputs, and reports what saves and starts
cost as the watch measures them)."""
from __future__ import annotations

from collections.abc import Callable

from orchestrator.config.recipe import Recipe
from orchestrator.domain import interval, storage
from orchestrator.host.journal import Journal
from orchestrator.host.metrics import Metrics
from orchestrator.host.node_history import NodeHistory


class SaveIntervals:
    def __init__(self, recipe: Recipe, journal: Journal, metrics: Metrics, run_id: str, save_bytes: float,
                 step_time: tuple[float, str], background_bytes: float = 0.0):
        """`save_bytes` (of which `background_bytes` written by --async_save after the save returns),
        `step_time` (seconds, where it came from): the storage budget's, the priors until measured."""
        self.recipe, self.journal, self.metrics, self.run_id = recipe, journal, metrics, run_id
        self.save_bytes, self.step_time, self.background_bytes = save_bytes, step_time, background_bytes
        self.node = NodeHistory()  # earlier runs' failures on this node

    def choose(self, n: int, now: float) -> int:
        earlier = self.journal.attempts()
        unwritten = self.node.record(self.run_id, *interval.run_failures(earlier, now), now)
        save_steps = self.recipe.checkpoint.save_steps
        if save_steps == "auto":
            choice = interval.choose(interval.evidence(earlier, self.node.others(self.run_id), self.save_bytes,
                                                       None, *self.step_time, now, self.background_bytes,
                                                       storage.ranks(self.recipe)))
            save_steps = choice.steps
            self.journal.event("save_interval", f"attempt {n}: {choice.reason}", **choice.as_dict(),
                               **({"node_history_unwritten": unwritten} if unwritten else {}))
        self.metrics.save_interval(save_steps)
        self.journal.put(save_interval=save_steps)  # status, history, the report
        return save_steps

    def reporter(self, n: int) -> Callable[[str, float, dict], None]:
        """The watch's callback for each measured start-up and save of attempt n."""
        def measured(kind: str, seconds: float, details: dict) -> None:
            (self.metrics.startup_cost if kind == "startup" else self.metrics.save_cost)(seconds)
            self.journal.event(f"{kind}_seconds", f"attempt {n}: {kind} took {seconds:.1f} s", seconds=seconds,
                               **details)
        return measured
