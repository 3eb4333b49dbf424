"""Crash classifier: one failed attempt's log (+ exit status, phase) -> Crash. Pure, no I/O.

Classification is data: RULES (crash_rules.py) is an ordered table; the first row (by priority) with a
qualifying line wins. Root causes sit above the cascades they trigger (one rank OOMs -> the others print NCCL
aborts, watchdog timeouts, torchrun SIGTERMs), so the class is the root cause wherever it is.
"""
from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

from orchestrator.domain.crash_rules import RULES, Rule
from orchestrator.types import Crash, CrashClass, ExitStatus, Phase

__all__ = ["WINDOW", "DEEP", "MAX_EVIDENCE", "Rule", "RULES", "classify", "strip_prefixes"]

WINDOW = 2 << 20   # the tail classified line by line
DEEP = 32 << 20    # before the tail, only fatal root causes are looked for (long cascades)
MAX_EVIDENCE = 5
_F = re.IGNORECASE | re.MULTILINE


# ---- line cleaning ----------------------------------------------------------------------------
_GLUED = re.compile(r"\[rank\d+\]:|\[default\d+\]:|\[\d+,\d+\]<std(?:out|err)>:")   # also mid-line (interleaved writes)
_LEADING = re.compile(r"""^\s*(?:
    \[rank\d+\]:|\[default\d+\]:|\[\d+,\d+\]<std(?:out|err)>:
  | [\w.-]+/\d+\s+(?=\[(?:default|rank)\d+\]:)                           # nemo-run 'i.pretrain/0 '
  | [\w.-]+:\s(?=\[(?:default|rank)\d+\]:)                               # pdsh 'node-1: [rank8]:'
  | (?:(?!(?:step|iter\w*|epoch|rank|batch)-)[a-z][\w.]*-\d+|(?:\d{1,3}\.){3}\d{1,3}):\s(?=\S)   # pdsh 'worker-1: '
  | \((?:[\w()\-.]+\s)?pid=\d+(?:,\s*ip=[\d.]+)?\)\s                       # ray '(TaskRunner pid=12) '
  | \[\d{1,7}\]\s+(?!(?:\d+\s+)?(?i:killed|done|exit|stopped|terminated|running|suspended)\b)(?=\S)  # line numbers '[1745] '
                                                                         # (not bash/zsh job lines '[1]  26478 killed')
  | \[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\]?(?:\s+|$)   # timestamps
  | \[[IWEF]\d{3,4}\s\d\d:\d\d:\d\d(?:\.\d+)?(?:\s+\d+)?\s+[\w./-]+:\d+\]\s*             # glog [E1206 ..]
  | [IWEF]\d{3,4}\s\d\d:\d\d:\d\d\.\d+\s+\d+\s+[\w./-]+:\d+\]\s*                      # torch elastic log
  | \[[IWEF]\s[\w./-]+:\d+\]\s*                                          # [E socket.cpp:462]
  | \d{1,4}:\s(?=\S)                                                     # srun --label '3: '
  | \*\*(?=\S)                                                           # markdown bold
  | `{1,3}(?=\S) | >\s(?=\S) | \[\d{1,3}(?:;\d{1,3})*m(?=\S)                 # markdown code/quote, bare ANSI
)""", re.VERBOSE)
_BOLD_END = re.compile(r"\*\*(?=\s|$)|`+$")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")                                        # colour codes
_TQDM_HEAD = re.compile(r"^(?:[^|\n]{0,80}?\d{1,3}%\|[^|\n]*\|[^\[\n]*\[[^\]\n]*\])+")
_TQDM_POSTFIX = re.compile(r",\s*([^\[\]\n]*\bloss[^\[\]\n]*)\]$", re.IGNORECASE)   # '[00:10<00:00, 9.5it/s, loss=2.3]'


def strip_prefixes(line: str) -> str:
    """Drop launcher/rank/timestamp prefixes, markdown bold and glued tqdm bars from one log line."""
    return _TQDM_HEAD.sub("", _unprefix(line)).strip()


