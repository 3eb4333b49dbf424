"""Rendering: (recipe, resume point, port) -> Command. Pure; the ms-swift 4.x flag tables live here.

Kept import-free so that `orchestrator.recipe` can import `render.flags` without a cycle.
"""
