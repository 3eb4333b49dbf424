"""The supervisor's state table as text: each state's work in a line or two and its allowed next states, read from
types.TRANSITIONS. The supervisor's docstring is made from it and the README carries it verbatim
(tests/test_transitions.py), so the three cannot drift apart."""
from __future__ import annotations

from orchestrator.types import TRANSITIONS, State

# In the loop's order, which the text follows; every State has an entry (tests/test_transitions.py).
WORK: dict[State, str] = {
    State.PREFLIGHT: "checks, locks, predecessor's trainers stopped, drift, policy history from the journal "
                     "(an already completed run: nothing to launch)",
    State.VERIFYING: "GPUs clear? else kill own leftovers (+ gpu.kill_patterns), force_wait_s, again; still not "
                     "clear: stay, with backoff (never launch onto busy GPUs); a node that stays bad is excluded",
    State.LAUNCHING: "newest verified checkpoint (restored from persistent storage on a new machine), save interval, "
                     "free port (none: verify again), own process group; the last step's checkpoint: nothing is "
                     "relaunched (completed, or verify for the export); merge = \"final\" after training: the "
                     "export attempt (no checkpoint to export: gave up)",
    State.RELAUNCHING: "as LAUNCHING, after a failed attempt",
    State.RUNNING: "observe -> judge -> act: exit, NaN, hang (a save in progress is none), run health (a stop: "
                   "gave up; a rollback or a slowdown restart: verify, then relaunch), a resume at the wrong step "
                   "(gave up), disk too full for the next save, stop request; new checkpoints verified, published, "
                   "retained; training over -> completed, or verify for the export",
    State.CRASHED: "the crash policy decides on the classified crash (log + system evidence)",
    State.CLEANING: "SIGTERM the group, grace_s, SIGKILL leftovers (re-parented too); a NaN's checkpoints "
                    "quarantined; retrying cannot help: gave up",
    State.WAITING: "until verified ready (processes gone, GPU memory free, NCCL shm gone, a free port; wait_s "
                   "the bound); disk_full: until space is free (pruning what is safe)",
    State.BACKOFF: "as WAITING, plus the crash-loop backoff",
    State.STOPPING: "SIGTERM/SIGINT/SIGUSR1 or a spot notice: stop the training (swift saves), read what it "
                    "wrote, finish its row",
    State.COMPLETED: "exit 0 after the final sync",
    State.STOPPED: "exit 0 after the final sync",
    State.GAVE_UP: "exit 3 after the final sync, with the reason",
}
WIDTH = 100


def _wrap(text: str, indent: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and indent + len(line) + 1 + len(word) > WIDTH:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


def transitions_text() -> str:
    """Renders every state's work and its allowed next states, one block per state in the loop's order."""
    out = []
    for state in WORK:
        nexts = [s.name for s in WORK if s in TRANSITIONS[state]]
        work = _wrap(WORK[state], 13)
        out.append(f"{state.name:<12} {work[0]}")
        out += [f"{'':12} {w}" for w in work[1:]]
        out.append(f"{'':12} -> {' | '.join(nexts) if nexts else '(terminal)'}")
    return "\n".join(out)
