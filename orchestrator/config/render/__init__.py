"""Rendering: (recipe, resume point, port) -> Command. Pure.

Imports `orchestrator.config.recipe`, never the other way round: the flag tables the recipe checks against
live in `orchestrator.config.flags`.
"""
