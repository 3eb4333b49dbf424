"""checkpoint.merge = "final": after the last step, the export of the newest verified checkpoint is one more
attempt (kind "export") of the same loop; its merged copy takes its published name only once it verifies.
Split out of supervisor.py by concern (the same object: Supervisor inherits it)."""
from __future__ import annotations

from pathlib import Path

from orchestrator.types import Crash, CrashClass, Phase, State
from orchestrator.watch import AttemptWatch


class ExportPhase:
    def _training_finished(self, a: AttemptWatch) -> State:
        """Training is over: COMPLETED, or with checkpoint.merge = "final" the export of its last checkpoint
        next (in the journal first, so a supervisor restarted from here goes straight to the export)."""
        if self.recipe.checkpoint.merge != "final":
            return State.COMPLETED
        self._finish_attempt(Crash(CrashClass.OTHER), stopped=True)
        state = self._training_done(a.last.step if a.last else None)
        self.journal.event("training_done", f"training finished at step {self.training_done['step']}: exporting "
                           "the merged model of the newest verified checkpoint (checkpoint.merge = \"final\")")
        return state

    def _training_done(self, step: int | None) -> State:
        """COMPLETED, or with checkpoint.merge = "final" the export next: recorded in the journal first."""
        if self.recipe.checkpoint.merge != "final":
            return State.COMPLETED
        self.training_done = {"step": step, "recipe_hash": self.hash}
        self.journal.put(training_done=self.training_done)
        return State.VERIFYING  # the trainer's GPUs must be clear before the export loads the model again

    def _export_finished(self, a: AttemptWatch) -> State:
        """The export exited: 0 with a merged copy that verifies -> renamed into place, COMPLETED; anything
        else is a crash like a trainer's (classified, policy decides, the relaunch exports again)."""
        if a.launched.status.code != 0:
            return self._crashed(None)
        final, problems = self.checkpoints.place_merged(a.resume.path)
        if problems:
            return self._crashed(Crash(CrashClass.OTHER, ("the export exited 0 but its output failed "
                                                          "verification; not published",) + problems, Phase.UNKNOWN))
        self._finish_attempt(Crash(CrashClass.OTHER), stopped=True)
        self.journal.event("merged", f"verified {final.name} ({a.resume.path} merged): published by the sync")
        self.sidecar.trigger()
        return State.COMPLETED

    def _trained_to_the_end(self, resume, before: AttemptWatch | None) -> State | None:
        """The newest verified checkpoint is the last step's (the trainer ran on to the end while it was being
        stopped, say): nothing is left to train, and ms-swift resumed from it would train a step past the end.
        COMPLETED, or with checkpoint.merge = "final" the export next; None when steps are left."""
        total = self.recipe.optim.iterations or (before.last.max_steps if before and before.last else None)
        if resume is None or not total or resume.step < total:
            return None
        self.journal.event("training_done", f"{Path(resume.path).name} is the checkpoint of the last step ({total}): "
                           "nothing left to train, no relaunch")
        return self._training_done(resume.step)

    def _export_phase(self) -> bool:
        """Training of a checkpoint.merge = "final" run is over (this supervisor saw it, or the journal says so
        for this recipe): the next launch is the export."""
        if self.recipe.checkpoint.merge != "final":
            return False
        if self.training_done is None:
            done = self.journal.get_all().get("training_done")
            if isinstance(done, dict) and done.get("recipe_hash") == self.hash:
                self.training_done = done
        return self.training_done is not None
