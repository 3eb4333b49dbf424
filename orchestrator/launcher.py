"""Kept importable for the many call sites: the one-node launcher lives in orchestrator/launch/local.py."""
from orchestrator.launch.local import *  # noqa: F401,F403
from orchestrator.launch.local import (RUN_MARKER, FileTail, LaunchError, Launched, cmdline, dump_stacks,  # noqa: F401
                                       kill_pids, launch, locate, read_tail, resolve, run_processes, same_process,
                                       terminate, tree, wait_gone)
import sys  # noqa: F401  (tests patch launcher.sys.executable)
