"""The progress reader and the save lines against what real trainers printed (tests/fixtures/progress/)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from orchestrator.domain import costs
from orchestrator.domain.progress import andon, parse_jsonl_line, parse_line
from orchestrator.domain.health.progress_unreadable import unreadable
from orchestrator.types import Progress

HERE = Path(__file__).parent / "fixtures" / "progress"
SOURCES = [json.loads(line) for line in (HERE / "sources.jsonl").read_text().splitlines()]
# Files drawn held out (sources.jsonl `split`) measure the reader without having shaped it: they are held to a
# floor below, not read exactly one by one. Files with no split are tune files.
TUNE = [s for s in SOURCES if s.get("split", "tune") == "tune"]
HELDOUT = [s for s in SOURCES if s.get("split") == "heldout"]


def fixture_lines(name: str) -> list[str]:
    return (HERE / name).read_text(encoding="utf-8").splitlines()


def test_every_fixture_has_a_source():
    files = {p.name for p in HERE.iterdir() if p.suffix in (".txt", ".jsonl") and p.name != "sources.jsonl"}
    assert files == {s["file"] for s in SOURCES}
    for s in SOURCES:
        assert s["source"].startswith("https://github.com/"), s["file"]


# The third set (logs ms-swift and Megatron-LM publish in their own repositories) is cited by full commit; its split
# was drawn from the source alone: held out iff the first 8 hex digits of sha256(source) fall below 30% of 2**32.
PINNED = re.compile(r"https://github\.com/[^/]+/[^/]+/blob/[0-9a-f]{40}/")


@pytest.mark.parametrize("src", [s for s in SOURCES if PINNED.match(s["source"])], ids=lambda s: s["file"])
def test_third_set_split_follows_the_hash_rule(src):
    drawn = int(hashlib.sha256(src["source"].encode()).hexdigest()[:8], 16) < 0.3 * 2**32
    assert src["split"] == ("heldout" if drawn else "tune")


@pytest.mark.parametrize("src", TUNE, ids=[s["file"] for s in TUNE])
def test_real_paste_reads_exactly_its_steps_and_saves(src):
    """Every step the paste holds, in order, and nothing else: no false records, no false saves."""
    read = parse_jsonl_line if src["format"] == "jsonl" else parse_line
    steps, saves, stops = [], [], []
    for line in fixture_lines(src["file"]):
        p = read(line)
        if p is not None:
            steps.append(p.step)
            if andon(p):
                stops.append(p.step)
        saved = costs.saved_step(line)
        if saved is not None:
            saves.append(saved)
    assert (steps, saves, stops) == (src["steps"], src["saves"], src["andon"])


@pytest.mark.parametrize("src", [s for s in TUNE if PINNED.match(s["source"])], ids=lambda s: s["file"])
def test_own_repository_logs_hold_nothing_unreadable(src):
    """What ms-swift and Megatron-LM print themselves: every line that looks like progress is read as a step, so
    their own output never raises progress_unreadable."""
    read = parse_jsonl_line if src["format"] == "jsonl" else parse_line
    assert [line for line in fixture_lines(src["file"]) if unreadable(line, read(line))] == []


def _measure():
    spec = importlib.util.spec_from_file_location("progress_measure", HERE / "measure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_heldout_floor():
    """The held-out files, measured when they were drawn (README.md): the figures may rise, never drop."""
    s = _measure().score(HELDOUT)
    assert s["files"] == 10
    assert s["exact"] >= 10 and s["found"] >= 20 and s["false"] == 0


def test_measure_agrees_with_the_exact_test():
    s = _measure().score(TUNE)
    assert (s["exact"], s["found"], s["false"]) == (len(TUNE), s["expected"], 0)


def _line(name: str, contains: str) -> str:
    return next(line for line in fixture_lines(name) if contains in line)


# Exact records from the real lines: every field the reader takes, from each format.
EXACT = [
    ("megatron-lm", _line("megatron_llm_11_pipe.txt", "iteration      122/"),
     Progress(122, 250000, 2.504220, 0.231, 9.150e-06, None, 86.5452)),
    ("swift3-grpo-loss", _line("swift_8173_grpo_pipe.txt", "iteration        2/"),
     Progress(2, 624, -2.529132e-02, 75.173, 9.999746e-07, 83.46, 3.9886)),
    ("swift3-moe-grpo", _line("swift_6718_moe_grpo_pipe.txt", "iteration"),
     Progress(7, 2174, -2.365559e-06, 0.016, 4.999872e-05, 51.52, 215.613)),
    ("swift3-mtp", _line("swift_7371_mtp_pipe.txt", "iteration"),
     Progress(1, 228, 8.659112e-01, 5.172, 9.999573e-05, 24.9, 112.7898)),
    ("swift3-days", _line("swift_6836_pipe.txt", "iteration"),
     Progress(1530, 1926, 3.515074e-01, 11.293, 4.001458e-06, 72.89, 85.9384)),
    ("bridge-mtp2", _line("megatron_bridge_4024_mtp_pipe.txt", "iteration       30/"),
     Progress(30, 6069, 8.535482e-01, 1.366, 6.0e-05, None, 29.5119)),
    ("swift3-dpo-dict", _line("swift_4146_dpo_3x_dicts.txt", "'12/94'"),
     Progress(12, 94, 0.4850769, 25.86640167, 1e-06, 69.19, 1 / 0.010367)),
    ("swift4-strings", _line("swift_examples_sp_qwen3_5.txt", "'46/189'"),
     Progress(46, 189, 1.049, 0.6095, 9.035e-05, 68.06, 23.34)),
    ("swift3-brace-lost", _line("swift_5571_grpo_dict_brace_lost.txt", "'5/3766'"),
     Progress(5, 3766, -0.0, 0.0, 2.6e-07, 56.74, 1 / 0.056099)),
    ("swift3-container-ts", _line("swift_4291_container_timestamps.txt", "'300/4491'"),
     Progress(300, 4491, 0.42228584, 5.19625193, 9.99e-06, 76.72, 1 / 0.194334)),
    ("megatron-skipped-warmup", _line("megatron_nccl_743_bert_skipped.txt", "iteration       10/"),
     Progress(10, 1000000, None, None, 0.0, None, 0.3562)),
    ("swift1-int-step", _line("swift_docs_v1_4_self_cognition.txt", "'global_step': 5}"),
     Progress(5, None, 1.7662447, None, 9.993e-05)),
    ("swift1-int-step-grad", _line("swift_docs_v1_6_2_self_cognition.txt", "'global_step': 1}"),
     Progress(1, None, 1.36837471, 2.69893861, 2.7e-06)),
    ("swift2-megatron-pipe", _line("swift_pr1365_megatron_2x_pipe.txt", "iteration       10/"),
     Progress(10, 1000, 8.482397, 184.363, 1e-06, None, 8.1959)),
    ("swift3-megatron-dpo-commented", _line("swift_pr4193_megatron_dpo_dicts.txt", "'1/100'"),
     Progress(1, 100, 2.58519292, 17.12728882, 9.998e-05, 11.29, 1 / 0.028085)),
    ("swift4-commented-memory-last", _line("swift_examples_ascend_offload_off.txt", "'5/16'"),
     Progress(5, 16, 2.93490505, 2.63550186, 8.346e-05, 57.91, 1 / 0.175644)),
]


@pytest.mark.parametrize("line,expected", [e[1:] for e in EXACT], ids=[e[0] for e in EXACT])
def test_real_line_fields(line, expected):
    assert _close(parse_line(line), expected)


def _close(got: Progress | None, want: Progress) -> bool:
    assert got is not None
    assert (got.step, got.max_steps) == (want.step, want.max_steps)
    for field in ("loss", "grad_norm", "lr", "memory_gib", "step_s"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None and b is None) or a == pytest.approx(b, rel=1e-9), (field, a, b)
    return True


def test_real_jsonl_record_fields():
    line = fixture_lines("swift_4408_logging.jsonl")[1]
    assert _close(parse_jsonl_line(line), Progress(1200, 3936, 0.22828499, 0.50412697, 7.877e-05, 64.64, 1 / 0.077917))
    # ms-swift 1.x's logging.jsonl: the step as an int, no total.
    assert _close(parse_jsonl_line(fixture_lines("swift_runs_1x_logging.jsonl")[2]),
                  Progress(20, None, 4.3683, None, 1.093e-05))


REAL_PIPE = _line("swift_6836_pipe.txt", "iteration")
REAL_DICT = _line("swift_examples_sp_qwen3_5.txt", "'5/189'").removeprefix("# ")


# Prefixes and glue seen around real lines; the ISO form is `kubectl logs --timestamps` / docker's (RFC 3339,
# nanoseconds), put in front of a real line because no public paste with it was found.
@pytest.mark.parametrize("prefix", [
    "", "master-0 >> ", "2026-01-09 17:40:26.044634 master-0 >> ", "2026-01-20T08:33:58.123456789Z ",
    "[rank7]: ", "Train:  24%|██▍       | 46/189 [17:53<45:13, 18.97s/it]\r",
    "Train:  24%|██▍       | 46/189 [17:53<45:13, 18.97s/it]",
])
@pytest.mark.parametrize("line,step", [(REAL_PIPE, 1530), (REAL_DICT, 5)])
def test_prefixes_and_glued_bars(prefix, line, step):
    p = parse_line(prefix + line)
    assert p is not None and p.step == step and not andon(p)


@pytest.mark.parametrize("suffix", ["\rTrain:  24%|██▍       | 46/189 [17:53<45:13, 18.97s/it]", "  ", "\n"])
def test_bar_glued_after(suffix):
    assert parse_line(REAL_PIPE + suffix).step == 1530


# Megatron-LM's own line today (megatron/training/training.py training_log): the timestamp has microseconds;
# a NaN average is left out of the line (`if avg >= 0.0`), ms-swift 3.x prints it (`{:.6E}` -> NAN);
# `number of nan iterations` counts the iterations whose loss was NaN/Inf.
MEGATRON_NOW = (" [2026-01-20 08:33:58.123456] iteration        5/     206 | consumed samples:          160 | "
                "elapsed time per iteration (ms): 2104.3 | learning rate: 9.997697E-05 | global batch size:    32 | "
                "lm loss: 1.180399E+00 | loss scale: 1.0 | grad norm: 1.105 | number of skipped iterations:   0 | "
                "number of nan iterations:   0 |")


@pytest.mark.parametrize("line,loss_nan,grad", [
    (MEGATRON_NOW, False, 1.105),
    # a loss average left out with no iteration skipped: Megatron-LM drops a NaN average (Megatron-LLM#33)
    (MEGATRON_NOW.replace("lm loss: 1.180399E+00 | ", ""), True, 1.105),
    # ... but with iterations skipped (fp16 overflow) the average may be of nothing: unknown, not NaN
    (MEGATRON_NOW.replace("lm loss: 1.180399E+00 | ", "").replace("skipped iterations:   0", "skipped iterations:   1")
     .replace("loss scale: 1.0", "loss scale: 65536.0"), False, 1.105),
    # ... and a line with fields of its own (an RL trainer's reward; its loss may be negative) says nothing
    (MEGATRON_NOW.replace("lm loss: 1.180399E+00 | ", "reward: 0.25 | "), False, 1.105),
    (MEGATRON_NOW.replace("1.180399E+00", "NAN"), True, 1.105),                    # ms-swift 3.x prints it
    (MEGATRON_NOW.replace("1.105", "nan"), False, "nan"),
    (MEGATRON_NOW.replace("1.105", "inf"), False, math.inf),
    (MEGATRON_NOW.replace("nan iterations:   0", "nan iterations:   2"), True, 1.105),
    (MEGATRON_NOW.replace("lm loss: 1.180399E+00 | ", "").replace("nan iterations:   0", "nan iterations:   1"),
     True, 1.105),
])
def test_pipe_non_finite(line, loss_nan, grad):
    p = parse_line(line)
    assert p is not None and p.step == 5 and p.max_steps == 206 and p.step_s == pytest.approx(2.1043)
    assert (p.loss is not None and math.isnan(p.loss)) is loss_nan
    assert math.isnan(p.grad_norm) if grad == "nan" else p.grad_norm == grad
    assert andon(p) is (loss_nan or grad != 1.105)


NOT_A_STEP = [
    " validation loss at iteration 100 | lm loss value: 2.197386E+00 | lm loss PPL: 9.001979E+00 | ",
    " validation loss at iteration 10000 on validation set | lm loss value: 3.9E-01 | ",
    "[after training is done] datetime: 2026-01-20 10:01:02 ",
    "[before the start of training step] datetime: 2026-01-20 08:31:17 ",
    "exiting program at iteration 206",
    " loading checkpoint from /out/v0/checkpoint-100 at iteration 100",
    "  successfully loaded checkpoint from /out [ t 1/1, p 1/1 ] at iteration 100",
    "  train_iters ...................................... 206",
    "  log_interval ..................................... 5",
    " > building train, validation, and test datasets ...",
    "iteration 5/206",                                 # no field: no step
    "iteration 5/206 | foo |",
    "the iteration 5/ 206 | nothing: here |",
    "[INFO:swift] images_dir: /out/images",
    "(min, max) time across ranks (ms):",
]


@pytest.mark.parametrize("line", NOT_A_STEP)
def test_not_a_step(line):
    assert parse_line(line) is None


@pytest.mark.parametrize("rec,expected", [
    # ms-swift 3.x megatron's logging.jsonl (release/3.12 trainers/base.py training_log): `lm loss`, the step time
    # in seconds, `global_step/max_steps`.
    ({"lm loss": 1.180399, "load_balancing_loss": 1.02, "grad_norm": 1.105, "learning_rate": 9.997e-05,
      "elapsed_time_per_iteration": 2.1043, "memory(GiB)": 70.1, "elapsed_time": "11s", "remaining_time": "7m",
      "loss_scale": 1.0, "consumed_samples": 160, "global_step/max_steps": "5/206"},
     Progress(5, 206, 1.180399, 1.105, 9.997e-05, 70.1, 2.1043)),
    ({"lm loss": float("nan"), "grad_norm": 1.0, "global_step/max_steps": "5/206"}, "nan"),
    ({"loss": 1.0, "train_speed(iter/s)": 0.0, "global_step/max_steps": "5/206"}, Progress(5, 206, 1.0)),
])
def test_swift3_megatron_jsonl(rec, expected):
    p = parse_jsonl_line(json.dumps(rec))
    if expected == "nan":
        assert p is not None and math.isnan(p.loss) and andon(p)
    else:
        assert p == expected


# Save lines: the step each names. Megatron's from megatron/training/checkpointing.py (start, end, old end,
# async); swift's measured with ms-swift 4.6.0 on CPU (shared research swift-on-cpu.md).
@pytest.mark.parametrize("line,step", [
    (_line("swift_7345_platform_prefix.txt", "saving checkpoint"), 10000),
    (("[2026-01-20 08:41:02.123456] saving checkpoint at iteration     100 to /out/v0-20260120-083017/checkpoint-100"
     " in torch_dist format"), 100),
    (("  [2026-01-20 08:41:09.654321] successfully saved checkpoint from iteration     100 to "
     "/out/v0-20260120-083017/checkpoint-100 [ t 1/1, gtp_remat 0/1, p 1/1 ]"), 100),
    ("  successfully saved checkpoint from iteration     100 to /ckpt [ t 1/2, p 1/1 ]", 100),   # plain --save dir
    ("  successfully saved checkpoint at iteration     100 to /ckpt", 100),                      # Megatron-LM < 2024
    ("  [2026-01-20 08:41:02.2] scheduled an async checkpoint save at iteration     100 to /ckpt", 100),
    ("[INFO:swift] Saving model checkpoint to /work/out/checkpoint-10", 10),
    ("[INFO:swift] last_model_checkpoint: /work/out/checkpoint-30", 30),
    ("Train: 100%|██████████| 30/30 [00:01<00:00, 21.3it/s]\r[INFO:swift] last_model_checkpoint: /o/checkpoint-30", 30),
    ("2026-01-20T08:33:58.123456789Z [INFO:swift] Saving model checkpoint to /o/checkpoint-500", 500),
])
def test_saved_step_real_formats(line, step):
    assert costs.saved_step(line) == step


@pytest.mark.parametrize("line", [
    _line("swift_4366_last_checkpoint_glued.txt", "best_model_checkpoint"),
    "[INFO:swift] best_model_checkpoint: None",
    " loading checkpoint from /out/v0/checkpoint-100 at iteration 100",
    "  successfully loaded checkpoint from /out/v0/checkpoint-100 [ t 1/1, p 1/1 ] at iteration 100",
    "saving dataloader checkpoint at iteration 100 to /ckpt/dataloader",
    "[INFO] Saving checkpoint at iteration 100",                       # other trainers' wording
    "[Sequence Packing] Skipping automatic checkpoint at iteration 100 (no save)",
    " validation loss at iteration 100 | lm loss value: 2.197386E+00 | ",
    "WARNING: could not find the metadata file /out/latest_checkpointed_iteration.txt",
])
def test_no_save(line):
    assert costs.saved_step(line) is None
