"""Recipe values as `sft` argv words. Pure; shared by both backends' renderers."""
from __future__ import annotations

from collections.abc import Iterable


def value(v: object) -> list[str]:
    """One recipe value as argv words: booleans as ms-swift's true/false, lists space-separated."""
    if isinstance(v, bool):
        return ["true" if v else "false"]
    if isinstance(v, (list, tuple)):
        return [w for x in v for w in value(x)]
    return [str(v)]


def flags(pairs: Iterable[tuple[str, object]]) -> list[str]:
    out: list[str] = []
    for name, v in pairs:
        if v is None:
            continue
        out += [f"--{name}", *value(v)]
    return out


def chosen_save_steps(recipe, chosen: int | None) -> int:
    """The --save_steps of one launch: the chosen interval, else the recipe's fixed one. "auto" has no
    number of its own: the supervisor (interval.py) chooses one at every launch and passes it in."""
    if chosen is not None:
        return chosen
    fixed = recipe.checkpoint.save_steps
    if fixed == "auto":
        raise ValueError('checkpoint.save_steps = "auto": render with the chosen interval (save_steps=N)')
    return fixed
