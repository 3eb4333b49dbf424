"""The transition table (types.TRANSITIONS) is the one description of the state machine: the supervisor
checks every transition against it, and the README and the supervisor's docstring carry its text."""
from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.loop import supervisor as supervisor_module
from orchestrator.loop.states import WORK, transitions_text
from orchestrator.loop.supervisor import TransitionError
from orchestrator.types import TERMINAL_STATES, TRANSITIONS, State

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_state_has_a_row_and_terminal_states_lead_nowhere():
    assert set(TRANSITIONS) == set(State) == set(WORK)
    for state, nexts in TRANSITIONS.items():
        assert (not nexts) == (state in TERMINAL_STATES), state
        assert State.PREFLIGHT not in nexts, "pre-flight runs once, first"


def test_every_state_is_reachable_from_preflight():
    seen, todo = {State.PREFLIGHT}, [State.PREFLIGHT]
    while todo:
        for n in TRANSITIONS[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    assert seen == set(State)


def test_readme_and_docstring_carry_the_table():
    text = transitions_text()
    assert text in README.read_text(), "README's state block: paste orchestrator.loop.states.transitions_text()"
    assert text in (supervisor_module.__doc__ or "")


def test_an_unexpected_transition_raises(world):
    sup, _ = world()
    assert sup.step() is State.VERIFYING
    with pytest.raises(TransitionError, match="verifying -> cleaning"):
        sup._enter(State.CLEANING)
    assert sup.state is State.VERIFYING, "nothing changed"
