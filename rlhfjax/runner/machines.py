"""The machine each device of a live job sits on, and the placement warnings that follow.

A process is not a host: under Slurm JAX starts one process per GPU by default (eight to a
node), on TPU VMs one per host. What decides whether a tensor group's all-reduces cross the
network is the machine, so each process posts its host name through the coordination service
and reads the others'.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import jax
from absl import logging

from rlhfjax import distributed
from rlhfjax.placement.hosts import tensor_across_hosts
from rlhfjax.placement.spec import PlacementSpec


def device_hosts(devices: Sequence[jax.Device] | None = None) -> list[str]:
  """The host name of each device of `devices` (default `jax.devices()`), by index. Every
  process of the job must call it (each posts its own name and reads the others':
  `distributed.shared`, which bounds the wait by `distributed.wait_timeout_s`)."""
  devices = jax.devices() if devices is None else list(devices)
  names = distributed.shared(socket.gethostname(), "the host names")
  return [names[d.process_index] for d in devices]


def warn_tensor_across_hosts(spec: PlacementSpec) -> list[str]:
  """Logs (on process 0) one warning per role whose tensor groups span machines, and returns
  them. Every process must call it (see `device_hosts`)."""
  warnings = tensor_across_hosts(spec, device_hosts())
  if distributed.is_primary():
    for line in warnings:
      logging.warning("placement: %s", line)
  return warnings
