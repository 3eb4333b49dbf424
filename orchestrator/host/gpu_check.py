"""`python -m orchestrator.host.gpu_check --ids 0,1 --threshold-mib 1024`: one node's GPU verdict, one JSON line.

srun runs it on every node of the allocation in one step before each launch (launch.slurm.node_gpu_check):
{"node": "n2", "clear": false, "problems": ["GPU 0: 20480 MiB used (threshold 1024 MiB)"], "gpus": 8}.
The same verdict as on one node (gpu.clear_verdict), through the same reader (NVML, or the tests'
stand-in: gpu.StandinReader). Exit 0 either way: the answer is the line, not the status.
"""
from __future__ import annotations

import argparse
import json
import os
import socket

from orchestrator.host import gpu


def node_verdict(reader: gpu.GpuReader, ids: list[gpu.GpuId], threshold_mib: int, node: str) -> dict:
    snap = reader.snapshot()
    clear, problems = gpu.clear_verdict(snap, ids, threshold_mib)
    return {"node": node, "clear": clear, "problems": problems, "gpus": len(snap.gpus)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.host.gpu_check")
    ap.add_argument("--ids", required=True, help="GPU indices or UUIDs, comma-separated")
    ap.add_argument("--threshold-mib", type=int, required=True)
    a = ap.parse_args(argv)
    ids = [int(x) if x.isdigit() else x for x in a.ids.split(",") if x]
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(json.dumps(node_verdict(gpu.reader(True), ids, a.threshold_mib, node)), flush=True)


if __name__ == "__main__":
    main()
