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


@pytest.fixture(scope="session")
def reserve_port(tmp_path_factory):
  """A function returning a TCP port for a coordinator that nothing else will take.

  Ports from `bind(0)` are chosen from the kernel's ephemeral range, which it also hands to
  every outgoing connection and `bind(0)` of any process (gloo's own listeners included), so
  such a port can be taken between choosing it and the coordinator binding it. These come from
  below that range, where the kernel never assigns ports by itself, and each is held by an
  exclusive lock file for the whole session, so concurrent test processes (pytest-xdist
  workers, other sessions on the machine) never pick the same one.
  """
  import fcntl
  import random
  import socket
  import tempfile

  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      ephemeral_low = int(f.read().split()[0])
  except OSError:
    ephemeral_low = 32768
  high = min(ephemeral_low, 32768)
  lock_dir = os.path.join(tempfile.gettempdir(), "rlhfjax-test-ports")
  os.makedirs(lock_dir, exist_ok=True)
  held: list[int] = []

  def reserve() -> int:
    for port in random.Random().sample(range(high // 2, high), 2000):
      fd = os.open(os.path.join(lock_dir, f"{port}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        continue
      with socket.socket() as s:
        try:
          s.bind(("localhost", port))  # not in use by an unrelated program right now
        except OSError:
          os.close(fd)
          continue
      held.append(fd)
      return port
    raise RuntimeError("no free coordinator port below the ephemeral range")

  yield reserve
  for fd in held:
    os.close(fd)
