"""Test session set-up: 8 virtual CPU devices, set once before JAX initialises its backends."""

import gc
import os
import subprocess
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
# XLA's CPU code generation in the suite's pytest-xdist workers (where nothing is
# timed): LLVM at -O0 and the loop emitters instead of the fusion emitters. The tiny configs'
# programs then compile about 5x faster and run about 2x slower (PPO's programs, no cache:
# 6.4 s of compiles against 33.6 s; SFT steps 0.18 s against 0.095 s), and most of the suite's
# time is compiling. Only the CPU backend's code changes (its fusions and machine code): what
# the tests check of the programs (the maths, shardings and collectives) is the same, and no
# accelerator runs this code. Speed is measured by the `scripts/bench_*.py` scripts outside the
# suite (CI runs the planner's timed check, `scripts/bench_ppo.py --check=6`, after it); a check
# of the CPU backend's fusions pins the defaults (test_decode_cache).
# One LLVM module per program instead of several compiled in parallel: on 2 cores shared by the
# workers the split only adds work (a 1-step PPO run: 23.5-25.8 CPU-s against 27.1-29.9 s).
_FAST_CODEGEN = (
  "--xla_backend_optimization_level=0",
  "--xla_cpu_use_fusion_emitters=false",
  "--xla_cpu_parallel_codegen_split_count=1",
)
_SUITE_FLAGS = (_FLAG, *_FAST_CODEGEN) if os.environ.get("PYTEST_XDIST_WORKER") else (_FLAG,)
for _flag in _SUITE_FLAGS:
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Python's bytecode cached beside the sources (`__pycache__/`, ignored by git), also where the
# environment turns it off (PYTHONDONTWRITEBYTECODE, as container images often do): the suite
# starts about 190 Python processes, and without the cache each compiles the package's
# sources again (0.23 CPU-s more for a training script that stops at a bad config).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
  sys.dont_write_bytecode = False
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

# Each test file holds one kind of test and says which with a module-level marker, its tier:
#   pure         no JAX at all: config, schedules, the cost model's arithmetic;
#   unit         JAX functions, models and meshes in this process;
#   integration  whole runs in this process (Runner, Cluster), several properties per run;
#   e2e          the scripts run as users run them, in subprocesses;
#   multiprocess jobs of several processes joined by jax.distributed (also marked e2e).
# `pytest -m "not e2e"` is the quick loop (docs/development.md). A file without exactly one
# tier is a collection error, and a test outside the e2e tiers that starts a Python process
# fails naming its file.
TIERS = ("pure", "unit", "integration", "e2e", "multiprocess")
_SUBPROCESS_TIERS = ("e2e", "multiprocess")


def pytest_configure(config):
  for tier in TIERS:
    config.addinivalue_line("markers", f"{tier}: test tier (tests/conftest.py TIERS)")
  # `-n 3 --dist loadfile` hands whole files to the workers in collection order, which
  # `pytest_collection_modifyitems` sorts by tier, heaviest first: a long file handed out last
  # would keep one worker busy while the others idle. (pytest-xdist would otherwise reorder the
  # files by their number of tests.) Three workers on the 2 cores: the e2e tests wait on the
  # processes they start (peers, signals, a lock), and a third worker runs meanwhile
  # (docs/development.md).
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_collection_finish(session):
  # The test modules are imported: tune the garbage collector as the scripts do (most of the
  # suite is tracing and compiling, which allocates millions of short-lived objects).
  from rlhfjax import launch

  launch.collect_garbage_less()


def _tier(item) -> str | None:
  """The tier a test's module declares (its module-level `pytestmark`), or None."""
  marks = getattr(item.module, "pytestmark", [])
  names = {m.name for m in (marks if isinstance(marks, list) else [marks])}
  tiers = [t for t in TIERS if t in names]
  if tiers == ["e2e", "multiprocess"]:
    return "multiprocess"
  return tiers[0] if len(tiers) == 1 else None


def pytest_collection_modifyitems(config, items):
  untiered = sorted({item.path.name for item in items if _tier(item) is None})
  if untiered:
    raise pytest.UsageError(
      f"test files without exactly one tier marker ({', '.join(TIERS)}; a module-level "
      f"`pytestmark`, tests/conftest.py): {', '.join(untiered)}"
    )
  # Heaviest tiers first (see pytest_configure); files keep their order within a tier.
  rank = {tier: i for i, tier in enumerate(reversed(TIERS))}
  items.sort(key=lambda item: rank.get(_tier(item), len(rank)))
  for item in items:
    if _tier(item) == "multiprocess":
      item.add_marker(pytest.mark.e2e)


_popen_init = subprocess.Popen.__init__


@pytest.fixture(autouse=True)
def _python_subprocesses_only_in_e2e_tiers(request, monkeypatch):
  """A test outside the e2e tiers that starts a Python process fails: such a test belongs in
  an e2e file, where `pytest -m "not e2e"` leaves it out."""
  if _tier(request.node) in (None, *_SUBPROCESS_TIERS):  # None: a collection error already
    return

  def guarded(self, args, *rest, **kwargs):
    program = args[0] if isinstance(args, (list, tuple)) and args else args
    if isinstance(program, (str, os.PathLike)) and os.path.basename(str(program)).startswith(
      ("python", os.path.basename(sys.executable))
    ):
      raise AssertionError(
        f"{request.node.path.name} is not an e2e file but starts a Python process "
        f"({' '.join(map(str, args))[:120]}): move the test to a file marked e2e"
      )
    _popen_init(self, args, *rest, **kwargs)

  monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


