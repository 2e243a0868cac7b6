"""Test session set-up: 8 virtual CPU devices, set once before JAX initialises its backends."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session's processes: the pytest workers and the
# training runs the end-to-end tests start (kill -9 and rerun, multi-host, the pipeline) compile
# the same programs. JAX reads these at import and subprocesses inherit them. Entries are keyed
# by the program, the compile options and the jax/jaxlib versions.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_ROOT, ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  devices = jax.devices()
  assert len(devices) == 8, f"tests expect 8 CPU devices, got {devices}"
  return devices
