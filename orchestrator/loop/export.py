"""checkpoint.merge = "final": after the last step, the export of the newest verified checkpoint is one more
attempt (kind export) of the same loop; its merged copy takes its published name only once it verifies.

The journal's `training_done` record ({"step", "recipe_hash"}) marks the training as over for this recipe: a
supervisor restarted after it goes straight to the export."""
from __future__ import annotations

from pathlib import Path

from orchestrator.host.base import Host
from orchestrator.loop.attempt import AttemptWatch
from orchestrator.loop.run import RunContext
from orchestrator.types import Crash, CrashClass, Phase, Resume, State


class ExportPhase:
    def __init__(self, ctx: RunContext, hash_: str, host: Host):
        self.ctx, self.recipe, self.hash, self.host = ctx, ctx.recipe, hash_, host
        self.final = ctx.recipe.checkpoint.merge == "final"
        self.training_over: dict | None = None  # the journal's training_done record, once known

    def after_training(self, a: AttemptWatch) -> State:
        """Training is over: COMPLETED, or with checkpoint.merge = "final" the export of its last checkpoint
        next (in the journal first, so a supervisor restarted from here goes straight to the export)."""
        if not self.final:
            return State.COMPLETED
        a.finish(self.ctx.journal, self.host, Crash(CrashClass.OTHER), stopped=True)
        state = self._record_training_over(a.last.step if a.last else None)
        self.ctx.journal.event("training_done", f"training finished at step {a.last.step if a.last else None}: "
                               "exporting the merged model of the newest verified checkpoint "
                               "(checkpoint.merge = \"final\")")
        return state

    def nothing_left_to_train(self, resume: Resume | None, before: AttemptWatch | None) -> State | None:
        """The newest verified checkpoint is the last step's (the trainer ran on to the end while it was being
        stopped, say): nothing is left to train, and ms-swift resumed from it would train a step past the end.
        COMPLETED, or with checkpoint.merge = "final" the export next; None when steps are left."""
        total = self.recipe.optim.iterations or (before.last.max_steps if before and before.last else None)
        if resume is None or not total or resume.step < total:
            return None
        self.ctx.journal.event("training_done", f"{Path(resume.path).name} is the checkpoint of the last step "
                               f"({total}): nothing left to train, no relaunch")
        return self._record_training_over(resume.step)

    def exporting(self) -> bool:
        """Tells whether the next launch is the export: the training of a checkpoint.merge = "final" run is over
        (this supervisor saw it, or the journal says so for this recipe)."""
        if not self.final:
            return False
        if self.training_over is None:
            done = self.ctx.journal.get_all().get("training_done")
            if isinstance(done, dict) and done.get("recipe_hash") == self.hash:
                self.training_over = done
        return self.training_over is not None

    def export_exited(self, a: AttemptWatch) -> State | Crash | None:
        """The export exited: 0 with a merged copy that verifies -> renamed into place, COMPLETED; anything else
        is a crash like a trainer's (the Crash the loop saw, or None: classify the log), and the relaunch
        exports again."""
        assert a.launched.status is not None and a.resume is not None
        if a.launched.status.code != 0:
            return None
        final, problems = self.ctx.checkpoints.place_merged(a.resume.path)
        if problems:
            return Crash(CrashClass.OTHER, ("the export exited 0 but its output failed verification; not "
                                            "published",) + problems, Phase.UNKNOWN)
        a.finish(self.ctx.journal, self.host, Crash(CrashClass.OTHER), stopped=True)
        self.ctx.journal.event("merged", f"verified {final.name} ({a.resume.path} merged): published by the sync")
        self.ctx.publisher.trigger()
        return State.COMPLETED

    def _record_training_over(self, step: int | None) -> State:
        """COMPLETED, or with checkpoint.merge = "final" the export next, recorded in the journal first."""
        if not self.final:
            return State.COMPLETED
        self.training_over = {"step": step, "recipe_hash": self.hash}
        self.ctx.journal.put(training_done=self.training_over)
        return State.VERIFYING  # the trainer's GPUs must be clear before the export loads the model again
