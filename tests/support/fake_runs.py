"""Running the fake trainer (fake_trainer.py) directly, outside a supervisor."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FAKE = str(Path(__file__).with_name("fake_trainer.py"))


FAST = {"FAKE_STARTUP_S": "0", "FAKE_STEP_S": "0.001", "FAKE_NPROC": "8", "MASTER_PORT": "29611"}


def env_for(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_") and k not in ("NPROC_PER_NODE", "MASTER_PORT")}
    env.update(FAST)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(out: Path, *flags: str, **extra) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, FAKE, "sft", "--output_dir", str(out), *flags], env=env_for(**extra),
                       capture_output=True, timeout=60)
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()  # bytes: keep tqdm's "\r" as written
    return r


MEG = ("--train_iters", "12", "--save_steps", "5", "--logging_steps", "2")


SWIFT = ("--max_steps", "6", "--save_steps", "2", "--logging_steps", "1")
