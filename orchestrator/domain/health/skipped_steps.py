"""Overflow-skipped updates are not NaN (issue 35, item 1). Pure.

An fp16 mixed-precision run scales its loss up so small gradients survive in fp16; when a scaled gradient
overflows, the loss scaler skips that update and halves the scale. The trainer logs such a step with a finite
loss and a non-finite gradient norm (transformers / ms-swift: `'grad_norm': nan`), or says it skipped (Megatron:
`number of skipped iterations: N`, and no grad norm). That is normal: a few skips at the start while the scale
finds its level, one now and then when it grows back. It is a NaN andon only when it persists: more than
health.max_skipped_steps skipped steps in a row mean no update is happening (the scale is at the bottom),
and a non-finite loss is one at once. bf16 and fp32 runs have no loss scaler, so a non-finite grad norm there
is an andon as before, unless the trainer itself says the step was skipped.

    skips = SkippedSteps(fp16_run(recipe), recipe.health.max_skipped_steps)
    for each step record: check = skips.observe(p)   # check.andon, check.skipped, check.run
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.config.schema import Recipe
from orchestrator.domain.health.detector import Check, Detector, Snapshot, Start
from orchestrator.domain.health.kinds import Finding
from orchestrator.types import HealthKind, Progress

_TRUE = ("true", "1", "yes")


def _flag(recipe: Recipe, name: str) -> bool | None:
    """An on/off training flag from extra_args (`fp16 = true`, `"--bf16" = "false"`), None when unset."""
    for key in (name, f"--{name}"):
        v = recipe.extra_args.get(key)
        if v is not None:
            return v if isinstance(v, bool) else str(v).strip().lower() in _TRUE
    return None


def fp16_run(recipe: Recipe) -> bool:
    """Tells whether the recipe trains in fp16 mixed precision (with a loss scaler): an `fp16` training flag in
    extra_args, else model.torch_dtype float16 (ms-swift trains in the model dtype unless bf16 is set)."""
    fp16 = _flag(recipe, "fp16")
    if fp16 is not None:
        return fp16
    if _flag(recipe, "bf16"):
        return False
    return recipe.model.torch_dtype == "float16"


def _bad(x: float | None) -> bool:
    return x is not None and not math.isfinite(x)


@dataclass(frozen=True)
class StepCheck:
    """What one step record says about NaN: `andon` (stop the line), with `why`; `skipped`: the updates it
    reports skipped (0: none); `run`: skipped steps in a row so far."""

    andon: bool
    skipped: int = 0
    run: int = 0
    why: str = ""


class SkippedSteps:
    """Skipped updates over one attempt's step records, in step order. `fp16`: the run has a loss scaler;
    `max_in_row`: more skipped steps in a row than this is an andon."""

    def __init__(self, fp16: bool = False, max_in_row: int = 50, start_step: int = 0) -> None:
        self.fp16, self.max_in_row = fp16, max_in_row
        self.last_step: int = start_step   # the step before the attempt's first (its resume point)
        self.run = 0                       # skipped steps in a row
        self.total = 0                     # skipped steps of the attempt

    def observe(self, p: Progress) -> StepCheck:
        """The verdict on one step record. A record of a step already observed (stdout and logging.jsonl report
        each step) counts no skip again, but a non-finite loss in it is still an andon."""
        if _bad(p.loss):
            return StepCheck(True, why=f"loss {p.loss} at step {p.step}")
        if p.step <= self.last_step:
            return StepCheck(False, run=self.run)
        interval, self.last_step = p.step - self.last_step, p.step
        bad_grad = _bad(p.grad_norm)
        if bad_grad and p.loss == 0.0:
            # transformers' logging_nan_inf_filter leaves NaN/inf losses out of the logged mean: a mean of
            # exactly 0 beside a non-finite grad norm is every loss of the interval non-finite
            return StepCheck(True, why=f"loss 0.0 with grad norm {p.grad_norm} at step {p.step} (the trainer left "
                                       "non-finite losses out of the logged mean)")
        if p.skipped is not None:   # the trainer counts its skips (Megatron): it knows
            skipped = p.skipped
            if skipped == 0 and bad_grad:
                return StepCheck(True, why=f"grad norm {p.grad_norm} at step {p.step}, and the trainer did not "
                                           "skip the update")
        elif bad_grad and not self.fp16:
            return StepCheck(True, why=f"grad norm {p.grad_norm} at step {p.step} (no loss scaler: the run is not "
                                       "fp16, and the trainer did not say it skipped the step)")
        else:
            skipped = 1 if bad_grad else 0
        if skipped == 0:
            self.run = 0
            return StepCheck(False)
        # A record can cover several steps (Megatron's log_interval): only when it skipped all of them does the
        # run of skipped steps go on; otherwise an update came between, and at most `skipped` are in a row.
        self.run = self.run + skipped if skipped >= interval else skipped
        self.total += skipped
        if self.run > self.max_in_row:
            return StepCheck(True, skipped, self.run,
                             f"{self.run} skipped updates in a row through step {p.step} (more than "
                             f"health.max_skipped_steps {self.max_in_row}): the loss scale found no level at "
                             "which the gradients are finite, the run does not train")
        return StepCheck(False, skipped, self.run)


def _start(start: Start) -> Check:
    """The `skipped_steps` warning of one attempt: a finding where a run of skipped updates starts (the metrics
    count every one; the NaN andon of a run that persists is the attempt's, loop/attempt.py)."""
    skips, limit = SkippedSteps(start.fp16, start.cfg.max_skipped_steps, start.resume_step or 0), \
        start.cfg.max_skipped_steps

    def observe(snap: Snapshot) -> list[Finding]:
        p = snap.record
        if p is None:
            return []
        check = skips.observe(p)
        if not check.skipped or check.run != check.skipped or check.andon:
            return []
        why = (f"the trainer reports {check.skipped} skipped" if p.skipped else
               f"grad norm {p.grad_norm} with a finite loss {p.loss} in an fp16 run")
        return [Finding(HealthKind.SKIPPED_STEPS, f"step {p.step}: an overflow-skipped update ({why}): the loss "
                                                  "scaler skips the update and lowers its scale; NaN only after "
                                                  f"more than health.max_skipped_steps ({limit}) in a row",
                        p.step, p.step, value=p.grad_norm if p.grad_norm is not None else None,
                        details={"skipped": check.skipped, "skipped_total": skips.total})]
    return observe


DETECTOR = Detector("skipped_steps", "step", _start)
