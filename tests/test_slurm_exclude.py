"""Which node a multi-node job leaves out (orchestrator/domain/exclude.py), and the gpu_check step's lines."""
from __future__ import annotations

import pytest

from orchestrator.domain.exclude import Exclusion, node_to_exclude
from orchestrator.host.launch.slurm import node_check_results
from orchestrator.types import CrashClass

F, O = CrashClass.CUDA_FATAL, CrashClass.OTHER
NODES = ("n1", "n2")


@pytest.mark.parametrize("bad_for_s, recent, expected", [
    ({}, [], None),                                                       # all clear
    ({"n2": 5.0}, [], None),                                              # bad, but not yet for the bound
    ({"n2": 10.0}, [], "n2"),                                             # bad for the bound
    ({"n1": 12.0, "n2": 30.0}, [], "n2"),                                 # the longest bad first
    ({"n3": 99.0}, [], None),                                             # not in this allocation (excluded already)
    ({"*": 99.0}, [], None),                                              # the check step itself failed: no node's fault
    ({}, [("n2", F)], None),                                              # one GPU fault is a relaunch, not a bad node
    ({}, [("n2", F), (None, O), ("n2", F)], "n2"),                        # repeated cuda_fatal on one node
    ({}, [("n1", F), ("n2", F)], None),                                   # one each: not the node
    ({}, [("n2", F), ("n2", F), (None, O), (None, O), (None, O), (None, O)], None),  # outside the last 5
    ({}, [("n3", F), ("n3", F)], None),                                   # a node no longer in the job
])
def test_node_to_exclude(bad_for_s, recent, expected):
    found = node_to_exclude(NODES, bad_for_s, 10.0, recent)
    assert (found.node if found else None) == expected
    if found:
        assert isinstance(found, Exclusion) and found.node in found.reason


@pytest.mark.parametrize("stdout, expected", [
    ('{"node": "n1", "clear": true, "problems": [], "gpus": 8}\n{"node": "n2", "clear": true, "problems": []}\n', {}),
    ('{"node": "n1", "clear": true, "problems": []}\n{"node": "n2", "clear": false, "problems": ["GPU 0: held by pid 7"]}\n',
     {"n2": ["GPU 0: held by pid 7"]}),
    ('{"node": "n1", "clear": true, "problems": []}\nsrun: error: n2: task 1: Exited with exit code 1\n',
     {"n2": ["the check did not answer from this node"]}),
])
def test_gpu_check_lines(stdout, expected):
    assert node_check_results(stdout, NODES) == expected
