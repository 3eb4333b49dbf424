"""A stale GPU holder for the GPU check: takes GPU memory and keeps it until killed.

    python3 bench/gpu/holder.py --tag TAG (--hold-mib N | --leave-mib N)

--hold-mib takes N MiB; --leave-mib takes all but N MiB of what is free (0: everything it can get, in
shrinking chunks). Prints one JSON line {"pid", "held_mib", "free_mib", "tag"} once it holds the memory, then
sleeps. The tag is only there to be on the command line: gpu.kill_patterns matches command lines.
"""
from __future__ import annotations

import argparse
import json
import os
import signal

MIB = 1024**2


def grab(torch, want_bytes: int) -> list:
    """Allocate up to `want_bytes` in chunks, smaller ones as larger ones fail; returns the tensors."""
    held, left = [], want_bytes
    for chunk in (1024 * MIB, 64 * MIB, 2 * MIB):
        while left >= chunk:
            try:
                held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
            left -= chunk
    return held


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--hold-mib", type=int)
    how.add_argument("--leave-mib", type=int)
    a = ap.parse_args()
    import torch

    free, _total = torch.cuda.mem_get_info()
    want = a.hold_mib * MIB if a.hold_mib is not None else max(0, free - a.leave_mib * MIB)
    held = grab(torch, want)
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    print(json.dumps({"pid": os.getpid(), "held_mib": sum(t.numel() for t in held) // MIB,
                      "free_mib": free_after // MIB, "tag": a.tag}), flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