def _unprefix(line: str) -> str:      # strip_prefixes minus the tqdm part (phase inference reads bars)
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    if "\r" in line:
        line = next((p for p in reversed(line.split("\r")) if p.strip()), "")
    for k in range(10):
        m = _LEADING.match(line)
        if m and m.end():
            line = line[m.end():]
        elif k < 9 and ("]:" in line or "<std" in line) and _GLUED.search(line):
            line = _GLUED.sub("", line)
        else:
            break
    return _BOLD_END.sub("", line).strip() if "**" in line or "`" in line else line.strip()


# ---- phase inference --------------------------------------------------------------------------
_STEP_RES = (   # group 1 = the step number (absent: any match is a step)
    re.compile(r"""['"](?:global_step/max_steps|iteration)['"]\s*:\s*['"]?\s*(\d+)\s*/\s*\d+"""),  # ms-swift
    re.compile(r"""[{,]\s*['"](?:loss|train_loss)['"]\s*:\s*['"]?[-+]?(?:\d|nan|inf)""", re.IGNORECASE),    # HF dicts
    re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|"),                                          # Megatron-LM
    re.compile(r"\biter\s+\d+\s+step\s+(\d+)\s*:"),                                              # litgpt
    re.compile(r"\bstep=(\d+), skipped=\d+"),                                                    # DeepSpeed
    re.compile(r"(?:^|\s)step:(\d+) - \S+:"),                                                    # verl
    re.compile(r"\b(?:reduced_)?train_loss[=:]\s*[-+]?\d|\bglobal_step[=:]\s*(\d+)"),              # NeMo/Lightning
    re.compile(r"^Epoch\s*[:#]?\s*\[?(?![01]\b)(\d+)\b(?!\]\s*\[)"),   # 'Epoch 18' ('Epoch 1/3' may open the 1st)
    re.compile(r"^Epoch:?\s*\[\d+\]\s*\[\s*(\d+)/\d+\]"),                                          # timm/mmcv
    re.compile(r"\b(?:step|iter(?:ation)?|epoch)\b\W{0,3}\d+.*\bloss\b\W{0,3}[-+]?\d", re.IGNORECASE),  # generic
)
_TQDM = re.compile(r"(?:^|\])([^|]{0,60}?)\s*\d{1,3}%\|[^|]*\|\s*(\d+)/\d+\s*\[[^\]]*\]")
_TQDM_TRAIN = re.compile(r"train|epoch|iter|step", re.IGNORECASE)
_TQDM_NOT = re.compile(r"eval|valid|test|load|map|token|download|generat|process|convert|sav|export|infer|"
                       r"predict|sampl|filter|shard|fetch|pack|shuffl|build|compil", re.IGNORECASE)
_DEEP_STEP_MARKS = ("global_step/max_steps", "'iteration': '", '"iteration": "', "consumed samples:", "{'loss': ", '{"loss": ')
_FINITE = re.compile(r"""['"]loss['"]\s*:\s*['"]?[-+]?\d|\blm loss:\s*[-+]?\d|\bstep \d+: loss [-+]?\d|\bloss\s*[=:]\s*[-+]?\d"""
                     r"|\[\s*loss\s*\]\s*[-+]?\d",
                     re.IGNORECASE)


def _zero_bar(line: str) -> bool:
    """A training progress bar that has not completed a step ('Train:   0%|   | 0/400 [00:00<?, ?it/s]')."""
    return any(m.group(2) == "0" and not _TQDM_NOT.search(d := m.group(1).strip()) and (not d or _TQDM_TRAIN.search(d))
               for m in _TQDM.finditer(line))


def _step_line(line: str) -> bool:
    for rx in _STEP_RES:
        m = rx.search(line)
        if m and (m.lastindex is None or int(m.group(1)) > 0):
            return True
    return any(int(m.group(2)) > 0 and not _TQDM_NOT.search(d := m.group(1).strip()) and (not d or _TQDM_TRAIN.search(d))
               for m in _TQDM.finditer(line))   # a bare bar (HF) or a training one, not 'Loading checkpoint shards'


def _infer_phase(text: str, start: int, lines: list[str]) -> tuple[Phase, str | None]:
    for s in reversed(lines):
        if ("loss" in s or "iter" in s or "step" in s or "Epoch" in s or "%|" in s) and _step_line(s):
            return Phase.TRAINING, strip_prefixes(s) or s
    if any(text.find(m, max(0, start - DEEP), start) != -1 for m in _DEEP_STEP_MARKS):
        return Phase.TRAINING, None
    return Phase.UNKNOWN, None


