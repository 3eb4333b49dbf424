"""Run health: the detectors over a run's logged steps, lines, step times and saved checkpoints, and what the
supervisor does about their findings. Pure: no clock, no files.

    kinds.py      Finding (the one type every detector returns) and KINDS: what each types.HealthKind raises
    detector.py   Detector(name, requires, fn), Snapshot, Start
    watch.py      HealthWatch and DETECTORS, the list it runs over step records and log lines
    action.py     act(): the one map from a finding to an action
    loss.py, resume.py, skipped_steps.py, progress_unreadable.py   the detectors of DETECTORS
    throughput.py (step times), slowdown_clues.py (the machine's evidence at a drop)

A new warn-only detector is two edits: its module, ending in `DETECTOR = Detector("name", "step", fn)` where
fn(start) returns a check Snapshot -> list[Finding]; and its line in watch.DETECTORS. A finding of a new kind
also needs the kind's member in types.HealthKind and its row in kinds.KINDS (the metrics, report, alert and
runbook wiring follow from the row; tests/test_health_kinds.py checks every kind has one).
"""
