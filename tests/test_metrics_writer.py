"""The metrics writer's TensorBoard events come without importing PyTorch (seconds of start-up
in every run where torch is installed, as with the test extras)."""

import subprocess
import sys

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
