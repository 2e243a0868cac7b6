"""Benchmarks, calibration, local checks and validation against published runs: reached from
`scripts/` and `tests/` only; nothing in the library imports this package.

Import the modules directly (`from rlhfjax.bench import validation`).
"""
