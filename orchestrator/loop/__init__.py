"""The supervisor's loop: the state machine (supervisor.py) and its parts, each given what it uses (see
supervisor.py's docstring for the map and the transition table)."""
