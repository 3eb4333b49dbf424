"""Recipe fuzzing: mutated recipes must load or fail with one clear RecipeError, never a traceback.

The shipped recipes (recipes/*.toml) and the minimal test recipe are mutated by hypothesis (a fixed,
derandomized search, so CI sees the same cases every run):

  data mutations   delete a key; add an unknown key (random identifier, near-miss typo of a real key,
                   unicode, empty); change a value's type (int/str/float/bool/list/table/date);
                   out-of-range numbers (0, negative, huge, beyond 64 bits, nan, +-inf); swap sections;
                   wrong nesting (key moved to another section, section nested in a section, key
                   hoisted to the top level, value wrapped in a table); random strings in enum fields;
                   extra_args flags (real ms-swift 4.x names, renamed/fictional ones from
                   flags.py REPLACEMENTS, recipe-managed ones, dashed/no_/abbreviated spellings,
                   random); unicode and NUL characters; empty strings/lists/tables; valid in-range
                   edits (so that a fair share of the cases load); `--set` overrides.
  text mutations   byte edits of the TOML text (delete/insert/duplicate/truncate, non-UTF-8 bytes).

`test_fuzz_load` (1,000 cases) calls orchestrator.config.recipe.load() in-process and, for the recipes that
load, orchestrator.ops.plan.plan(). Pass: a Recipe (and a JSON-serialisable plan), or a RecipeError whose
message is one line, starts with the file's path, and - unless the TOML itself does not parse - starts
with the dotted key or section of the first problem (an override error starts with `--set '<item>'`).
Any other exception fails the test. `test_fuzz_cli` sends 50 further cases through the real CLI in
subprocesses: `run` on an invalid recipe must exit 2 with one stderr line `orchestrator: error: ...`
and create nothing; `plan --json` on a valid one must exit 0 with parseable JSON. run.entrypoint is
["/bin/false"], so nothing could launch even if validation wrongly passed.

Run with `-s` to see how many cases were valid and which kinds of message the invalid ones got.
"""
from __future__ import annotations

import copy
import datetime as dt
import functools
import json
import math
import os
import re
import subprocess
import sys
import tomllib
import typing
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from recipes import MINIMAL, MODEL_CONFIG, RECIPES, ROOT, make_model
from orchestrator.ops.plan import plan as make_plan
from orchestrator.config import flags as F
from orchestrator.config.recipe import Recipe, RecipeError, apply_overrides, load
from orchestrator.config.render.command import rendering_problems
from orchestrator.types import GpuSnapshot

N_LOAD = 1000
N_CLI = 50

RECIPE_BYTES = tuple(p.read_bytes() for p in RECIPES)
BASES: list[tuple[str, dict]] = [(p.name, tomllib.loads(b.decode())) for p, b in zip(RECIPES, RECIPE_BYTES)] + [
    ("minimal", MINIMAL)]
SECTIONS: dict[str, type[BaseModel]] = {
    name: f.annotation for name, f in Recipe.model_fields.items()
    if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}
FIELD_NAMES = sorted({n for m in SECTIONS.values() for n in m.model_fields} | set(Recipe.model_fields))


def _literal_fields() -> dict[tuple[str, str], tuple[str, ...]]:
    out = {}
    for sec, model in SECTIONS.items():
        for name, f in model.model_fields.items():
            for arg in (f.annotation, *typing.get_args(f.annotation)):
                if typing.get_origin(arg) is typing.Literal:
                    out[(sec, name)] = typing.get_args(arg)
    return out


ENUMS = _literal_fields()
FLAG_NAMES = sorted(F.KNOWN["megatron"] | F.KNOWN["swift"])
RENAMED = sorted(set(F.REPLACEMENTS["megatron"]) | set(F.REPLACEMENTS["swift"]))
MANAGED = sorted(set(F.MANAGED["megatron"]) | set(F.MANAGED["swift"]))


# --- a TOML writer for arbitrary (mutated) data --------------------------------------------------

