"""The demo's injected crash: SIGKILL the whole trainer tree once the first attempt reaches a step,
as the kernel's OOM killer would. The supervisor must classify it and resume."""
from __future__ import annotations

import signal
import threading

from orchestrator import launcher


def inject_kill(sup, at_step: int) -> threading.Thread:
    def watch() -> None:
        while not sup.stop_event.wait(0.2):
            a = sup.attempt
            if a is None or a.n != 1:
                if a is not None:
                    return  # the first attempt ended before the step: nothing to inject
                continue
            if a.last is not None and a.last.step >= at_step and not a.launched.exited.is_set():
                print(f"demo: injecting a crash: SIGKILL to the trainer at step {a.last.step}", flush=True)
                launcher.kill_pids([p.pid for p in launcher.tree(a.launched.pid)], signal.SIGKILL)
                return

    t = threading.Thread(target=watch, name="demo-crash", daemon=True)
    t.start()
    return t
