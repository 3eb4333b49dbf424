"""Finding a trainer started by hand through /proc (orchestrator/host/trainer_find.py): the command-line
rules as a table, and real processes: a tree's outermost process, stdout through /proc, a zombie's exit status."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from orchestrator.host import trainer_find as tf
from orchestrator.types import ExitStatus

ARGV = {
    "megatron sft": (["/v/bin/python", "/v/bin/megatron", "sft", "--output_dir", "/o"], True, "/o"),
    "swift sft, = form": (["/v/bin/python", "/v/bin/swift", "sft", "--output_dir=/o"], True, "/o"),
    "torchrun of swift's sft.py": (["/v/bin/python", "/v/bin/torchrun", "--nproc_per_node", "8",
                                    "/v/lib/swift/cli/sft.py", "--output_dir", "o"], True, "o"),
    "a worker": (["/v/bin/python", "-u", "/v/lib/swift/cli/_megatron/sft.py", "--output_dir", "/o"], True, "/o"),
    "the last --output_dir wins": (["swift", "sft", "--output_dir", "/a", "--output_dir", "/b"], True, "/b"),
    "no output_dir": (["megatron", "sft", "--model", "m"], False, None),
    "not sft": (["swift", "infer", "--output_dir", "/o"], False, "/o"),
    "the watcher itself": (["python", "-m", "orchestrator", "watch", "r.toml"], False, None),
    "an editor of sft.txt": (["vim", "sft.txt", "--output_dir", "/o"], False, "/o"),
}


@pytest.mark.parametrize("argv,trainer,out", ARGV.values(), ids=ARGV.keys())
def test_what_is_a_trainer(argv, trainer, out):
    assert tf.is_trainer(argv) is trainer and tf.output_dir_arg(argv) == out


@pytest.mark.parametrize("raw,status", [(9, ExitStatus(signal=9)), (1 << 8, ExitStatus(code=1)), (0, ExitStatus(code=0)),
                                        (15, ExitStatus(signal=15))])
def test_wait_status(raw, status):
    assert tf.wait_status(raw) == status


SCRIPT = "import subprocess, sys, time; [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', 'sft', " \
         "'--output_dir', sys.argv[-1]]) for _ in range(2)]; time.sleep(60)"


def test_a_tree_is_found_once_by_its_outermost_process_with_its_stdout_file(tmp_path):
    """A launcher and its two workers all name the output_dir (torchrun's shape): one candidate, the launcher;
    its stdout is the file it was started with."""
    out, log = tmp_path / "out", tmp_path / "train.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "sft", "--output_dir", "out"], cwd=tmp_path,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        import psutil
        import time
        deadline = time.monotonic() + 60
        while len(psutil.Process(proc.pid).children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        [c] = tf.find(out)
        assert c.pid == proc.pid and c.output_dir == out
        assert tf.output_files(proc.pid) == [log]
        assert tf.describe(proc.pid) == c and tf.find(tmp_path / "elsewhere") == []
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_pipe_is_no_log_file_and_a_zombie_tells_its_exit(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert tf.output_files(proc.pid) == []
        import psutil
        created = psutil.Process(proc.pid).create_time()
        w = tf.WatchedTrainer.attach(proc.pid, created, tmp_path / "none.log")
        assert not w.exited.is_set() and w.alive()
        os.kill(proc.pid, signal.SIGKILL)
        assert w.exited.wait(60)  # a zombie until this test reaps it: its status is read from /proc
        assert w.status == ExitStatus(signal=9)
    finally:
        proc.kill()
        proc.wait()
    assert tf.zombie_exit(proc.pid, created) is None  # reaped: unknown from here on