def _str(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, (dt.date, dt.time)):  # datetime is a date
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_str(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def to_toml(data: dict) -> str:
    """Top-level scalars first, then one [table] per top-level table (deeper tables inline)."""
    lines = [f"{_str(k)} = {_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(f"[{_str(k)}]")
            lines += [f"{_str(kk)} = {_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


# --- strategies -----------------------------------------------------------------------------------

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)  # no lone surrogates: not UTF-8
IDENT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
HUGE = [2**63 - 1, -(2**63), 2**63, 2**64 + 1, 10**30, -(10**30)]
SPECIAL_FLOATS = [0.0, -0.0, -1.0, 1e308, 5e-324, -1e-300, math.inf, -math.inf, math.nan]

scalar = st.one_of(
    st.integers(-1000, 10**6), st.sampled_from(HUGE + [0, -1, 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(SPECIAL_FLOATS),
    st.booleans(), TEXT, st.sampled_from(["", " ", "\x00", "é", "😀", "megatron", "swift", "true", "1e-4", "8"]),
    st.dates(), st.times(),
)
any_value = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(IDENT, TEXT), inner, max_size=3)), max_leaves=5)


def pick(draw, seq):
    """draw(st.sampled_from(seq)), with the strategy cached by hypothesis when seq is hashable (fast)."""
    seq = tuple(seq)
    try:
        hash(seq)
    except TypeError:
        return draw(st.sampled_from(seq))
    return draw(_sampled(seq))


@functools.lru_cache(maxsize=4096)
def _sampled(seq: tuple) -> st.SearchStrategy:
    return st.sampled_from(seq)


def typo(name: str, draw) -> str:
    """A near miss of a real key: one character deleted, doubled, swapped or changed, or case."""
    if not name:
        return "x"
    i = draw(st.integers(0, len(name) - 1))
    kind = pick(draw, ["del", "dup", "swap", "sub", "case", "dash", "plural"])
    if kind == "del":
        return name[:i] + name[i + 1:] or "x"
    if kind == "dup":
        return name[:i] + name[i] + name[i:]
    if kind == "swap" and i + 1 < len(name):
        return name[:i] + name[i + 1] + name[i] + name[i + 2:]
    if kind == "case":
        return name.upper() if name.islower() else name.lower() + "X"
    if kind == "dash":
        return name.replace("_", "-") if "_" in name else name + "-"
    if kind == "plural":
        return name + "s"
    return name[:i] + pick(draw, "abcdefghijklmnopqrstuvwxyz_0") + name[i + 1:]


def _tables(d: dict, prefix=()) -> list[tuple]:
    out = [prefix]
    for k, v in d.items():
        if isinstance(v, dict):
            out += _tables(v, prefix + (k,))
    return out


def _leaves(d: dict, prefix=()) -> list[tuple]:
    out = []
    for k, v in d.items():
        out += _leaves(v, prefix + (k,)) if isinstance(v, dict) and v else [prefix + (k,)]
    return out


def _get(d: dict, path: tuple):
    for k in path:
        d = d[k]
    return d


def _set(d: dict, path: tuple, value) -> None:
    _get(d, path[:-1])[path[-1]] = value


def other_type(v, draw):
    kinds = ["int", "str", "float", "bool", "list", "table", "date", "empty"]
    kind = pick(draw, kinds)
    if kind == "int":
        return int(v) if isinstance(v, float) and math.isfinite(v) and abs(v) < 1e18 else draw(st.integers(-5, 100))
    if kind == "str":
        return str(v) if not isinstance(v, (dict, list)) else draw(TEXT)
    if kind == "float":
        return float(v) if isinstance(v, int) else draw(st.floats(-10, 1e4))
    if kind == "bool":
        return bool(v) if isinstance(v, (int, float)) else draw(st.booleans())
    if kind == "list":
        return [v] if not isinstance(v, list) else [draw(scalar)]
    if kind == "table":
        return {"value": v}
    if kind == "date":
        return draw(st.dates())
    return pick(draw, ["", [], {}])


def out_of_range(draw):
    return draw(st.one_of(st.sampled_from([0, -1, -8, 0.0, -0.5, 1.0, 2.0] + HUGE + SPECIAL_FLOATS),
                          st.integers(-(2**70), 2**70)))


# In-range edits, so that a fair share of the mutated recipes still load.
VALID_EDITS: list[tuple[tuple[str, str], st.SearchStrategy]] = [
    (("lora", "rank"), st.sampled_from([4, 8, 16, 64])),
    (("lora", "alpha"), st.integers(1, 128)),
    (("lora", "dropout"), st.floats(0, 0.5)),
    (("checkpoint", "save_steps"), st.integers(1, 10**6)),
    (("checkpoint", "logging_steps"), st.integers(1, 100)),
    (("checkpoint", "keep_persistent"), st.integers(1, 10)),
    (("supervisor", "wait_s"), st.floats(0, 1e4)),
    (("supervisor", "hang_timeout_s"), st.floats(1, 1e5)),
    (("supervisor", "max_crashes_per_hour"), st.integers(1, 100)),
    (("optim", "lr"), st.floats(1e-8, 1.0)),
    (("optim", "seed"), st.integers(-(2**31), 2**31)),
    (("data", "max_length"), st.integers(1, 2**17)),
    (("data", "packing"), st.booleans()),
    (("run", "name"), st.from_regex(r"[A-Za-z0-9_.-]{1,20}", fullmatch=True)),
    (("run", "on_drift"), st.sampled_from(["fresh", "refuse", "resume"])),
    (("model", "torch_dtype"), st.sampled_from(["bfloat16", "float16", "float32"])),
    (("env", "vars"), st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True), TEXT.filter(
        lambda s: "\x00" not in s), max_size=2)),
    (("metrics", "listen"), st.sampled_from(["127.0.0.1:0", "0.0.0.0:9400", "[::1]:9401"])),
]


