"""Run health: the detectors over a run's logged steps, lines, step times and saved checkpoints, and what the
supervisor does about their findings. Pure: no clock, no files."""
