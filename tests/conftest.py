"""Test session set-up: 8 virtual CPU devices, set once before JAX initialises its backends."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  devices = jax.devices()
  assert len(devices) == 8, f"tests expect 8 CPU devices, got {devices}"
  return devices
