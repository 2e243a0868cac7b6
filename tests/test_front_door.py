"""The front door and the failure edges: paths, the workdir lock, signals, one-line errors,
damaged or failed checkpoints, metrics files, user reward functions, multi-process waits.

The end-to-end runs with relative workdirs, Ctrl-C and kill -9 live beside the runs they extend
(tests/test_resume.py, tests/test_pipeline.py, tests/test_sft_rm.py); config ranges in
tests/test_config_ranges.py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rlhfjax import checkpoint as ckpt
from rlhfjax import errors, tasks, workdir
from rlhfjax.observe.metrics import MetricsError, MetricsWriter
from rlhfjax.reward_fn_check import RewardFnError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPO = [
  sys.executable,
  os.path.join(ROOT, "scripts", "train_ppo.py"),
  f"--config={os.path.join(ROOT, 'configs', 'ppo_tiny.py')}",
]


def _env() -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  env.pop("RLHFJAX_DEBUG", None)
  return env


def _python(code: str, **kwargs) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "-c", textwrap.dedent(code)],
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    **kwargs,
  )


def _one_error_line(result: subprocess.CompletedProcess, status: int = 2) -> str:
  lines = result.stderr.strip().splitlines()
  assert result.returncode == status, result.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
  return lines[0]


# ---------------------------------------------------------------------------------------------
# Paths and the workdir.


def test_paths_are_made_absolute_once_with_home_expanded(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert workdir.absolute("runs/a") == str(tmp_path / "runs" / "a")
  assert workdir.absolute("~/x") == str(tmp_path / "home" / "x")
  # The pipeline nests a whole config per stage: every data and init section is found.
  cd = ml_collections.ConfigDict(
    {
      "sft": {"data": {"demonstrations": "d.jsonl", "tokenizer": "byte", "data_dir": ""}},
      "ppo": {
        "data": {"prompts": "~/p.jsonl", "tokenizer": "tok/tokenizer.json"},
        "init": {"actor": "sft/checkpoints", "reward": ""},
        "reward": {"fn": "m:f"},
      },
    }
  )
  workdir.absolute_config_paths(cd)
  assert cd.sft.data.demonstrations == str(tmp_path / "d.jsonl")
  assert cd.sft.data.tokenizer == "byte" and cd.sft.data.data_dir == ""
  assert cd.ppo.data.prompts == str(tmp_path / "home" / "p.jsonl")
  assert cd.ppo.data.tokenizer == str(tmp_path / "tok" / "tokenizer.json")
  assert cd.ppo.init.actor == str(tmp_path / "sft" / "checkpoints") and cd.ppo.init.reward == ""
  assert cd.ppo.reward.fn == "m:f"


def test_a_checkpointer_given_a_relative_path_saves(tmp_path, monkeypatch):
  # What the README's first command met: orbax refuses relative paths, in a background thread.
  monkeypatch.chdir(tmp_path)
  x = jnp.arange(7.0)
  with ckpt.Checkpointer("rel/checkpoints") as checkpointer:
    checkpointer.save(1, {"x": {"v": x}}, {"step": 1}, force=True)
    checkpointer.wait()
  assert ckpt.complete_steps(tmp_path / "rel" / "checkpoints") == [1]
  assert ckpt.complete_steps("rel/checkpoints") == [1]


@contextlib.contextmanager
def _read_only_dir(path):
  """A directory this process cannot write: a read-only tmpfs as root (root ignores modes),
  else mode 0o500."""
  os.makedirs(path)
  if os.geteuid() == 0:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], check=True)
    try:
      yield
    finally:
      subprocess.run(["umount", str(path)], check=True)
  else:
    os.chmod(path, 0o500)
    try:
      yield
    finally:
      os.chmod(path, 0o700)


def test_unusable_workdirs_are_one_line_errors(tmp_path):
  with pytest.raises(workdir.WorkdirError, match="--workdir is empty"):
    workdir.prepare("")
  (tmp_path / "file").write_text("x")
  with pytest.raises(workdir.WorkdirError, match=f"workdir {tmp_path / 'file'} is a file"):
    workdir.prepare(str(tmp_path / "file"))
  with _read_only_dir(tmp_path / "ro"):
    with pytest.raises(workdir.WorkdirError, match="is not writable|cannot create"):
      workdir.prepare(str(tmp_path / "ro"))
    with pytest.raises(workdir.WorkdirError, match="cannot create workdir .*/ro/run"):
      workdir.prepare(str(tmp_path / "ro" / "run"))


@pytest.mark.parametrize(
  ("args", "pattern"),
  [
    (["--workdir="], r"^error: --workdir is empty"),
    (["--workdir={file}"], r"^error: workdir .*/file is a file, not a directory$"),
    (["--workdir={ro}"], r"^error: workdir .*/ro is not writable$|^error: cannot create"),
    (["--workdir={run}", "--config.ppo.clip_eps=-0.1"], r"^error: 'ppo.clip_eps' must be > 0"),
    (["--workdir={run}", "--config.reward.fn=os:getcwd"], r"reward function 'os:getcwd' must"),
    (["--workdir={run}", "--config.data.prompts={missing}"], r"missing\.jsonl"),
  ],
  ids=["empty", "file", "read_only", "range", "reward_signature", "missing_data"],
)
def test_the_script_fails_in_one_line(tmp_path, args, pattern):
  (tmp_path / "file").write_text("x")
  fill = {"file": tmp_path / "file", "ro": tmp_path / "ro", "run": tmp_path / "run"}
  fill["missing"] = tmp_path / "missing.jsonl"
  with _read_only_dir(tmp_path / "ro"):
    result = subprocess.run(
      [*PPO, *(a.format(**fill) for a in args)],
      env=_env(),
      capture_output=True,
      text=True,
      timeout=300,
    )
  line = _one_error_line(result)
  assert re.search(pattern, line), line


def test_a_second_run_on_a_workdir_is_refused_naming_the_first(tmp_path):
  holder = _python(
    f"""
    import sys, time
    from rlhfjax import workdir
    lock = workdir.WorkdirLock({str(tmp_path)!r})
    print("locked", flush=True)
    sys.stdin.read()
    """,
    stdin=subprocess.PIPE,
  )
  try:
    assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
    with pytest.raises(workdir.WorkdirError, match=f"in use by process {holder.pid} on "):
      workdir.WorkdirLock(str(tmp_path))
    # The script, as a user runs it: one line, before any training.
    result = subprocess.run(
      [*PPO, f"--workdir={tmp_path}"], env=_env(), capture_output=True, text=True, timeout=300
    )
    line = _one_error_line(result)
    assert f"in use by process {holder.pid}" in line, line
  finally:
    holder.stdin.close()
    holder.wait(timeout=60)
  # Released on exit: the next run takes it, and nothing is left to take over.
  lock = workdir.WorkdirLock(str(tmp_path))
  assert lock.took_over is None
  lock.release()


def test_the_stale_lock_of_a_killed_run_is_taken_over(tmp_path):
  holder = _python(
    f"""
    import time
    from rlhfjax import workdir
    lock = workdir.WorkdirLock({str(tmp_path)!r})
    print("locked", flush=True)
    time.sleep(600)
    """
  )
  assert holder.stdout.readline().strip() == "locked"
  holder.kill()
  holder.wait(timeout=60)
  lock = workdir.WorkdirLock(str(tmp_path))
  assert lock.took_over["pid"] == holder.pid
  with open(tmp_path / ".lock") as f:
    assert json.load(f)["pid"] == os.getpid()
  lock.release()


def test_concurrent_dataset_preparers_take_turns(tmp_path):
  data = tmp_path / "prompts.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(31)))
  code = f"""
    from rlhfjax.data import jsonl
    d = jsonl.prepare("prompt", {str(data)!r}, {str(tmp_path / "tfds")!r})
    print(len(d.source("train")))
    """
  procs = [_python(code) for _ in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for proc, (out, err) in zip(procs, outs, strict=True):
    assert proc.returncode == 0, err[-3000:]
    assert out.strip() == "31"


# ---------------------------------------------------------------------------------------------
# Signals.


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_first_signal_asks_the_loop_to_stop_and_a_second_ctrl_c_exits_at_once(signum):
  proc = _python(
    """
    import sys
    import time
    from rlhfjax import signals
    with signals.StopRequest(what="test") as stop:
      print("ready", flush=True)
      while not stop.is_set():
        time.sleep(0.01)
      print("stopping", flush=True)
      sys.stderr.write("ppo:  50%|#####     | 3/6")  # a progress bar's unfinished line
      sys.stderr.flush()
      time.sleep(600)  # a long checkpoint: only a second signal ends it early
    """
  )
  assert proc.stdout.readline().strip() == "ready"
  proc.send_signal(signum)
  assert proc.stdout.readline().strip() == "stopping"
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == errors.INTERRUPTED
  assert "Traceback" not in err and "KeyboardInterrupt" not in err
  assert err.strip().splitlines()[-1].startswith("error: interrupted again: stopped at once")


# ---------------------------------------------------------------------------------------------
# Errors: one line, whatever wrapped them.


def test_describe_finds_the_os_error_under_wrappers():
  try:
    try:
      raise OSError(errno.ENOSPC, "No space left on device", "/w/checkpoints/3.tmp/x")
    except OSError as inner:
      raise RuntimeError("async save failed") from inner
  except RuntimeError as outer:
    line, status = errors.describe(outer)
  assert (line, status) == ("no space left on the device: /w/checkpoints/3.tmp/x", 2)
  text = ValueError("TensorStore write: [errno 30] Read-only file system writing x")
  assert errors.describe(text)[0].startswith("read-only file system: ")
  line, status = errors.describe(KeyError("kl_coef"))
  assert status == 1 and line.startswith("internal error KeyError: 'kl_coef' (rerun with --debug")


def test_debug_shows_the_traceback(tmp_path):
  command = [*PPO, f"--workdir={tmp_path / 'f'}"]
  (tmp_path / "f").write_text("")
  quiet = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
  _one_error_line(quiet)
  loud = subprocess.run(
    command, env={**_env(), "RLHFJAX_DEBUG": "1"}, capture_output=True, text=True, timeout=300
  )
  assert loud.returncode == 2 and "Traceback" in loud.stderr
  assert loud.stderr.strip().splitlines()[-1] == quiet.stderr.strip()


# ---------------------------------------------------------------------------------------------
# Checkpoints: failed saves, damaged files, edited meta.


def _tree():
  return {"w": jnp.arange(3 * 5, dtype=jnp.float32).reshape(3, 5), "b": jnp.ones(7, jnp.int32)}


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@contextlib.contextmanager
def _small_disk(path, size: int):
  """A filesystem of `size` bytes at `path`: a tmpfs where this process may mount one (root),
  else a limit on file sizes, whose writes fail with an OS error too (EFBIG), in orbax's
  background threads as they would on a full disk."""
  os.makedirs(path)
  if os.geteuid() == 0:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
      yield
    finally:
      subprocess.run(["umount", "-l", str(path)], check=True)
  else:
    import resource

    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, previous_limit[1]))
    try:
      yield
    finally:
      resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
      signal.signal(signal.SIGXFSZ, previous_handler)


def test_a_full_disk_fails_the_save_in_one_line_and_keeps_the_last_checkpoint(tmp_path):
  disk = tmp_path / "disk"
  small = _tree()
  # 4 MiB of incompressible data (orbax compresses): more than the disk holds.
  big = {"w": jax.random.uniform(jax.random.key(0), (1024, 1024))}
  with _small_disk(disk, 2**20), ckpt.Checkpointer(disk / "checkpoints") as checkpointer:
    checkpointer.save(1, {"a": small}, {"step": 1}, force=True)
    checkpointer.wait()
    assert checkpointer.latest_step() == 1
    with pytest.raises(ckpt.CheckpointError) as failed:
      checkpointer.save(2, {"a": big}, {"step": 2}, force=True)
      checkpointer.wait()
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint of step 2 in {disk / 'checkpoints'} failed") or (
      message.startswith(f"a checkpoint save in {disk / 'checkpoints'} failed")
    ), message
    assert "no space left on the device" in message or "file too large" in message, message
    # No partial step left behind; step 1 restores bit for bit.
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["1"]
    restored, meta = checkpointer.restore(1, {"a": _abstract(small)})
  assert meta == {"step": 1}
  for key in small:
    np.testing.assert_array_equal(restored["a"][key], small[key])


def test_edited_checkpoint_meta_is_caught_by_its_fingerprint(tmp_path):
  tree = _tree()
  with ckpt.Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(2, {"a": tree}, {"step": 2, "kl_coef": 0.01}, force=True)
    checkpointer.wait()
    meta_file = tmp_path / "2" / "meta" / "metadata"
    for edited in ({"step": 2, "kl_coef": 0.91}, {"seed": 0}, {}):
      meta_file.write_text(json.dumps(edited))
      with pytest.raises(ckpt.CheckpointError, match=f"{meta_file} does not match its finger"):
        checkpointer.restore(2, {"a": _abstract(tree)})


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_damaged_array_file_is_named(tmp_path, damage):
  tree = {"w": jnp.arange(101 * 103, dtype=jnp.float32).reshape(101, 103)}
  with ckpt.Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(1, {"a": tree}, {"step": 1}, force=True)
    checkpointer.wait()
  data_files = sorted(
    p for p in (tmp_path / "1" / "a").rglob("*") if p.is_file() and "/d/" in str(p)
  )
  assert data_files
  victim = max(data_files, key=lambda p: p.stat().st_size)
  if damage == "delete":
    victim.unlink()
  else:
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  with ckpt.Checkpointer(tmp_path) as checkpointer, pytest.raises(ckpt.CheckpointError) as failed:
    checkpointer.restore(1, {"a": _abstract(tree)})
  message = str(failed.value)
  # TensorStore names the item's array database and the leaf, not the data file inside it.
  assert message.startswith(f"corrupt checkpoint file in {tmp_path / '1' / 'a'}: the data of "
                            "leaf 'w' (chunk 0.0) cannot be read: "), message  # fmt: skip
  assert "\n" not in message and "TensorStore({" not in message, message


# ---------------------------------------------------------------------------------------------
# Metrics files.


def test_a_garbage_metrics_line_is_named_and_a_cut_short_one_dropped(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 0, "x": 1.0}\nnot json\n{"step": 1, "x": 2.0}\n')
  with pytest.raises(MetricsError, match=f"^{path}:2 is not a metrics row"):
    MetricsWriter(str(tmp_path), tensorboard=False, start_step=1)
  # A crash mid-write leaves a cut-short last line: dropped at the next start, with the rows
  # of the steps about to run again.
  path.write_text('{"step": 0, "x": 1.0}\n{"step": 1, "x": 2.0}\n{"step": 2, "x"')
  writer = MetricsWriter(str(tmp_path), tensorboard=False, start_step=1)
  writer.write(1, {"x": 5.0})
  assert path.read_text() == '{"step": 0, "x": 1.0}\n{"step": 1, "x": 5.0}\n'


# ---------------------------------------------------------------------------------------------
# User reward functions.


def _fails(*_):
  raise ZeroDivisionError("division by zero")


def _strings(prompts, responses, metadata):
  return ["good"] * len(responses)


def _short(prompts, responses, metadata):
  return np.zeros(len(responses) - 1, np.float32)


def _nan(prompts, responses, metadata):
  return np.full(len(responses), np.nan, np.float32)


@pytest.mark.parametrize(
  ("fn", "pattern"),
  [
    ("_fails", r"reward function '.*:_fails' raised ZeroDivisionError: division by zero"),
    ("_strings", r"reward function '.*:_strings' returned list of <U4; expected float32\[3\]"),
    ("_short", r"reward function '.*:_short' returned shape \(2,\); expected float32\[3\]"),
    ("_nan", r"reward function '.*:_nan' returned non-finite scores"),
  ],
)
def test_a_failing_reward_function_is_named(fn, pattern):
  reward = tasks.load_reward_fn(f"{__name__}:{fn}")
  responses = [np.array([97, 98]), np.array([99]), np.array([], np.int64)]
  with pytest.raises(RewardFnError, match=pattern):
    reward(responses, responses, {"step": 0})


def test_a_reward_function_of_the_wrong_signature_is_refused_at_load():
  with pytest.raises(RewardFnError, match=r"'os:getcwd' must take \(prompts, responses, meta"):
    tasks.load_reward_fn("os:getcwd")
  reward = tasks.load_reward_fn("rlhfjax.tasks:vowel_reward")
  got = reward([np.array([1])], [np.array([97, 98])], {"step": 0})
  assert got.dtype == np.float32 and got.tolist() == [0.5]


# ---------------------------------------------------------------------------------------------
# Multi-process waits.


# A job's processes as the entry points run them (`launch.run`): joined, then `then`.
_PROCESS = """
import time
from rlhfjax import distributed, launch
from rlhfjax.config import DistributedSection

