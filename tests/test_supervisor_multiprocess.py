"""A job of two processes joined by `jax.distributed` through the entry points' start
(`launch.start`): killing process 0 (its supervisor or the child doing the work) stops process 1
with one line, and a scheduler's signal to every process stops the job once, supervised or not."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from test_supervisor_e2e import _gone, _wait_ended

from rlhfjax import supervisor

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]

_ROOT = pathlib.Path(__file__).resolve().parent.parent

_JOB = """
import os, sys, time
import ml_collections
from rlhfjax import launch, signals

def main(argv):
  cfg = ml_collections.ConfigDict({{"distributed": dict(
      enabled=True, coordinator_address="localhost:{port}", num_processes=2,
      process_id={process_id}, start_timeout_s=120, peer_timeout_s=30, supervise={supervise}),
      "placement": {{"num_devices": 2}}}})
  launch.start(argv, cfg, 8)
  from rlhfjax import distributed
  with signals.StopRequest() as stop:
    print("joined", os.getpid(), flush=True)
    for i in range(10**6):
      # Every process stops after the same iteration: any one's request is everyone's.
      if asked := distributed.flagged(stop.is_set(), "stop"):
        print("stopped by", stop.signal_name or f"process {{asked[0]}}", "after", i, flush=True)
        return
      time.sleep(0.05)

launch.run(main)
"""


def _job(port: int, supervise: bool = True) -> list[subprocess.Popen]:
  env = {k: v for k, v in os.environ.items() if k != supervisor.ENV}
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                            env.get("XLA_FLAGS", "")).strip()  # fmt: skip
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
  env["JAX_PLATFORMS"] = "cpu"
  programs = [_JOB.format(port=port, process_id=k, supervise=supervise) for k in (0, 1)]
  return [
    subprocess.Popen([sys.executable, "-c", program], env=env, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    for program in programs
  ]  # fmt: skip


def _joined(proc: subprocess.Popen) -> int:
  """The pid of the process doing the work (the supervisor's child)."""
  line = proc.stdout.readline()
  assert line.startswith("joined "), (line, proc.stderr.read()[-3000:])
  return int(line.split()[1])


def _stop(procs: list[subprocess.Popen]) -> None:
  for proc in procs:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


@pytest.mark.parametrize("target", ["supervisor", "child"])
def test_killing_process_0_stops_process_1_with_one_line(reserve_port, target):
  port = reserve_port()
  procs = _job(port)
  try:
    workers = [_joined(proc) for proc in procs]
    assert workers[0] != procs[0].pid and workers[1] != procs[1].pid
    ended = os.pidfd_open(workers[0])  # once killed with its supervisor, nobody reaps it
    os.kill(procs[0].pid if target == "supervisor" else workers[0], signal.SIGKILL)
    killed_at = time.monotonic()
    out, err = procs[1].communicate(timeout=120)
    waited = time.monotonic() - killed_at
    procs[0].wait(timeout=60)
  finally:
    _stop(procs)
  assert procs[1].returncode == 2, err[-3000:]
  # Two watchers race to notice: JAX's coordination client, which aborts the child (its
  # supervisor reports it: "JAX stopped it: UNAVAILABLE: Failed to send RPC to coordination
  # service"), and the liveness watch, whose read of the service fails ("UNAVAILABLE:
  # recvmsg:Connection reset by peer"). The same one line either way.
  lost = (
    f"error: process 1 of 2 lost the job's coordination service at localhost:{port} (process 0 "
    "ended or is unreachable; see its log): "
  )
  lines = err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(lost), err[-3000:]
  assert re.fullmatch(r"(JAX stopped it: )?UNAVAILABLE: [^:]+.*", lines[0][len(lost) :]), lines
  assert "Additional GRPC" not in lines[0]
  assert waited < 30  # the abort is at once; the liveness watch's peer time-out is 30 s
  assert procs[0].returncode == -signal.SIGKILL  # the child's death is its supervisor's
  _wait_ended(ended)
  assert _gone(workers[0]) and _gone(workers[1])


@pytest.mark.parametrize("supervise", [True, False])
def test_a_job_stops_together_when_a_scheduler_signals_every_process_or_one(
  reserve_port, supervise
):
  """Supervised, a scheduler signals every process and every child (each once): the job stops
  once. Not supervised, only process 1 is signalled: process 0 stops after the same iteration."""
  procs = _job(reserve_port(), supervise)
  try:
    workers = [_joined(proc) for proc in procs]
    # distributed.supervise=False: the process started does the work.
    assert (workers == [proc.pid for proc in procs]) != supervise
    signalled = (procs[0].pid, workers[0], procs[1].pid, workers[1]) if supervise else workers[1:]
    for pid in dict.fromkeys(signalled):
      os.kill(pid, signal.SIGTERM)  # each process once
    results = [proc.communicate(timeout=120) for proc in procs]
  finally:
    _stop(procs)
  said = (
    "SIGTERM: stopping the run after this iteration with a checkpoint (Ctrl-C again to stop "
    "at once)"
  )
  after = set()
  for k, (proc, (out, err)) in enumerate(zip(procs, results, strict=True)):
    assert proc.returncode == 0, err[-3000:]
    by, _, iteration = out.splitlines()[-1].rpartition(" after ")
    after.add(iteration)
    asked = supervise or k == 1
    assert by == ("stopped by SIGTERM" if asked else "stopped by process 1"), out
    assert [x for x in err.splitlines() if x.strip()] == ([said] if asked else []), err[-3000:]
  assert len(after) == 1  # the same iteration