EXTRA_VALUE = st.one_of(st.booleans(), st.integers(-5, 10**4), st.floats(0, 10), TEXT, st.lists(TEXT, max_size=3),
                        st.just([]), any_value)
UNICODE_VALUE = st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2),
                          st.sampled_from(["ünïcödé", "模型", "😀/x", "a\x00b", "\u202e", "\ufeff", "/" + "a" * 300 + "/x",
                                           "b" * 5000]))
_SIZES = st.sampled_from([1, 1, 2, 3, 4, 8, 16])
# parallel sizes, batch sizes and backend-specific combinations (the model validator's territory)
LAYOUT = [("parallel", "nproc_per_node", st.sampled_from([1, 2, 4, 8])),
          ("parallel", "tensor", _SIZES), ("parallel", "pipeline", _SIZES),
          ("parallel", "context", _SIZES), ("parallel", "expert", _SIZES),
          ("parallel", "expert_tensor", _SIZES), ("parallel", "sequence_parallel", st.booleans()),
          ("optim", "micro_batch_size", _SIZES), ("optim", "global_batch_size", _SIZES),
          ("optim", "epochs", st.sampled_from([1.0, 2.0, 0.5])),
          ("optim", "iterations", st.sampled_from([1, 100])),
          ("optim", "min_lr", st.sampled_from([0.0, 1e-6, 1.0])),
          ("memory", "recompute_granularity", st.sampled_from(["full", "selective", "none"])),
          ("memory", "recompute_method", st.sampled_from(["uniform", "block"])),
          ("memory", "optimizer_cpu_offload", st.booleans()),
          ("checkpoint", "merge_lora", st.booleans()),
          ("lora", "target_parameters", st.sampled_from([[], ["experts.gate_up_proj"]])),
          ("model", "num_experts", st.sampled_from([8, 12, 16, 128])),
          ("run", "backend", st.sampled_from(["megatron", "swift"]))]


