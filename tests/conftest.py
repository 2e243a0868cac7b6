"""Test session set-up: 8 virtual CPU devices, set once before JAX initialises its backends."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
# XLA's CPU code generation in the two-worker suite (pytest-xdist workers, where nothing is
# timed: the `solo` tests run in a serial session): LLVM at -O0 and the loop emitters instead of
# the fusion emitters. The tiny configs' programs then compile about 5x faster and run about 2x
# slower (PPO's programs, no cache: 6.4 s of compiles against 33.6 s; SFT steps 0.18 s against
# 0.095 s), and most of the suite's time is compiling. Only the CPU backend's code changes (its
# fusions and machine code): what the tests check of the programs (the maths, shardings and
# collectives) is the same, and no accelerator runs this code. Runs whose speed or trajectory is
# the claim take `users_codegen_env`; a check of the CPU backend's fusions pins the defaults
# (test_decode_cache).
_FAST_CODEGEN = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_SUITE_FLAGS = (_FLAG, *_FAST_CODEGEN) if os.environ.get("PYTEST_XDIST_WORKER") else (_FLAG,)
for _flag in _SUITE_FLAGS:
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
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

# The files that take longest, longest first (`--durations` of a whole run, summed per file).
# `-n 2 --dist loadfile` hands whole files to the two workers in collection order, so these
# start first and the many short files fill in at the end; a long file handed out last would
# keep one worker busy while the other sits idle. Files not listed keep their order after them.
_LONGEST_FILES = (
  "test_multihost.py",  # 8 multi-process runs against single ones: about 25 minutes on 2 cores
  "test_verifiable_rewards.py",  # the arithmetic pipeline, the longest single test
  "test_pipeline_parallel.py",  # pipelined steps and PPO runs: about 12 minutes
  "test_resume_algorithms.py",
  "test_resume.py",
  "test_algorithm_flows.py",
  "test_fused_scoring.py",
  "test_ppo.py",
  "test_pipeline.py",
  "test_dpo.py",
  "test_sft_rm.py",
  "test_planner_single.py",
  "test_placement.py",
  "test_user_flow.py",
  "test_offload.py",
)


def pytest_configure(config):
  # pytest-xdist would otherwise reorder the files by their number of tests, which puts the few
  # long end-to-end tests (kill -9 and rerun, multi-host, the pipeline) at the very end.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


_SOLO_COMMAND = "python -m pytest -q -m solo"


def _xdist_worker(config) -> bool:
  return hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(_LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps file order
  # Tests marked `solo` time the machine and need its cores to themselves: a pytest-xdist
  # worker (another worker runs beside it) leaves them out; they run in a serial invocation.
  if _xdist_worker(config):
    solo = [item for item in items if item.get_closest_marker("solo")]
    if solo:
      config.hook.pytest_deselected(items=solo)
      items[:] = [item for item in items if not item.get_closest_marker("solo")]


def pytest_terminal_summary(terminalreporter, config):
  if getattr(config.option, "numprocesses", None) and not _xdist_worker(config):
    terminalreporter.write_line(
      f"tests marked solo are not run under pytest-xdist; run them serially: {_SOLO_COMMAND}"
    )


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  devices = jax.devices()
  assert len(devices) == 8, f"tests expect 8 CPU devices, got {devices}"
  return devices


@pytest.fixture(scope="session")
def users_codegen_env() -> dict[str, str]:
  """The environment for a subprocess that must run the code users' CPU runs get: this one
  without the suite's fast-compiling code generation (`_FAST_CODEGEN`)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in _FAST_CODEGEN)
  return env


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
