"""Placement planner: the search over the registered strategies and flows, plan evaluation,
`strategy=auto` and the planning CLI, on the cost model of `rlhfjax.costmodel`.

Import the modules directly (`from rlhfjax.planner import search`).
"""
