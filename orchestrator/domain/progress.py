"""Progress from trainer output: stdout dict lines and logging.jsonl records -> Progress. Pure.

ms-swift 4.x prints `str(dict)` per logged step (Python repr: single quotes, bare nan/inf; under
transformers 5 every float is a string). Parse with ast.literal_eval, never eval.
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
_STEP_KEYS = ("global_step/max_steps", "iteration")


def _number(v: object) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(str(v).strip().rstrip("%"))
    except ValueError:
        return None


def from_record(rec: dict) -> Progress | None:
    """A training-step record (stdout dict or logging.jsonl line); None for eval/summary records."""
    if "loss" not in rec and "grad_norm" not in rec:
        return None
    for key in _STEP_KEYS:
        raw = rec.get(key)
        if isinstance(raw, str) and "/" in raw:
            cur, _, total = raw.partition("/")
            try:
                step, max_steps = int(cur), int(total)
            except ValueError:
                return None
            break
    else:
        return None
    return Progress(step=step, max_steps=max_steps, loss=_number(rec.get("loss")),
                    grad_norm=_number(rec.get("grad_norm")), lr=_number(rec.get("learning_rate")),
                    memory_gib=_number(rec.get("memory(GiB)")), step_s=_number(rec.get("train_speed(s/it)")))


def parse_line(line: str) -> Progress | None:
    """A stdout line -> Progress, or None when it holds no training-step dict."""
    if "{'" not in line:  # most lines: a C substring test instead of a regex scan
        return None
    m = _DICT.search(line)
    if not m:
        return None
    # Bare nan/inf become strings; _number() turns them back into floats.
    text = _BARE.sub(lambda g: f"'{g.group(1)}{g.group(2)}'", m.group(0))
    try:
        rec = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return from_record(rec) if isinstance(rec, dict) else None


def parse_jsonl_line(line: str) -> Progress | None:
    try:
        rec = json.loads(line)  # Python's json accepts NaN/Infinity, as written by ms-swift
    except ValueError:
        return None
    return from_record(rec) if isinstance(rec, dict) else None


def is_bad_number(x: float | None) -> bool:
    return x is not None and (math.isnan(x) or math.isinf(x))


def andon(p: Progress) -> bool:
    """Stop the line: loss or grad norm is NaN/Inf."""
    return is_bad_number(p.loss) or is_bad_number(p.grad_norm)