def main(argv):
  launch.quiet_logging()
  section = DistributedSection(
      enabled=True, coordinator_address="localhost:{port}", num_processes=2,
      process_id={process_id}, start_timeout_s={start}, peer_timeout_s={peer})
  distributed.initialize(section, 2)
  from jax.experimental import multihost_utils
  print("joined", flush=True)
{then}

launch.run(main)
"""
# Collectives until killed.
_JOIN = _PROCESS.replace("{peer}", "5").replace(
  "{then}",
  """  for i in range(10_000):
    multihost_utils.sync_global_devices(f"step {{i}}")
    time.sleep(0.2)""",
)


def test_a_process_whose_job_never_starts_gives_up_in_one_line(reserve_port):
  port = reserve_port()
  start = time.monotonic()
  proc = _python(_JOIN.format(port=port, process_id=1, start=3))
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 2, err[-3000:]
  lines = err.strip().splitlines()
  assert lines == [
    "error: gave up after 3 s (distributed.start_timeout_s) waiting for process 1 of 2 to "
    f"join the job at the coordinator localhost:{port} (process 0 runs it; every process must "
    "start with the same num_processes and a distinct process_id)"
  ], err[-3000:]
  assert time.monotonic() - start < 60


def test_when_a_process_dies_the_others_stop_with_a_clear_error(reserve_port):
  port = reserve_port()
  procs = [_python(_JOIN.format(port=port, process_id=k, start=120)) for k in (0, 1)]
  for proc in procs:
    assert proc.stdout.readline().strip() == "joined", proc.stderr.read()[-3000:]
  procs[1].kill()
  start = time.monotonic()
  out, err = procs[0].communicate(timeout=120)
  procs[1].wait()
  assert procs[0].returncode == 2, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: ") and (
    "process 1 of 2 gave no sign of life" in last or "another process of the job" in last
  ), err[-3000:]
  assert time.monotonic() - start < 60


# One process fails at start-up while the other is still busy in Python (importing, planning).
_FAIL_AFTER_JOINING = _PROCESS.replace("{peer}", "30").replace(
  "{then}",
  """  if {process_id} == {failing}:
    raise ValueError("bad input on process {failing}")
  while True:
    time.sleep(0.05)""",
)


@pytest.mark.parametrize("failing", [0, 1])
def test_when_a_process_fails_the_others_stop_with_its_error(reserve_port, failing):
  # Process 0 runs the coordination service: were it to exit while process 1 is connected, JAX
  # would abort process 1 with a C++ fatal error and a stack trace; both leave through JAX's
  # shutdown barrier.
  # (The peer timeout, 30 s, is not what stops them: the test's bound is 20 s.)
  port = reserve_port()
  procs = [
    _python(_FAIL_AFTER_JOINING.format(port=port, process_id=k, start=120, failing=failing))
    for k in (0, 1)
  ]
  start = time.monotonic()
  results = [proc.communicate(timeout=120) for proc in procs]
  assert time.monotonic() - start < 20
  for k, (proc, (out, err)) in enumerate(zip(procs, results, strict=True)):
    assert proc.returncode == 2, err[-3000:]
    assert out.strip() == "joined", err[-3000:]
    lines = err.strip().splitlines()
    want = f"error: bad input on process {failing}"
    if k != failing:
      want = (
        f"error: process {failing} of 2 failed, so process {k} stops too: "
        f"bad input on process {failing}"
      )
    assert lines == [want], err[-3000:]


@pytest.mark.slow
def test_a_run_on_a_full_disk_ends_in_one_line_and_keeps_its_last_checkpoint(tmp_path):
  disk = tmp_path / "disk"
  # Room for the first checkpoint (1.6 MB) but not the second: it fails in orbax's thread.
  with _small_disk(disk, 2500 * 1024):
    result = subprocess.run(
      [
        sys.executable,
        os.path.join(ROOT, "scripts", "train_sft.py"),
        f"--config={os.path.join(ROOT, 'configs', 'sft_tiny.py')}",
        "--workdir=disk/sft",
        "--config.total_steps=4",
        "--config.checkpoint.every_steps=1",
        "--config.eval.every_steps=0",
        f"--config.data.data_dir={tmp_path / 'data'}",
      ],
      cwd=tmp_path,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=600,
    )
    errors_printed = [x for x in result.stderr.replace("\r", "\n").splitlines() if x.strip()]
    errors_printed = [x for x in errors_printed if not x.startswith("sft:")]  # progress bar
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors_printed) == 1, result.stderr[-3000:]
    assert re.match(
      rf"error: checkpoint of step \d in {disk / 'sft' / 'checkpoints'} failed: (no space left "
      "on the device|file too large)",
      errors_printed[0],
    ), errors_printed[0]
    # Complete steps only (the partial one is removed), and at least the first.
    names = sorted(p.name for p in (disk / "sft" / "checkpoints").iterdir())
    assert names and all(n.isdigit() for n in names), names
    assert ckpt.complete_steps(disk / "sft" / "checkpoints") == [int(n) for n in names]
