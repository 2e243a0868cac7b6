"""The front door as a user meets it, in processes of their own: the scripts' one-line failures,
the workdir lock between processes, signals, a traceback with --debug, a run on a full disk."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
from test_front_door import _read_only_dir, _small_disk

from rlhfjax import checkpoint as ckpt
from rlhfjax import errors, workdir

pytestmark = pytest.mark.e2e

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
