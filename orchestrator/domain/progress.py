"""Progress from trainer output -> Progress. Pure.

Formats, each tested against real output (tests/fixtures/progress/: lines pasted in public issue threads and logs
ms-swift's and Megatron-LM's own repositories quote):
- ms-swift 4.x (and 3.x `swift sft`) print `str(dict)` per logged step (Python repr: single quotes, bare
  nan/inf; under transformers 5 every float is a string). Parsed with ast.literal_eval, never eval.
- ms-swift 1.x/2.x print the same dict with `'global_step': 5` (an int, no max steps) where later versions print
  `'global_step/max_steps': '5/1000'`.
- logging.jsonl: the same records as JSON (ms-swift 3.x megatron names its loss `lm loss`).
- Megatron-LM's training_log, which ms-swift's 2.x and 3.x Megatron backends print too: one pipe-separated line per
  logged iteration, ` [2026-01-20 08:33:58] iteration        5/     206 | consumed samples: ... |
  lm loss: 1.180399E+00 | ... | grad norm: 1.105 | number of skipped iterations:   0 | ...`.
Every format is found anywhere in the line: timestamps, `master-0 >> `, `[rank7]: ` and a tqdm bar glued
on by `\\r` may come before it. A pasted dict whose opening brace the paste lost is read too.
A transformers Trainer dict with no step field (`{'loss': ..., 'epoch': 0.5}`) is no step record: the step it
belongs to is unknown (logging_steps is not in the line), and counting records would name steps that no
checkpoint-N matches; progress_unreadable reports such output instead.
"""
from __future__ import annotations

import ast
import json
import math
import re

from orchestrator.types import Progress

# The dict can follow a tqdm fragment glued on by \r: find it anywhere in the line.
_DICT = re.compile(r"\{'(?:loss|eval_|train_runtime|grad_norm|learning_rate)[^{}]*\}")
# Bare nan/inf in a repr (megatron prints floats raw) are not Python literals.
_BARE = re.compile(r"(?<=[:\s\[,])(-?)(nan|inf)(?=[,}\]\s])")
# A paste can lose a dict's opening brace (the selection began just after it): a line that is a training
# dict's body from its first key to its closing brace is that dict.
_HEADLESS = re.compile(r"\s*('(?:loss|grad_norm|learning_rate)'\s*:[^{}]*\})\s*$")
_STEP_KEYS = ("global_step/max_steps", "iteration")
_LOSS_KEYS = ("loss", "lm loss")  # ms-swift 3.x megatron's logging.jsonl keeps Megatron's `lm loss`
# Megatron-LM's line starts with the iteration field (`'iteration {:8d}/{:8d} |'`); `validation loss at
# iteration 100 |` and `exiting program at iteration 100` have no `/total`, so they never match.
_PIPE = re.compile(r"(?:^|[\s\]>:])iteration\s+(\d+)\s*/\s*(\d+)\s*\|")
# Fields of a training step; a line with the iteration field and none of these is no step.
_PIPE_STEP_FIELDS = ("consumed samples", "lm loss", "loss", "grad norm", "number of nan iterations")
# What Megatron-LM's training_log prints of a pretraining or sft step besides its losses.
_PIPE_FIELDS = frozenset((
    "consumed samples", "consumed tokens", "elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)",
    "learning rate", "decoupled learning rate", "global batch size", "loss scale", "grad norm", "num zeros",
    "params norm", "number of skipped iterations", "number of nan iterations", "memory(GiB)", "actual seqlen",
    "samples per second", "TFLOPs", "elapsed time", "elapsed time per iteration", "remaining time"))


def _number(v: object) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(str(v).strip().rstrip("%"))
    except ValueError:
        return None


def _step_seconds(rec: dict) -> float | None:
    """Seconds per step from whichever speed the record carries (4.x s/it, 3.x iter/s, 3.x megatron's s)."""
    for key in ("train_speed(s/it)", "elapsed_time_per_iteration"):
        if key in rec:
            return _number(rec[key])
    per_s = _number(rec.get("train_speed(iter/s)"))
    return 1.0 / per_s if per_s else None


def _step_of(rec: dict) -> tuple[int, int | None] | None:
    """Return the (step, max steps) a record names, or None when it names no step."""
    for key in _STEP_KEYS:
        raw = rec.get(key)
        if isinstance(raw, str) and "/" in raw:
            cur, _, total = raw.partition("/")
            try:
                return int(cur), int(total)
            except ValueError:
                return None
    # ms-swift 1.x/2.x's callback sets logs['global_step'] = state.global_step: the step, with no total.
    raw = rec.get("global_step")
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw, None
    return None


