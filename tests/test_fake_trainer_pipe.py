"""The fake trainer's FAKE_FORMAT=pipe prints what ms-swift 3.x's Megatron backend prints (Megatron-LM's
training_log line and save lines), in the shape of a real paste (tests/fixtures/progress/swift_6836_pipe.txt)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.domain import costs
from orchestrator.domain.progress import andon, parse_line

FAKE = str(Path(__file__).parent / "support" / "fake_trainer.py")
REAL = next(line for line in (Path(__file__).parent / "fixtures" / "progress" / "swift_6836_pipe.txt")
            .read_text().splitlines() if "iteration" in line)
ITERATION = re.compile(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +(\d+) \|")


def run(out: Path, *flags: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_") and k not in ("NPROC_PER_NODE", "MASTER_PORT")}
    env.update({"FAKE_STARTUP_S": "0", "FAKE_STEP_S": "0.001", "FAKE_NPROC": "1", "FAKE_FORMAT": "pipe", **extra})
    return subprocess.run([sys.executable, FAKE, "sft", "--output_dir", str(out), "--train_iters", "12",
                           "--save_steps", "5", "--logging_steps", "2", "--global_batch_size", "8", *flags],
                          env=env, capture_output=True, text=True, timeout=60)


def keys(line: str) -> list[str]:
    """The field names of a training_log line, in order."""
    return [part.partition(":")[0].strip() for part in line.split("|")[1:] if ":" in part]


def test_pipe_run_prints_megatron_lines_only(tmp_path):
    out = tmp_path / "out"
    r = run(out)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    steps = [int(m.group(1)) for m in map(ITERATION.match, lines) if m]
    assert steps == [1, 2, 4, 6, 8, 10, 12]
    assert [p.step for p in map(parse_line, lines) if p is not None] == steps
    first = next(line for line in lines if ITERATION.match(line))
    assert keys(first) == keys(REAL)          # the fields of a real ms-swift 3.x megatron sft line, in order
    assert " iteration        1/      12 | consumed samples:            8 |" in first
    assert [costs.saved_step(line) for line in lines if costs.saved_step(line)] == [5, 5, 10, 10, 12, 12]
    assert "saving checkpoint at iteration       5 to " + str(out / "checkpoint-5") + " in torch_dist format" in lines
    assert " validation loss at iteration 10 | " in r.stdout and lines[-1].startswith("[after training is done]")
    # nothing else: no dict, no tqdm bar, no logging.jsonl (ms-swift 3.x writes it under its versioned save dir)
    assert "{'" not in r.stdout and "Train:" not in r.stderr
    assert not (out / "logging.jsonl").exists()
    for n in (5, 10, 12):
        assert (out / f"checkpoint-{n}" / "latest_checkpointed_iteration.txt").read_text() == str(n)


def test_pipe_nan_reads_as_nan(tmp_path):
    r = run(tmp_path / "out", "--logging_steps", "1", FAKE_FAULTS="nan_loss@3")
    assert r.returncode == 0, r.stderr
    recs = {p.step: p for p in map(parse_line, r.stdout.splitlines()) if p is not None}
    assert not andon(recs[2]) and all(andon(recs[k]) for k in range(3, 13))
    assert "| lm loss: NAN |" in r.stdout and "| grad norm: nan |" in r.stdout


@pytest.mark.parametrize("flags,fmt", [((), "json"), (("--max_steps", "4"), "pipe")])
def test_bad_format_is_refused(tmp_path, flags, fmt):
    r = run(tmp_path / "out", *flags, FAKE_FORMAT=fmt, FAKE_BACKEND="swift" if flags else "megatron")
    assert r.returncode == 1 and "FAKE_FORMAT" in r.stderr
