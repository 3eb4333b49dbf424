"""The [health] recipe section: defaults, validation (bad values -> the recipe's usual one-line problems), and
that it stays outside the recipe hash (tests/test_recipe.py's OPERATIONAL rows cover each key's hash)."""
from __future__ import annotations

import pytest

from orchestrator.config import recipe as R
from orchestrator.config.recipe import HealthSection, RecipeError


def test_defaults_are_the_documented_ones():
    h = HealthSection()
    assert (h.loss_max, h.grad_norm_max, h.on_divergence) == (None, None, "stop")
    assert (h.slowdown_ratio, h.slowdown_window_s, h.on_slowdown) == (1.5, 600, "warn")
    assert (h.spike_window, h.spike_mads, h.spike_min_ratio, h.grad_norm_spike_min_ratio) == (20, 10.0, 3.0, 10.0)
    assert (h.divergence_window, h.divergence_tolerance, h.divergence_min_rise, h.grad_norm_rise) == (20, 0.5, 0.1, 1.0)
    assert (h.resume_window, h.resume_level_tolerance, h.unreadable_lines) == (10, 0.5, 3)
    assert h.max_skipped_steps == 50


def test_a_recipe_without_the_section_gets_the_defaults(write_recipe):
    assert R.load(write_recipe()).health == HealthSection()


def test_the_section_is_read(write_recipe):
    r = R.load(write_recipe(health={"loss_max": 10.0, "grad_norm_max": 100, "on_divergence": "rollback",
                                    "on_slowdown": "restart"}))
    assert (r.health.loss_max, r.health.grad_norm_max, r.health.on_divergence, r.health.on_slowdown) == (
        10.0, 100, "rollback", "restart")


@pytest.mark.parametrize("override,key,words", [
    ('health.on_divergence="restart"', "health.on_divergence", "'stop', 'rollback' or 'warn'"),
    ('health.on_slowdown="stop"', "health.on_slowdown", "'warn' or 'restart'"),
    ("health.loss_max=0", "health.loss_max", "greater than 0"),
    ("health.grad_norm_max=-1", "health.grad_norm_max", "greater than 0"),
    ("health.slowdown_ratio=1.0", "health.slowdown_ratio", "greater than 1"),
    ("health.slowdown_window_s=0", "health.slowdown_window_s", "greater than 0"),
    ('health.loss_max="10"', "health.loss_max", "number"),
    ("health.spike_window=2", "health.spike_window", "greater than or equal to 5"),
    ("health.divergence_window=1", "health.divergence_window", "greater than or equal to 3"),
    ("health.loss_mx=10", "health.loss_mx", "did you mean 'health.loss_max'"),
    ("health.max_skipped_steps=0", "health.max_skipped_steps", "greater than or equal to 1"),
])
def test_bad_values_are_one_clear_problem_naming_the_key(write_recipe, override, key, words):
    with pytest.raises(RecipeError) as e:
        R.load(write_recipe(), [override])
    (problem,) = e.value.problems
    assert problem.key == key
    assert words in problem.message
    assert problem.source == f"--set {override!r}"


def test_health_is_outside_the_hashed_keys():
    assert "health" not in R.HASHED_KEYS