def mutate(d: dict, draw, stats: Counter, only: tuple[str, ...] = ()) -> None:
    kind = pick(draw, only) if only else pick(draw, [
        "delete", "add_unknown", "change_type", "out_of_range", "swap_sections", "wrong_nesting", "enum",
        "extra_args", "extra_args", "unicode", "empty", "layout", "layout", "valid_edit", "valid_edit", "valid_edit"])
    stats[f"mutation:{kind}"] += 1
    leaves = _leaves(d)
    if kind == "delete" and leaves:
        path = pick(draw, leaves + [(k,) for k in d])
        del _get(d, path[:-1])[path[-1]]
    elif kind == "add_unknown":
        where = pick(draw, _tables(d))
        how = pick(draw, ["ident", "text", "typo", "typo", "odd"])
        key = (draw(IDENT) if how == "ident" else draw(TEXT) if how == "text"
               else typo(pick(draw, FIELD_NAMES), draw) if how == "typo"
               else pick(draw, ["", " ", "a.b", "ü", "\n", "run", "optim"]))
        _get(d, where)[key] = draw(any_value)
    elif kind == "change_type" and leaves:
        path = pick(draw, leaves)
        _set(d, path, other_type(_get(d, path), draw))
    elif kind == "out_of_range":
        path = pick(draw, leaves + [(s, f) for s in ("parallel", "optim", "lora", "checkpoint",
                                                              "supervisor", "data", "gpu") for f in
                                              SECTIONS[s].model_fields])
        node = d
        for k in path[:-1]:
            node = node.setdefault(k, {}) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[path[-1]] = out_of_range(draw)
    elif kind == "swap_sections":
        tops = [k for k, v in d.items() if isinstance(v, dict)]
        if len(tops) >= 2:
            a, b = draw(st.lists(st.sampled_from(tops), min_size=2, max_size=2, unique=True))
            if draw(st.booleans()):
                d[a], d[b] = d[b], d[a]
            else:  # rename: one section's keys under another's name
                d[b] = d.pop(a)
    elif kind == "wrong_nesting" and leaves:
        how = pick(draw, ["move", "nest_section", "hoist", "wrap"])
        tops = [k for k, v in d.items() if isinstance(v, dict)]
        path = pick(draw, leaves)
        if how == "move" and tops:
            value = _get(d, path)
            del _get(d, path[:-1])[path[-1]]
            d.setdefault(pick(draw, tops), {})[path[-1]] = value
        elif how == "nest_section" and len(tops) >= 2:
            a, b = draw(st.lists(st.sampled_from(tops), min_size=2, max_size=2, unique=True))
            d[b][a] = d.pop(a)
        elif how == "hoist":
            value = _get(d, path)
            del _get(d, path[:-1])[path[-1]]
            d[path[-1]] = value
        else:
            _set(d, path, {path[-1]: _get(d, path)})
    elif kind == "enum":
        (sec, key), choices = pick(draw, sorted(ENUMS.items()))
        how = pick(draw, ["text", "typo", "near"])
        v = (draw(TEXT) if how == "text" else typo(pick(draw, choices), draw) if how == "typo"
             else pick(draw, [c.upper() for c in choices] + [c + " " for c in choices] + list(choices)))
        if isinstance(d.get(sec, {}), dict):
            d.setdefault(sec, {})[key] = v
    elif kind == "extra_args":
        flag = pick(draw, FLAG_NAMES)
        how = pick(draw, ["known", "known", "renamed", "managed", "dashed", "no_", "abbrev", "typo",
                                    "ident", "text"])
        name = (flag if how == "known" else pick(draw, RENAMED) if how == "renamed" else
                pick(draw, MANAGED) if how == "managed" else "--" + flag.replace("_", "-") if how == "dashed" else
                "no_" + flag if how == "no_" else flag[: max(1, len(flag) // 2)] if how == "abbrev" else
                typo(flag, draw) if how == "typo" else draw(IDENT) if how == "ident" else draw(TEXT))
        value = draw(EXTRA_VALUE)
        if not isinstance(d.get("extra_args", {}), dict):
            d["extra_args"] = {}
        d.setdefault("extra_args", {})[name] = value
    elif kind == "unicode" and leaves:
        path = pick(draw, leaves)
        _set(d, path, draw(UNICODE_VALUE))
    elif kind == "empty" and leaves:
        path = pick(draw, leaves + [(k,) for k in d])
        _set(d, path, pick(draw, ["", [], {}, [""]]))
    elif kind == "layout":  # parallel sizes, batch sizes and backend-specific combinations
        for sec, key, strat in LAYOUT:
            if pick(draw, range(4)) == 3 and isinstance(d.get(sec, {}), dict):
                if draw(st.booleans()):
                    d.setdefault(sec, {})[key] = draw(strat)
                else:
                    d.get(sec, {}).pop(key, None)
    elif kind == "valid_edit":
        (sec, key), strat = pick(draw, VALID_EDITS)
        if isinstance(d.get(sec, {}), dict):
            d.setdefault(sec, {})[key] = draw(strat)


OVERRIDE = st.one_of(
    st.tuples(st.sampled_from(["optim.lr", "lora.rank", "checkpoint.save_steps", "run.name", "parallel.expert",
                               "env.vars.NCCL_DEBUG", "extra_args.moe_aux_loss_coeff", "optim.lrr", "a.b.c",
                               "run.name.first", "optim"]),
              st.sampled_from(["1e-4", "16", "x", "true", "[1, 2]", '"s"', "", "{a = 1}", "nan", "2024-01-01",
                               "99999999999999999999999"])).map(lambda kv: f"{kv[0]}={kv[1]}"),
    TEXT)


def text_mutations(raw: bytes, draw) -> bytes:
    for _ in range(draw(st.integers(1, 3))):
        if not raw:
            break
        i = draw(st.integers(0, len(raw) - 1))
        op = pick(draw, ["delete", "insert", "insert", "dup_line", "truncate", "replace"])
        if op == "delete":
            raw = raw[:i] + raw[i + draw(st.integers(1, 4)):]
        elif op == "insert":
            ins = pick(draw, [b"[", b"]", b"=", b'"', b"'", b"{", b"}", b",", b".", b"#", b"\n", b"\\",
                                        b"\xff", b"\x00", b" = 1\n", b"\n[run]\n", "é".encode()])
            raw = raw[:i] + ins + raw[i:]
        elif op == "dup_line":
            start = raw.rfind(b"\n", 0, i) + 1
            end = raw.find(b"\n", i)
            end = len(raw) if end < 0 else end + 1
            raw = raw[:end] + raw[start:end] + raw[end:]
        elif op == "truncate":
            raw = raw[:i]
        else:
            raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1:]
    return raw


# --- the properties -------------------------------------------------------------------------------

def draw_case(draw, stats: Counter) -> tuple[bytes, list[str], dict | None]:
    """-> (recipe file bytes, overrides, the data the text encodes or None if a text mutation was made)."""
    name, base = pick(draw, BASES)
    stats[f"base:{name}"] += 1
    d = copy.deepcopy(base)
    for _ in range(draw(st.integers(0, 3))):
        mutate(d, draw, stats)
    text = to_toml(d)
    assert _same(tomllib.loads(text), d), "the test's TOML writer lost data"
    raw = text.encode()
    if pick(draw, range(10)) == 9:  # 10 %: edit the file's bytes
        stats["mutation:toml_text"] += 1
        src = raw if draw(st.booleans()) else pick(draw, RECIPE_BYTES)
        return text_mutations(src, draw), [], None
    overrides = draw(st.lists(OVERRIDE, min_size=1, max_size=2)) if pick(draw, range(10)) == 9 else []
    return raw, overrides, d


def _parses(raw: bytes) -> bool:
    try:
        tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return True


_BOUNDARY = re.compile(r"$|[:. /\[]")


def _esc(key: str) -> str:
    """How RecipeError shows a key: control and other unprintable characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(key))


def names_the_key(rest: str, data: dict) -> bool:
    """`rest` (the message after '<file>: ') starts with a top-level key or section, and when it goes on
    with `.key`, that key is a field of the section or present in the recipe."""
    def starts(s: str, prefix: str) -> bool:
        return s.startswith(prefix) and bool(_BOUNDARY.match(s, len(prefix)))

    tops = sorted({*Recipe.model_fields, *(_esc(k) for k in data)}, key=len, reverse=True)
    top = next((t for t in tops if starts(rest, t)), None)
    if top is None:
        return False
    tail = rest[len(top):]
    if not tail.startswith(".") or top not in SECTIONS:
        return True
    tail = tail[1:]
    subs = set(SECTIONS[top].model_fields)
    if isinstance(data.get(top), dict):
        subs |= {_esc(k) for k in data[top]}
    return any(starts(tail, s) for s in subs)


CATEGORIES = [
    ("TOML syntax error", "TOML syntax error"), ("not UTF-8", "not UTF-8"),
    ("--set syntax", r"^--set .*(expected dotted|is not a table)"),
    ("unknown key", "unknown key"), ("required key missing", "required key is missing"),
    ("NUL character", "NUL character"), ("integer beyond 64 bits", "64-bit"), ("nested too deeply", "too deeply"),
    ("not finite (inf/nan)", "finite number"),
    ("out of range", r"should be (greater|less) than"),
    ("not an allowed value (enum)", r"Input should be '"),
    ("wrong type", r"Input should be a valid|valid (dictionary|list|string|integer|number|boolean)"),
    ("bad format (pattern)", "should match pattern"),
    ("list length", r"should have at (least|most)"),
    ("extra_args: not an ms-swift flag", r"extra_args\..*is not an ms-swift"),
    ("extra_args: set by the recipe/orchestrator", r"extra_args\..*(rendered from the recipe|cannot be given|already "
                                                   r"rendered)"),
    ("extra_args: empty list/flag", r"extra_args\..*(empty list|empty flag)"),
    ("parallel layout / divisibility", r"divisible|does not divide|needs parallel|parallelism needs"),
    ("epochs/iterations", r"optim\.epochs|optim: give exactly one"),
    ("min_lr > lr", r"optim\.min_lr .* is larger"),
    ("recompute needs full", r"memory\.recompute_method/recompute_num_layers need"),
    ("backend combination", r"megatron|swift"),
    ("regex / env name / port", r"regular expression|environment variable|port|argument list"),
]


def category(msg: str) -> str:
    for name, pat in CATEGORIES:
        if re.search(pat, msg):
            return name
    return "other: " + msg[:80]


def check_load(path: Path, raw: bytes, overrides: list[str], data: dict | None, stats: Counter) -> bool:
    """Load in-process; on success also plan it. -> True if the recipe is valid."""
    path.write_bytes(raw)
    try:
        r = load(path, overrides, checks=[rendering_problems])
    except RecipeError as e:
        msg = str(e)
        assert "Traceback" not in msg, msg
        stats[f"invalid: {category(msg)}"] += 1
        for line in msg.splitlines():  # one line per problem, each naming where its value came from
            if line.startswith("--set "):
                assert overrides and any(line.startswith(f"--set {o!r}") for o in overrides), line
                continue
            assert line.startswith(f"{path}: "), line
            if _parses(raw):
                plain = tomllib.loads(raw.decode()) if data is None else data
                try:  # the first problem may be in the file, before the overrides are applied
                    plain = apply_overrides(plain, overrides)
                except RecipeError:
                    pass
                assert names_the_key(line[len(f"{path}: "):], plain), f"message does not name the key: {line}"
        return False
    # everything that loads must also plan (the memory estimate, render, checks) without a traceback
    p = make_plan(r, reader=_NoGpu())
    json.dumps(p)
    stats["valid"] += 1
    return True


class _NoGpu:
    def snapshot(self) -> GpuSnapshot:
        return GpuSnapshot(error="no GPU in the fuzz test")


def _workdir(tmp: Path) -> Path:
    make_model(tmp / "model", MODEL_CONFIG)
    (tmp / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return tmp / "recipe.toml"


def _print_stats(title: str, stats: Counter) -> None:
    print(f"\n{title}")
    for k, v in sorted(stats.items(), key=lambda kv: (kv[0].split(":")[0], -kv[1])):
        print(f"  {v:5d}  {k}")


def test_fuzz_load(tmp_path):
    path = _workdir(tmp_path)
    stats: Counter = Counter()

    @settings(max_examples=N_LOAD, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(st.data())
    def prop(data):
        raw, overrides, d = draw_case(data.draw, stats)
        stats["cases"] += 1
        check_load(path, raw, overrides, d, stats)

    prop()
    _print_stats("recipe fuzz (in-process load + plan)", stats)
    assert stats["cases"] >= 1000
    assert stats["valid"] >= 0.1 * stats["cases"], "too few mutated recipes load: the fuzzer tests little"
    invalid = sum(v for k, v in stats.items() if k.startswith("invalid: "))
    assert invalid >= 0.3 * stats["cases"]
    assert stats["invalid: TOML syntax error"] > 0 and stats["invalid: unknown key"] > 0


# --- through the real CLI -------------------------------------------------------------------------

def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def _cli_case(case_dir: Path, raw: bytes, valid: bool) -> tuple[str, str | None]:
    path = case_dir / "recipe.toml"
    before = sorted(p.name for p in case_dir.iterdir())
    if valid:
        res = _cli(["plan", str(path), "--json"], case_dir)
        problem = None if res.returncode in (0, 2) else f"plan exit {res.returncode}: {res.stderr[-2000:]}"
        if problem is None:
            try:  # exit 2: a pre-flight check that would stop `run` failed, and the plan says so
                if json.loads(res.stdout)["would_run"] != (res.returncode == 0):
                    problem = f"plan exit {res.returncode} but would_run is {not res.returncode}"
            except (ValueError, KeyError):
                problem = f"plan --json printed no plan: {res.stdout[:500]!r}"
    else:
        res = _cli(["run", str(path)], case_dir)
        lines = res.stderr.splitlines()
        problem = None
        if res.returncode != 2:
            problem = f"run on an invalid recipe: exit {res.returncode}: {res.stderr[-2000:]}"
        elif not lines or not all(ln.startswith("orchestrator: error: ") for ln in lines):
            problem = f"run: stderr is not `orchestrator: error:` lines: {res.stderr[-2000:]!r}"
        elif res.stdout:
            problem = f"run printed to stdout: {res.stdout[:500]!r}"
    if "Traceback" in res.stderr:
        problem = f"traceback: {res.stderr[-2000:]}"
    after = sorted(p.name for p in case_dir.iterdir())
    if problem is None and after != before:
        problem = f"{'plan' if valid else 'run'} created {set(after) - set(before)}"
    return ("valid" if valid else "invalid"), problem and f"{path}:\n{raw.decode(errors='replace')}\n{problem}"


def test_fuzz_cli(tmp_path):
    cases: list[tuple[Path, bytes, bool]] = []
    stats: Counter = Counter()

    @settings(max_examples=N_CLI, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(st.data())
    def collect(data):
        name, base = data.draw(st.sampled_from(BASES))
        d = copy.deepcopy(base)
        if isinstance(d.get("run"), dict):
            d["run"].update(entrypoint=["/bin/false"], output_dir="out", persistent_dir="persist")
        only = ("valid_edit",) if pick(data.draw, range(2)) else ()  # half the cases: in-range edits only
        for _ in range(data.draw(st.integers(1, 2))):
            mutate(d, data.draw, stats, only)
        raw = to_toml(d).encode()
        if data.draw(st.sampled_from(range(10))) == 9:
            raw = text_mutations(raw, data.draw)
        case_dir = tmp_path / f"case{len(cases):03d}"
        case_dir.mkdir()
        path = _workdir(case_dir)
        valid = check_load(path, raw, [], None if not _parses(raw) else tomllib.loads(raw.decode()), Counter())
        cases.append((case_dir, raw, valid))

    collect()
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda c: _cli_case(*c), cases))
    print(f"\nCLI fuzz: {Counter(kind for kind, _ in results)}")
    problems = [p for _, p in results if p]
    assert not problems, "\n\n".join(problems[:3])
    assert len(results) >= N_CLI


# --- what the fuzzer found (fixed in orchestrator/config/recipe.py): each one was a traceback or a two-line error ---

FOUND = [
    # (id, TOML text appended to / replacing parts of the minimal recipe, overrides, fragments of the message)
    ("toml-date-value", {"parallel": {"vas": dt.date(1800, 11, 2)}}, [], ["parallel.vas", "unknown key"]),
    ("toml-date-for-str", {"run": {"name": dt.date(1979, 5, 27)}}, [], ["run.name", "datetime.date(1979, 5, 27)"]),
    ("toml-time-with-set", {"run": {"name": dt.time(7, 32)}}, ["optim.lr=1e-5"], ["run.name"]),
    ("nul-in-persistent-dir", {"run": {"persistent_dir": "a\x00b"}}, [], ["run.persistent_dir", "NUL"]),
    ("nul-in-model-path", {"model": {"path": "mo\x00del"}}, [], ["model.path", "NUL"]),
    ("nul-in-dataset", {"data": {"dataset": ["./d\x00.jsonl"]}}, [], ["data.dataset.0", "NUL"]),
    ("nul-in-env-value", {"env": {"vars": {"X": "\x00"}}}, [], ["env.vars.X", "NUL"]),
    ("nul-in-extra-arg", {"extra_args": {"moe_aux_loss_coeff": "1\x00"}}, [], ["extra_args.moe_aux_loss_coeff", "NUL"]),
    ("nul-in-key", {"extra_args": {"a\x00b": 1}}, [], ["extra_args.a\\x00b", "NUL"]),
    ("nul-via-set", {}, ['run.output_dir="o\\u0000"'], ["--set 'run.output_dir=", "run.output_dir", "NUL"]),
    ("int-beyond-64-bit", {"data": {"max_length": 10**400}}, [], ["data.max_length", "64-bit"]),
    ("int-beyond-64-bit-via-set", {}, ["lora.rank=99999999999999999999999"],
     ["--set 'lora.rank=", "lora.rank", "64-bit"]),
    ("inf-lr", {"optim": {"lr": math.inf}}, [], ["optim.lr", "finite"]),
    ("inf-wait", {"supervisor": {"wait_s": math.inf}}, [], ["supervisor.wait_s", "finite"]),
    ("nan-extra-arg", {"extra_args": {"moe_aux_loss_coeff": math.nan}}, [], ["extra_args.moe_aux_loss_coeff"]),
    ("newline-in-key", {"model": {"\n": [0]}}, [], ["model.\\n: unknown key"]),
    ("newline-in-extra-flag", {"extra_args": {"a\nb": 1}}, [], ["extra_args.a\\nb"]),
    ("deep-table", {"extra_args": {"x": {"a": {"a": {"a": {"a": {"a": {"a": {"a": {"a": 1}}}}}}}}}}, [],
     ["extra_args.x.a.a.a.a.a.a.a", "nested too deeply"]),
]


@pytest.mark.parametrize("sections,overrides,fragments", [f[1:] for f in FOUND], ids=[f[0] for f in FOUND])
def test_found_by_the_fuzzer(tmp_path, sections, overrides, fragments):
    from recipes import merge

    path = _workdir(tmp_path)
    data = merge(MINIMAL, sections)
    path.write_text(to_toml(data))
    with pytest.raises(RecipeError) as e:
        load(path, overrides)
    msg = str(e.value)
    assert msg.startswith(f"--set {overrides[0]!r}: " if "--set " in fragments[0] else f"{path}: "), msg
    assert "\n" not in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)


@pytest.mark.parametrize("text", ["x = " + "[" * 2000 + "]" * 2000, "x = " + "{a=" * 2000 + "1" + "}" * 2000,
                                  "[" + ".".join(["a"] * 2000) + "]"])
def test_deep_nesting_is_an_error_not_a_recursion_error(tmp_path, text):
    path = tmp_path / "deep.toml"
    path.write_text(text + "\n")
    with pytest.raises(RecipeError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: ") and ("nested too deeply" in str(e.value))
    with pytest.raises(RecipeError):
        load(_workdir(tmp_path), ["optim.lr=" + "[" * 2000 + "]" * 2000])


# --- found by the fuzzer outside recipe.py (fixed in plan.py): ENAMETOOLONG escaped the pre-flight checks ---

@pytest.mark.parametrize("key", ["model.path", "run.output_dir", "run.persistent_dir", "data.dataset"])
def test_plan_survives_a_too_long_path(tmp_path, key):
    path = _workdir(tmp_path)
    d = copy.deepcopy(MINIMAL)
    sec, k = key.split(".")
    long = "/" + "a" * 300 + "/x.jsonl"
    d[sec][k] = [long] if k == "dataset" else long
    path.write_text(to_toml(d))
    json.dumps(make_plan(load(path), reader=_NoGpu()))
    res = _cli(["plan", str(path), "--json"], tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-1500:]  # the check fails, no crash
    assert json.loads(res.stdout)["would_run"] is False
