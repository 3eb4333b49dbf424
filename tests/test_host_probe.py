"""host_probe: the port and disk probes (real sockets, real filesystems)."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from orchestrator.host import probe as host_probe


def test_a_bound_port_is_not_free_and_is_skipped():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert host_probe.port_free(busy) is False
        assert host_probe.first_free_port(busy, busy) is None
    assert host_probe.first_free_port(busy, busy, avoid={busy}) is None


@pytest.mark.parametrize("below,expected", [
    ("", ""),                       # an existing directory is its own parent
    ("a/b/c", ""),                  # not created yet: measured where it will be created
    ("f/x", "f"),                   # under a file: the file is the nearest existing path
])
def test_existing_parent(tmp_path, below, expected):
    (tmp_path / "f").write_text("")
    assert host_probe.existing_parent(tmp_path / below) == tmp_path / expected


def test_existing_parent_of_an_unreadable_name_is_an_ancestor():
    long = Path("/") / ("x" * 5000) / "y"  # ENAMETOOLONG counts as absent
    assert host_probe.existing_parent(long) == Path("/")


def test_free_gib_of_a_path_not_created_yet(tmp_path):
    assert host_probe.free_gib(str(tmp_path / "a" / "b")) == pytest.approx(host_probe.free_gib(str(tmp_path)), rel=0.01)
