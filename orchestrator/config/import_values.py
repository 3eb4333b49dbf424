"""Argv words as the values `orchestrator import` writes into a recipe: `convert` for a recipe key of a known
type (list, bool, int, float, str), `extra_value` for an extra_args entry (which must render back to the same
words). Pure and stdlib-only.
"""
from __future__ import annotations

import math
import re

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")
_BOOL = {"true": True, "false": False, "yes": True, "no": False, "t": True, "f": False, "y": True, "n": False,
         "1": True, "0": False}


def convert(values: tuple[str, ...], kind: type) -> object:
    """Converts argv words to a value of `kind`; raises ValueError saying what was expected."""
    if kind is list:
        if not values:
            raise ValueError("expected one or more values, got none")
        return list(values)
    if kind is bool and not values:
        return True  # a bare flag: ms-swift reads it as true
    if len(values) != 1:
        raise ValueError(f"expected one value, got {len(values)}" + (f": {' '.join(values)}" if values else ""))
    v = values[0]
    if kind is bool:
        if v.lower() not in _BOOL:
            raise ValueError(f"expected true or false, got {v!r}")
        return _BOOL[v.lower()]
    if kind is int:
        if not _INT.fullmatch(v):
            raise ValueError(f"expected a whole number, got {v!r}")
        return int(v)
    if kind is float:
        if not _FLOAT.fullmatch(v):
            raise ValueError(f"expected a number, got {v!r}")
        return float(v)
    return v


def extra_value(values: tuple[str, ...]) -> object:
    """Reads argv words as an extra_args value: true/false, a number that renders back to the same value, a
    string, or a list of strings; a bare flag is true."""
    if not values:
        return True
    if len(values) > 1:
        return list(values)
    v = values[0]
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    if _INT.fullmatch(v) and str(int(v)) == v:
        return int(v)
    if _FLOAT.fullmatch(v) and ("." in v or "e" in v.lower()) and math.isfinite(float(v)):
        return float(v)
    return v
