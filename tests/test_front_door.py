"""The front door and the failure edges in this process: paths, unusable workdirs, one-line
errors, damaged or failed checkpoints, metrics files, user reward functions.

The scripts' one-line failures, the workdir lock between processes, signals and a run on a full
disk: tests/test_front_door_e2e.py; multi-process waits: tests/test_front_door_multiprocess.py.
The end-to-end runs with relative workdirs, Ctrl-C and kill -9 live beside the runs they extend
(tests/test_resume_e2e.py, tests/test_pipeline.py, tests/test_sft_rm_e2e.py); config ranges in
tests/test_config_ranges.py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rlhfjax import checkpoint as ckpt
from rlhfjax import errors, tasks, workdir
from rlhfjax.observe.metrics import MetricsError, MetricsWriter
from rlhfjax.reward_fn_check import RewardFnError

pytestmark = pytest.mark.unit


def test_entry_points_collect_garbage_less():
  """`launch.run` (every script) freezes what is loaded and collects the youngest generation
  every 100,000 net allocations, not 700."""
  import gc

  from rlhfjax import launch

  before = gc.get_threshold()
  gc.unfreeze()
  gc.set_threshold(700, 10, 10)
  try:
    launch.collect_garbage_less()
    assert gc.get_threshold() == (100_000, 10, 10)
    assert gc.get_freeze_count() > 0
  finally:
    gc.set_threshold(*before)


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
  # A failed save wraps the OS error in rlhfjax's own, whose line names the step and the
  # cause: it wins over the bare OS error (which here names no file, as some writes do).
  try:
    try:
      raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as inner:
      raise ckpt.CheckpointError("checkpoint of step 2 in /w failed: no space left") from inner
  except ckpt.CheckpointError as outer:
    assert errors.describe(outer) == ("checkpoint of step 2 in /w failed: no space left", 2)
  text = ValueError("TensorStore write: [errno 30] Read-only file system writing x")
  assert errors.describe(text)[0].startswith("read-only file system: ")
  line, status = errors.describe(KeyError("kl_coef"))
  assert status == 1 and line.startswith("internal error KeyError: 'kl_coef' (rerun with --debug")


def test_status_line_keeps_a_grpc_failures_status_and_first_message():
  # What the liveness watch's read of a lost coordination service raises (JAX 0.10).
  grpc = (
    "UNAVAILABLE: recvmsg:Connection reset by peer\nAdditional GRPC error information from "
    "remote target coordination_service while calling "
    "/xla.coordination.CoordinationService/GetKeyValueDir:\n:UNKNOWN:Error received from peer"
  )
  assert errors.status_line(RuntimeError(grpc)) == "UNAVAILABLE: recvmsg:Connection reset by peer"
  assert errors.status_line("x " * 300) == ("x " * 100)[:200]


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
