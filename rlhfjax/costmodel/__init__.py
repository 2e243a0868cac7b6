"""What a placement costs, in time and memory, without JAX: hardware, efficiency, the workload
and how each flow is priced, stage costs, the memory model and the iteration's replay.

Import the modules directly (`from rlhfjax.costmodel import costs`); laptops plan with it.
"""