# ---- conditions: (ctx, line index) -> False, True, or the line that satisfied it (more evidence) ----
_FRAME_FN = re.compile(r'^File ".*", line \d+, in (\S+)')
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*:(?:\s|$)")
# flash-linear-attention frames (paths, module names, its backward kernels; not mamba_ssm's _chunk_*_bwd).
_FLA = re.compile(r"[/\\]fla[/\\]|\bfla\.(?:ops|layers|modules)\b|\bchunk_(?:gated_)?delta_rule_bwd\w*|\bchunk_bwd_d\w+"
                  r"|\bprepare_wy_repr_bwd\b")
_BWD = re.compile(r"backward|_bwd\b|_bwd_")
_SAVE = re.compile(r"torch[/.]serialization|torch\.save|\bsave_checkpoint|\bsave_pretrained|\b_save\b|safetensors|"
                   r"Saving model checkpoint", re.IGNORECASE)
# Frame names of model loading / optimizer and engine set-up; anchored, because e.g. transformers'
# load_balancing_loss_func and HF's _prepare_inputs run inside every training step.
_STARTUP_FN = re.compile(r"^(?:from_pretrained|_*load(?!_balanc)(?:_\w+)?|setup_model_and_optimizer|get_model(?:_tokenizer)?"
                         r"|model_provider\w*|build_model|initialize(?:_optimizer_states|_megatron)?|_configure_\w*optimizer"
                         r"|_configure_distributed_model|init_process_group|_broadcast_model|broadcast_params"
                         r"|_?prepare(?:_model\w*|_deepspeed|_fsdp)?|to|cuda|_apply|to_mcore|convert_hf\w*|_?init_weights"
                         r"|reset_parameters|_setup_for_real_optimizer|init_model|_build_(?:rollout|model\w*|optimizer)"
                         r"|init_workers|profile_run|determine_num_available_blocks|_initialize_kv_caches|_materialize\w*"
                         r"|_init_param_handle_from_module|_sync_module_states|_sync_params_and_buffers"
                         r"|_verify_param_shape_across_processes|_wrap_model|fully_shard|capture_model|_dummy_(?:sampler_)?run"
                         r"|_?prepare_vllm\w*)$")
_STARTUP_CODE = re.compile(r"cublasCreate|Failed to CUDA (?:calloc|malloc)|deepspeed\.initialize\(|from_pretrained\(")
# Checkpoint saves (and their async writers) and evaluations only happen after completed steps.
_TRAIN_FN = re.compile(r"backward|train_step|training_step|_inner_training_loop|forward_backward|forward_step|"
                       r"compute_loss|^train$|^step$|^forward$|^_forward$|train_one_epoch|^fit$|loss_func|save|"
                       r"update_actor|update_policy|compute_log_prob|generate_sequences|preload_tensors|evaluat|"
                       r"prediction_step|^_prepare_inputs$|_generate_and_score")
_TRAIN_CODE = re.compile(r"\.backward\(|\.train\(|train_step\(|training_step\(|saving checkpoint at iteration\s+[1-9]"
                         r"|Saving model checkpoint to|\bsave_checkpoint\(", re.IGNORECASE)


@dataclass
class _Ctx:
    lines: list[str]
    phase: Phase                 # given, or inferred from the text
    last_finite: int             # index of the last progress line with a finite loss (-1: none)
    killed: bool = False         # the process died of SIGKILL (exit status)
    zero_bar: bool = False       # with no step evidence: a training bar still at step 0
    memo: dict[str, bool] = field(default_factory=dict)   # whole-log facts, computed once

    def anywhere(self, name: str, rx: re.Pattern[str], keywords: tuple[str, ...]) -> bool:
        """Whether any line (holding one of the keywords) matches rx; cached per log."""
        if (hit := self.memo.get(name)) is None:
            hit = self.memo[name] = any(rx.search(s) for s in self.lines if any(k in s.lower() for k in keywords))
        return hit

    def window(self, i: int, before: int, after: int) -> list[str]:
        return self.lines[max(0, i - before): i + after + 1]


