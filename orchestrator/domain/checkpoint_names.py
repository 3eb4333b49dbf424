"""The one reading of checkpoint directory names (ms-swift's layout): checkpoint-N, checkpoint-N-merged, and
renamed copies such as checkpoint-N.nan-... (a quarantined one)."""
from __future__ import annotations

import os
import re
from pathlib import Path

CKPT_RE = re.compile(r"checkpoint-(\d+)")
MERGED_RE = re.compile(r"checkpoint-(\d+)-merged")


def step_of(name: str | os.PathLike) -> int:
    """The step in a `checkpoint-N` (or `checkpoint-N-merged`, `checkpoint-N.nan-...`) name or path."""
    m = CKPT_RE.match(Path(name).name)
    if m is None:
        raise ValueError(f"{name}: not a checkpoint-N name")
    return int(m.group(1))


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of a path naming a checkpoint or its merged copy (checkpoint-N, checkpoint-N-merged), else None."""
    name = Path(path).name
    return step_of(name) if CKPT_RE.fullmatch(name) or MERGED_RE.fullmatch(name) else None
