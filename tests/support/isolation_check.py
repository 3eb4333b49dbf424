"""What isolation between runs sharing a persistent_dir means, as checks on real directories."""
from __future__ import annotations

import os
from pathlib import Path

from orchestrator.store import manifest as mf
from orchestrator.store import published as pb
from orchestrator.store import sync

def snapshot(d: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under d: (inode, mtime_ns, size); any rewrite, replace or removal changes it."""
    out = {}
    for dp, _, fns in os.walk(d):
        for fn in fns:
            st = os.stat(os.path.join(dp, fn))
            out[os.path.relpath(os.path.join(dp, fn), d)] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def assert_copies_are_the_runs(pub: Path, out: Path, h: str) -> list[str]:
    """Every published checkpoint in pub is byte-identical to its manifest, which names hash h and matches
    the run's own local checkpoint of that name. Returns the names."""
    names = sorted(n for n in pb.copies_in(pub))
    assert names, f"nothing published in {pub}"
    for n in names:
        m = mf.read_manifest(pub / n)
        assert m["recipe_hash"] == h, f"{pub / n} holds recipe {m['recipe_hash'][:8]}, not {h[:8]}"
        assert mf.manifest_matches(pub / n, m) == [], f"{pub / n} differs from its manifest"
        local = mf.read_manifest(out / n)
        assert local is None or sync.same_content(local, m), f"{pub / n} is not {out / n}"
    return names