# Where a test's time goes (`RLHFJAX_TEST_PROFILE=DIR`): each test's wall seconds, the CPU
# seconds of its process and of the subprocesses it waited for (what competes for the cores),
# and, in its process, the seconds of JAX tracing, lowering and XLA compiling and its number of
# compiles and persistent-cache hits: one JSON line per test in DIR/<worker>.jsonl.
_PROFILE_DIR = os.environ.get("RLHFJAX_TEST_PROFILE")
_PROFILE_EVENTS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace_s",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
  "/jax/core/compile/backend_compile_duration": "compile_s",
}
_profile: dict[str, float] = {}
_PROFILE_PROGRAMS = 8
"""The programs whose tracing, lowering and compiling took longest, listed per test."""

if _PROFILE_DIR:
  import json
  import resource
  import time

  _by_program: dict[str, float] = {}

  def _on_duration(event: str, seconds: float, fun_name: str | None = None, **_) -> None:
    if (key := _PROFILE_EVENTS.get(event)) is not None:
      _profile[key] = _profile.get(key, 0.0) + seconds
      if key == "compile_s":
        _profile["compiles"] = _profile.get("compiles", 0) + 1
      if fun_name is not None:  # tracing, lowering and compiling, by program
        name = fun_name[4:-1] if fun_name.startswith("jit(") else fun_name  # as traced
        _by_program[name] = _by_program.get(name, 0.0) + seconds

  def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
      _profile["cache_hits"] = _profile.get("cache_hits", 0) + 1

  jax.monitoring.register_event_duration_secs_listener(_on_duration)
  jax.monitoring.register_event_listener(_on_event)

  def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user and system) of this process and of its ended, waited-for children."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    _profile.clear()
    _by_program.clear()
    start, (own, kids) = time.perf_counter(), _cpu_seconds()
    yield
    row = {"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 3)}
    own_after, kids_after = _cpu_seconds()
    row.update(cpu_s=round(own_after - own, 3), child_cpu_s=round(kids_after - kids, 3))
    row.update({k: round(v, 3) for k, v in _profile.items()})
    top = sorted(_by_program.items(), key=lambda kv: -kv[1])[:_PROFILE_PROGRAMS]
    row["programs_s"] = {name: round(seconds, 3) for name, seconds in top}
    os.makedirs(_PROFILE_DIR, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(_PROFILE_DIR, f"{worker}.jsonl"), "a") as f:
      f.write(json.dumps(row) + "\n")


_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


def _memory_maps() -> tuple[int, int] | None:
  """(memory mappings of this process, the kernel's limit per process), or None off Linux."""
  try:
    with open("/proc/self/maps") as maps, open(_MAX_MAP_COUNT) as limit:
      return sum(1 for _ in maps), int(limit.read())
  except OSError:
    return None


_RELEASE_AT = 4
"""JAX's caches are cleared after a test file that leaves the worker more than 1/_RELEASE_AT of
the kernel's limit of memory mappings (`_free_compiled_programs`)."""


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs(request):
  """JAX's caches are cleared after a test file that leaves the worker more than a quarter of
  the kernel's limit of memory mappings, so that the compiled programs can go.

  Every XLA:CPU executable maps its machine code into the process (about 3 mappings for a
  small program, far more for the engine's), and JAX's caches keep every executable a worker
  ever compiled: the rollout, streaming and paged-engine files alone left a worker 23,503
  mappings (753 after clearing). Past the kernel's limit (`vm.max_map_count`, 65,530 by
  default) a mapping fails and XLA aborts or crashes in the compile or serialization at hand,
  as CI's workers did a third of the way through the suite.

  Cleared after every file, the next file traced, lowered and loaded again every program it
  shared with the files before (the PPO-family runs' programs, the engines' of one config):
  seven integration files in one worker took 211.6 and 220.4 CPU-s so against 170.6 and 184.2
  cleared at a quarter (runs interleaved). Then a worker starts each file below 16,383
  mappings, and a crash needs a file that adds 49,000 more: a file that adds half the limit,
  or leaves more than half after clearing, fails here, naming itself."""
  before = _memory_maps()
  yield
  if before is None:  # off Linux: no count, so after every file
    jax.clear_caches()
    gc.collect()
    return
  count, limit = _memory_maps()
  added = count - before[0]
  if count > limit // _RELEASE_AT:
    jax.clear_caches()
    gc.collect()
    count = _memory_maps()[0]
  if added > limit // 2 or count > limit // 2:
    pytest.fail(
      f"{request.node.path.name} adds {added} memory mappings to this process and leaves "
      f"{count} (the kernel's limit is {limit}, {_MAX_MAP_COUNT}): release its compiled "
      "programs (half the limit added, or left, fails)"
    )


@pytest.fixture
def attention_block(monkeypatch):
  """Sets `rlhfjax.models.attention.BLOCK`, which programs read when traced, not from their
  arguments: JAX's caches are cleared before (traces made with the default) and after (those
  made with this size), since they outlive a test file (`_free_compiled_programs`)."""
  from rlhfjax.models import attention

  def set_block(size: int) -> None:
    jax.clear_caches()
    monkeypatch.setattr(attention, "BLOCK", size)

  yield set_block
  jax.clear_caches()


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