def _fla(ctx: _Ctx, i: int) -> bool | str:
    win = ctx.window(i, 60, 0)
    frames = [s for s in win if _FLA.search(s)]
    return bool(frames) and any(_BWD.search(s) for s in win) and frames[-1]


def _startup(ctx: _Ctx, i: int) -> bool | str:
    if ctx.phase is not Phase.UNKNOWN:
        return ctx.phase is Phase.STARTUP
    startup: bool | str = False
    training = False
    for s in ctx.window(i, 60, 40):
        fn = m.group(1) if (m := _FRAME_FN.match(s)) else ""
        if not startup and ((fn and _STARTUP_FN.search(fn)) or _STARTUP_CODE.search(s)):
            startup = s
        training = training or bool(fn and _TRAIN_FN.search(fn)) or bool(_TRAIN_CODE.search(s))
    # Loader frames win, then a training bar still at 0/N (no step completed yet: the first forward/backward
    # OOMed); with no evidence at all it is a start-up OOM too.
    return startup or ctx.zero_bar or not training


_OTHER_EXIT = re.compile(r"exits with return code = (?!-9\b)-?\d+")   # DeepSpeed's launcher names the real exit
_CONDITIONS: dict[str, Callable[[_Ctx, int], bool | str]] = {
    "not_training": lambda ctx, i: ctx.phase is not Phase.TRAINING,
    "save_context": lambda ctx, i: any(_SAVE.search(s) for s in ctx.window(i, 40, 5)),
    "fla_context": _fla,
    "startup_context": _startup,
    "no_recovery": lambda ctx, i: i > ctx.last_finite,
    "after_finite": lambda ctx, i: 0 <= ctx.last_finite < i,
    "not_killed": lambda ctx, i: not ctx.killed,
    "no_timeout": lambda ctx, i: not ctx.anywhere("timeout", _COMPILED["nccl_timeout_hang"][0], _RULE_KW["nccl_timeout_hang"]),
    "no_other_exit": lambda ctx, i: not ctx.anywhere("other_exit", _OTHER_EXIT, ("return code",)),
}

# ---- engine -----------------------------------------------------------------------------------
_RULE_KW: dict[str, tuple[str, ...]] = {r.name: r.keywords for r in RULES}
_COMPILED: dict[str, tuple[re.Pattern, list[re.Pattern], re.Pattern | None]] = {r.name: (re.compile("|".join(f"(?:{p})" for p in r.patterns), _F), [re.compile(p, _F) for p in r.patterns],
                      re.compile("|".join(r.exclude), _F) if r.exclude else None) for r in RULES}
# When the tail shows only a cascade, fatal roots are looked for in the DEEP bytes before it with
# raw str.find needles (cheap on tens of MB); the context around each first hit then goes through RULES.
_DEEP_NEEDLES = ("out of memory", "OutOfMemoryError", "_ALLOC_FAILED", "illegal memory access", "uncorrectable ECC",
                 "Xid", "device-side assert", "unspecified launch failure", "No space left", "PytorchStreamWriter",
                 "file write failed", "Disk quota exceeded")
_CASCADE = frozenset({CrashClass.NCCL_ERROR, CrashClass.NCCL_TIMEOUT_HANG, CrashClass.HOST_OOM_KILLED, CrashClass.OTHER})
_DIGITS = re.compile(r"\d+")


def classify(text: str, exit: ExitStatus | None = None, phase: Phase | None = None) -> Crash:
    """Classify one failed attempt from its combined stdout+stderr (see RULES for the order)."""
    start = max(0, len(text) - WINDOW)
    if start:
        start = text.find("\n", start) + 1 or start
    lines = _clean(text[start:])
    step_line = None
    if phase is None or phase is Phase.UNKNOWN:
        phase, step_line = _infer_phase(text, start, lines)
    crash = _run(lines, phase, exit, step_line)
    if start and crash.cls in _CASCADE and (deep := _deep_lines(text, start)):
        crash = _run(deep + lines, phase, exit, step_line)
    if crash.cls is CrashClass.OTHER and len(crash.evidence) < MAX_EVIDENCE and (rank := _failing_rank(text, lines, crash)):
        crash = Crash(crash.cls, (*crash.evidence, f"failing rank: {rank}"), crash.phase)
    return crash