def from_record(rec: dict) -> Progress | None:
    """A training-step record (stdout dict or logging.jsonl line); None for eval/summary records."""
    loss_key = next((k for k in _LOSS_KEYS if k in rec), None)
    if loss_key is None and "grad_norm" not in rec:
        return None
    at = _step_of(rec)
    if at is None:
        return None
    step, max_steps = at
    return Progress(step=step, max_steps=max_steps, loss=_number(rec.get(loss_key)) if loss_key else None,
                    grad_norm=_number(rec.get("grad_norm")), lr=_number(rec.get("learning_rate")),
                    memory_gib=_number(rec.get("memory(GiB)")), step_s=_step_seconds(rec))


def parse_pipe_line(line: str) -> Progress | None:
    """A Megatron-LM training_log line (`iteration N/ M | key: value | ...`) -> Progress, else None.

    The loss is `lm loss` (sft, pretraining) or `loss` (ms-swift's RL trainers); `mtp_1 loss`,
    `load_balancing_loss` and other extra losses are not it. `number of nan iterations` > 0 makes the loss NaN:
    Megatron counts the skipped iterations whose loss was NaN/Inf apart and leaves them out of the average it
    prints. An iteration it did not skip adds its NaN to the average, which Megatron-LM then drops from the line
    altogether (epfLLM/Megatron-LLM#33: nan counter 0, no `lm loss`): `_loss_left_out` reads that as NaN.
    """
    m = _PIPE.search(line)
    if not m:
        return None
    fields: dict[str, str] = {}
    for part in line[m.end():].split("|"):
        key, sep, value = part.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    if not any(k in fields for k in _PIPE_STEP_FIELDS):
        return None
    loss = _number(fields.get("lm loss", fields.get("loss")))
    nan_iterations = _number(fields.get("number of nan iterations"))
    skipped = _number(fields.get("number of skipped iterations"))
    if nan_iterations or (loss is None and _loss_left_out(fields, skipped)):
        loss = math.nan
    ms = _number(fields.get("elapsed time per iteration (ms)"))
    return Progress(step=int(m.group(1)), max_steps=int(m.group(2)), loss=loss,
                    grad_norm=_number(fields.get("grad norm")), lr=_number(fields.get("learning rate")),
                    memory_gib=_number(fields.get("memory(GiB)")), step_s=ms / 1000.0 if ms is not None else None,
                    skipped=int(skipped) if skipped is not None and math.isfinite(skipped) else None)


def _loss_left_out(fields: dict[str, str], skipped: float | None) -> bool:
    """Tells whether a pipe line without a loss field says the loss was NaN: Megatron-LM prints a loss average
    only when it is >= 0 (`if avg >= 0.0`), and sums the losses of every iteration it did not skip; with none
    skipped (`number of skipped iterations: 0`, or `loss scale: 1.0` where the field is cut off: bf16/fp32 skip
    nothing), a cross-entropy average left out is NaN. A line with fields of its own (an RL trainer's reward,
    whose loss may be negative) says nothing."""
    none_skipped = skipped == 0 or (skipped is None and _number(fields.get("loss scale")) == 1.0)
    return none_skipped and all(k in _PIPE_FIELDS or k.endswith((" loss", "_loss")) for k in fields)


def parse_dict_line(line: str) -> Progress | None:
    """An ms-swift stdout dict line -> Progress, or None when it holds no training-step dict."""
    if "{'" in line:  # most lines: C substring tests instead of a regex scan
        m = _DICT.search(line)
        body = m.group(0) if m else None
    elif line.lstrip().startswith("'"):
        m = _HEADLESS.match(line)
        body = "{" + m.group(1) if m else None
    else:
        return None
    if body is None:
        return None
    # Bare nan/inf become strings; _number() turns them back into floats.
    text = _BARE.sub(lambda g: f"'{g.group(1)}{g.group(2)}'", body)
    try:
        rec = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return from_record(rec) if isinstance(rec, dict) else None


def parse_line(line: str) -> Progress | None:
    """A stdout line -> Progress (an ms-swift dict or a Megatron-LM pipe line), or None when it holds no step."""
    p = parse_dict_line(line)
    if p is None and "iteration" in line:  # most lines: a C substring test instead of a regex scan
        p = parse_pipe_line(line)
    return p


def parse_jsonl_line(line: str) -> Progress | None:
    """A logging.jsonl line -> Progress, or None when it is no training-step record."""
    try:
        rec = json.loads(line)  # Python's json accepts NaN/Infinity, as written by ms-swift
    except ValueError:
        return None
    return from_record(rec) if isinstance(rec, dict) else None


def is_bad_number(x: float | None) -> bool:
    """Whether x is NaN or infinite (None is not)."""
    return x is not None and (math.isnan(x) or math.isinf(x))


def andon(p: Progress) -> bool:
    """Tells whether a record stops the line by itself: loss or grad norm is NaN/Inf (a run without a loss
    scaler; skipped_steps.SkippedSteps knows fp16 runs, where a NaN grad norm is a skipped update)."""
    return is_bad_number(p.loss) or is_bad_number(p.grad_norm)
