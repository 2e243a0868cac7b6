"""The metrics writer's TensorBoard events come without importing PyTorch (seconds of start-up
in every run where torch is installed, as with the test extras)."""

import errno
import struct
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

_CODE = """
import sys
from rlhfjax.observe.metrics import MetricsWriter
writer = MetricsWriter(sys.argv[1])
writer.write(0, {"reward/mean": 0.5})
writer.close()
print("torch" in sys.modules)
"""


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
  done = subprocess.run(
    [sys.executable, "-c", _CODE, str(tmp_path)], capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == "False"
  assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
  assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def _events(directory):
  """Every event of the TensorBoard files in `directory`, read as TFRecords (length, CRC,
  data, CRC) and parsed with tensorboardX's protos: no TensorBoard needed."""
  from tensorboardX.proto import event_pb2

  events = []
  for path in sorted(directory.glob("events.out.tfevents.*")):
    data = path.read_bytes()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at : at + 8])
      events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + length]))
      at += 12 + length + 4
  return events


def test_tensorboard_scalars_and_a_resumed_runs_purge_step(tmp_path):
  from rlhfjax.observe.metrics import MetricsWriter

  writer = MetricsWriter(str(tmp_path))
  for step in range(3):
    writer.write(step, {"reward/mean": step / 2, "kl/mean": 0.25})
  writer.close()
  resumed = MetricsWriter(str(tmp_path), start_step=2)
  resumed.write(2, {"reward/mean": 7.0})
  resumed.close()
  scalars = [
    (e.step, v.tag, v.simple_value) for e in _events(tmp_path / "tb") for v in e.summary.value
  ]
  assert scalars[:6] == [
    (0, "reward/mean", 0.0),
    (0, "kl/mean", 0.25),
    (1, "reward/mean", 0.5),
    (1, "kl/mean", 0.25),
    (2, "reward/mean", 1.0),
    (2, "kl/mean", 0.25),
  ]
  assert scalars[6:] == [(2, "reward/mean", 7.0)]
  purges = [e.step for e in _events(tmp_path / "tb") if e.HasField("session_log")]
  assert purges == [2]  # TensorBoard hides the interrupted run's steps from 2 on


_FULL_DISK_CODE = """
import sys
from rlhfjax.observe.metrics import MetricsWriter
writer = MetricsWriter(sys.argv[1])
try:
  for step in range(100_000):
    writer.write(step, {f"metric/{i}": float(i) for i in range(20)})
except OSError as e:
  print("raised", e.errno)
try:
  writer.close()
except OSError as e:
  print("close raised", e.errno)
print("done")
"""


def test_a_full_disk_is_an_error_in_the_caller_not_a_thread_traceback_or_a_hang(tmp_path):
  """Issue 28, item 6: tensorboardX's own writer thread died on a full disk with a traceback
  (and its next flush waited forever); the writer's failures now reach the caller alone."""
  from test_front_door import _small_disk

  disk = tmp_path / "disk"
  with _small_disk(disk, 256 * 1024):
    # metrics.jsonl on a roomy disk, the events on the full one: TensorBoard's write fails first.
    (disk / "tb").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tb").symlink_to(disk / "tb")
    done = subprocess.run(
      [sys.executable, "-c", _FULL_DISK_CODE, str(tmp_path / "run")],
      capture_output=True,
      text=True,
      timeout=60,
    )
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stdout.split()
  assert lines[:2] == ["raised", str(errno.ENOSPC)] or lines[:2] == ["raised", str(errno.EFBIG)]
  assert lines[-1] == "done"
  assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr, done.stderr