_NCCL_TRACE = re.compile(r"\.(?:cc|cu|h|cpp):\d+ -> [1-6]\s*$")   # NCCL INFO's error trace frame


def _clean(chunk: str) -> list[str]:
    # splitlines also splits tqdm's \r redraws; NCCL INFO lines report no failure but their error trace.
    return [s for s in map(_unprefix, chunk.splitlines()) if "NCCL INFO" not in s or _NCCL_TRACE.search(s)]


def _deep_lines(text: str, start: int) -> list[str]:
    lo = max(0, start - DEEP)
    out: list[str] = []
    end = lo
    for p in sorted({p for kw in _DEEP_NEEDLES if (p := text.find(kw, lo, start)) != -1}):
        a = max(text.rfind("\n", lo, max(lo, p - 8000)) + 1, end)
        b = text.find("\n", min(p + 4000, start), start)
        b = start if b == -1 else b
        if a < b:
            out += _clean(text[a:b])
            end = b
    return out


def _candidates(keywords: tuple[str, ...], low: str, starts: list[int]) -> list[int]:
    """Indices of the lines holding a keyword (str.find on the lowered text: far cheaper than regexes)."""
    found: set[int] = set()
    for kw in keywords:
        p = low.find(kw)
        while p != -1:
            i = bisect_right(starts, p) - 1
            found.add(i)
            p = low.find(kw, starts[i + 1])
    return sorted(found)


def _strip_bar(line: str) -> str:
    """A glued tqdm head goes; a bar alone keeps its loss postfix (Lightning's 'loss=nan' is the only NaN sign)."""
    head = _TQDM_HEAD.match(line)
    if not head:
        return line
    rest = line[head.end():].strip()
    return rest or ((m := _TQDM_POSTFIX.search(head.group())) and m.group(1).strip()) or ""


def _run(raw: list[str], phase: Phase, exit: ExitStatus | None, step_line: str | None) -> Crash:
    lines = [_strip_bar(s) if "%|" in s else s for s in raw]
    nan_rx = _COMPILED["nan_progress"][0]
    last_finite = next((i for i in range(len(lines) - 1, -1, -1)
                        if ("loss" in lines[i] or "Loss" in lines[i]) and _FINITE.search(lines[i])
                        and not nan_rx.search(lines[i])), -1)
    zero_bar = phase is Phase.UNKNOWN and any("%|" in s and _zero_bar(s) for s in raw)
    ctx = _Ctx(lines, phase, last_finite, killed=exit is not None and exit.killed_by == 9, zero_bar=zero_bar)
    # Source lines quoted under a traceback frame are code, not messages ("raise ValueError(...)").
    code = {i + 1 for i, s in enumerate(lines[:-1]) if s.startswith("File ") and _FRAME_FN.match(s)
            and not _EXC_LINE.match(lines[i + 1])}
    low = "\n".join(lines).lower()
    starts = list(accumulate((len(s) + 1 for s in lines), initial=0))
    for rule in RULES:
        combined, singles, exclude = _COMPILED[rule.name]
        hits: list[tuple[int, int, str]] = []      # (pattern index, line index, line): most decisive first
        extra: list[str] = []                      # lines named by conditions
        memo: dict[str, bool] = {}                 # cascades repeat the same lines rank after rank
        keys: set[str] = set()                     # the same message from 8 ranks counts once
        fails: dict[str, int] = {}
        for i in _candidates(rule.keywords, low, starts):
            s = lines[i]
            if i in code:
                continue
            if (ok := memo.get(s)) is None:
                ok = memo[s] = bool(combined.search(s)) and not (exclude and exclude.search(s))
            if not ok or (key := _DIGITS.sub("#", s)) in keys or fails.get(key, 0) > 20:
                continue
            if not all(found := [_CONDITIONS[c](ctx, i) for c in rule.requires]):
                fails[key] = fails.get(key, 0) + 1
                continue
            keys.add(key)
            extra += [f for f in found if isinstance(f, str) and f not in extra]
            hits.append((next(k for k, rx in enumerate(singles) if rx.search(s)), i, s))
        if hits:
            hits.sort()
            if step_line and rule.cls is CrashClass.OOM_DURING_TRAINING:
                extra.append(step_line)
            evidence = [s for _, _, s in hits[:MAX_EVIDENCE - min(2, len(extra))]] + extra[:2]
            return Crash(rule.cls, tuple(s[:500] for s in evidence), phase)
        if rule.exit_signal is not None and exit is not None and exit.killed_by == rule.exit_signal:
            return Crash(rule.cls, (f"trainer process ended with {exit}",), phase)
    # Nothing matched: the last error-looking lines still say more than the last line does.
    evidence = _error_lines(lines, code) or [s for s in lines[-1:] if s] or [next((s for s in reversed(lines) if s), "")]
    evidence = [s for s in evidence if s] + ([f"trainer process ended with {exit}"] if exit is not None else [])
    return Crash(CrashClass.OTHER, tuple(s[:500] for s in evidence), phase)


