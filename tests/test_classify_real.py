"""The classifier on real crash excerpts from public issue threads: tuning parts exact, held-out parts measured.

Figures and how each split was drawn: tests/fixtures/README.md. Held-out floors are the measured figures; a rule
change may not lower them.
"""
from __future__ import annotations

import hashlib
import random

import pytest
from real_crashes import (
    REAL,
    REAL2,
    REAL2_INDEX,
    REAL3,
    REAL3_INDEX,
    REAL4,
    REAL4_INDEX,
    REAL_INDEX,
    SHARED,
    SHARED_INDEX,
    measure,
    split,
)

from orchestrator.domain.classify import classify
from orchestrator.types import CrashClass

TUNE, HELDOUT = split(REAL_INDEX, "tune"), split(REAL_INDEX, "heldout")
TUNE2, HELDOUT2 = split(REAL2_INDEX, "tune"), split(REAL2_INDEX, "heldout")
TUNE3, HELDOUT3 = split(REAL3_INDEX, "tune"), split(REAL3_INDEX, "heldout")
TUNE4, HELDOUT4 = split(REAL4_INDEX, "tune"), split(REAL4_INDEX, "heldout")


@pytest.mark.skipif(SHARED is None, reason="shared crash-logs not available")
@pytest.mark.parametrize("entry", SHARED_INDEX, ids=[e["file"] for e in SHARED_INDEX])
def test_shared_crash_logs(entry: dict) -> None:
    crash = classify((entry["root"] / entry["file"]).read_text(errors="replace"))
    assert crash.cls.value == entry["label"], crash.evidence
    assert crash.evidence and len(crash.evidence) <= 5


def _well_formed(index: list[dict], root) -> None:
    assert sorted(e["file"] for e in index) == sorted(f.name for f in root.glob("*.log"))
    for e in index:
        assert e["file"].split("__")[0] == e["label"] and CrashClass(e["label"])
        assert e["source"].startswith("https://github.com/") and e.get("phase", "startup") in ("startup", "training")
        assert len((root / e["file"]).read_text().splitlines()) <= 60


def test_real_index_is_complete_and_split_by_seed() -> None:
    _well_formed(REAL_INDEX, REAL)
    order = sorted(e.get("drawn_as", e["file"]) for e in REAL_INDEX)   # relabelled files keep their drawn name
    random.Random(14).shuffle(order)                  # the split was drawn once, before any rule change
    assert {e.get("drawn_as", e["file"]) for e in HELDOUT} == set(order[:round(0.3 * len(order))])


def test_real2_index_is_complete_new_and_split_by_url_hash() -> None:
    _well_formed(REAL2_INDEX, REAL2)
    by_hash = sorted(REAL2_INDEX, key=lambda e: hashlib.sha256(e["source"].encode()).hexdigest())
    assert {e["file"] for e in HELDOUT2} == {e["file"] for e in by_hash[:round(0.3 * len(by_hash))]}
    assert len({e["source"] for e in REAL2_INDEX}) == len(REAL2_INDEX) >= 100        # one excerpt per thread
    older = {e["source"] for e in REAL_INDEX + SHARED_INDEX}
    assert not older & {e["source"] for e in REAL2_INDEX}                              # sources in no earlier set


@pytest.mark.parametrize("index,root,earlier", [(REAL3_INDEX, REAL3, REAL_INDEX + REAL2_INDEX + SHARED_INDEX),
                                                (REAL4_INDEX, REAL4, REAL_INDEX + REAL2_INDEX + REAL3_INDEX + SHARED_INDEX)],
                         ids=["real3", "real4"])
def test_blind_collections_are_new_and_held_out_by_url_hash(index: list[dict], root, earlier: list[dict]) -> None:
    _well_formed(index, root)
    for e in index:   # each entry's own hash decides, so excerpts added later never move earlier ones
        drawn = int(hashlib.sha256(e["source"].encode()).hexdigest()[:8], 16) < 0.3 * 2**32
        assert e["split"] == ("heldout" if drawn else "tune"), e["file"]
    assert len({e["source"].rstrip("/") for e in index}) == len(index)           # one excerpt per thread
    older = {e["source"].rstrip("/") for e in earlier}
    assert not older & {e["source"].rstrip("/") for e in index}                  # sources in no earlier set


@pytest.mark.parametrize("entry", TUNE, ids=[e["file"] for e in TUNE])
def test_real_tuning_excerpts(entry: dict) -> None:
    assert measure.predict(entry).value == entry["label"]


# One tuning excerpt has no wording a rule could use (NCCL's 'unhandled system error' that --ipc=host cured).
REAL2_TUNE_MISSES = {"disk_full__belle_docker_ipc_ncclsystemerror_one_line.log"}


@pytest.mark.parametrize("entry", TUNE2, ids=[e["file"] for e in TUNE2])
def test_real2_tuning_excerpts(entry: dict) -> None:
    if entry["file"] in REAL2_TUNE_MISSES:
        pytest.xfail("no rule can see the root cause in this text")
    assert measure.predict(entry).value == entry["label"]


# No wording a rule could use: NCCL's bare 'unhandled system error' (a full /dev/shm, per the thread's title);
# torch.save's 'File ... cannot be opened' (a full disk here, a missing folder or a permission elsewhere);
# torchrun's SIGTERMs to the other ranks alone (a host-memory kill, per a commenter's analysis).
REAL3_TUNE_MISSES = {"disk_full__llmd_vllm_dp16_dev_shm_nccl_system_error.log", "disk_full__ronin_checkpoint_cannot_be_opened.log",
                     "host_oom_killed__swift_load_dataset_from_local_ram_torchrun_sigterm.log"}


# DeepSpeed's loss scale halved four times from 2^16 then a finite loss: what the first steps of a healthy fp16
# run print too (the thread's scale went on down to 1, past the window).
REAL4_TUNE_MISSES = {"nan_loss__llamafactory_baichuan13b_deepspeed_overflow_loop.log"}


@pytest.mark.parametrize("entry", TUNE3 + TUNE4, ids=[e["file"] for e in TUNE3 + TUNE4])
def test_blind_collections_tuning_excerpts(entry: dict) -> None:
    if entry["file"] in REAL3_TUNE_MISSES | REAL4_TUNE_MISSES:
        pytest.xfail("no rule can see the root cause in this text")
    assert measure.predict(entry).value == entry["label"]


@pytest.mark.parametrize("entries,floor", [(HELDOUT, (93.8, 96.9)), (HELDOUT2, (90.6, 90.6)), (HELDOUT3, (94.3, 94.3)),
                                                 (HELDOUT4, (96.2, 96.2))], ids=["real", "real2", "real3", "real4"])
def test_heldout_does_not_regress(entries: list[dict], floor: tuple[float, float]) -> None:
    """Measured on the held-out parts (tests/fixtures/README.md): keep at least that."""
    exact, family, _ = measure.score(entries)
    assert (round(exact, 1), round(family, 1)) >= floor, (exact, family)
