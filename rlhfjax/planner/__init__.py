"""Placement planner: hardware, workload, stage costs, memory, iteration replay and search.

Import the modules directly (`from rlhfjax.planner import search`); this package imports
nothing at load time so that `rlhfjax.placement` can use `planner.memory` without a cycle.
"""