def says_why(text: str) -> bool:
    """Tells whether a log's end shows an error at all (an exception, an error-looking line) or a rule's match:
    a log that does not ends as a SIGKILL leaves it, its process gone with no word (what watch mode judges a
    trainer by when its exit status is unknown)."""
    if classify(text).cls is not CrashClass.OTHER:
        return True
    start = max(0, len(text) - WINDOW)
    lines = _clean(text[start:])
    code = {i + 1 for i, s in enumerate(lines[:-1]) if s.startswith("File ") and _FRAME_FN.match(s)
            and not _EXC_LINE.match(lines[i + 1])}
    return bool(_error_lines(lines, code))


# ---- evidence when no rule decided: the last error-looking lines and the failing rank ------------
_EXC_TYPE = re.compile(r"^(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception|Interrupt|Failure)\b(?::|$)")
_ERRORISH = re.compile(r"\b(?:errors?|failed|failure|fatal|abort(?:ed|ing)?|terminate called|segmentation fault|core dumped"
                       r"|killed|timed out|exitcode|exit code|exit status|return code)\b", re.IGNORECASE)
_NOT_ERRORISH = re.compile(r"Warning\b|^Traceback|^File \"|^frame #|^During handling|^The above exception|^\W*$"
                           r"|To enable traceback|error_file\s*:|^Root Cause\b|^Failures:", re.IGNORECASE)
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]|\[default(\d+)\]|\[\d+,(\d+)\]<std|\bRank (\d+)\b")
_SUMMARY_RANK = re.compile(r"^rank\s*:\s*(\d+)")


def _error_lines(lines: list[str], code: set[int]) -> list[str]:
    """The last exception (type and message) and the two last other error-looking lines, in log order."""
    exc = next((i for i in range(len(lines) - 1, -1, -1) if i not in code and _EXC_TYPE.match(lines[i])), None)
    picked = {exc} if exc is not None else set()
    keys = {_DIGITS.sub("#", lines[exc])} if exc is not None else set()
    for i in range(len(lines) - 1, -1, -1):
        if len(picked) >= 3:
            break
        s = lines[i]
        if (i not in code and _ERRORISH.search(s) and not _NOT_ERRORISH.search(s)
                and (key := _DIGITS.sub("#", s)) not in keys):
            keys.add(key)
            picked.add(i)
    return [lines[i] for i in sorted(picked)]


def _failing_rank(text: str, lines: list[str], crash: Crash) -> str | None:
    """torchrun's 'Root Cause' rank, else the rank prefix the evidence lines had before cleaning."""
    if any(s.startswith("failing rank") for s in crash.evidence):
        return None
    for head in ("Root Cause", "Failures:"):     # the summary's first failure, else any failure it lists
        for i in (i for i, s in enumerate(lines) if s.startswith(head)):
            if m := next((m for t in lines[i + 1:i + 10] if (m := _SUMMARY_RANK.match(t))), None):
                return m.group(1)
    for line in crash.evidence:
        if (p := text.rfind(line[:80])) > 0:
            prefix = text[text.rfind("\n", 0, p) + 1:p]
            if m := _RANK_PREFIX.search(prefix):
                return next(g for g in m.groups() if g is not None)
    return None
