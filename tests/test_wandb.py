"""Weights & Biases beside metrics.jsonl (`logging.wandb=True`), offline: each run's `.wandb` file
is read back record by record and compared with metrics.jsonl. (Without the package:
tests/test_wandb_e2e.py.)"""

import glob
import json
import os
import pathlib
import runpy
import struct
import sys
import types

import pytest

from rlhfjax import config as config_lib
from rlhfjax.observe import wandb_log
from rlhfjax.observe.metrics import MetricsWriter
from rlhfjax.observe.wandb_log import RUN_FILE
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _offline(root: pathlib.Path, mp: pytest.MonkeyPatch) -> None:
  """No network, no W&B files outside `root`, no W&B banner."""
  for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    mp.setenv(name, str(root / name.lower()))
  mp.setenv("WANDB_MODE", "offline")
  mp.setenv("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
  _offline(tmp_path, monkeypatch)


# W&B's run file: a LevelDB-style log of protobuf `Record`s (header ':W&B', 0xBEE1, version),
# 32 KiB blocks, each record chunk with a 7-byte header: crc32, length, type (full/first/.../last).
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: str) -> list:
  data = pathlib.Path(path).read_bytes()
  assert data[:4] == b":W&B", path
  from wandb.proto import wandb_internal_pb2  # 0.4 s to import: only where read

  records, pos, pending = [], 7, b""
  while pos + 7 <= len(data):
    if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
      pos += _BLOCK - pos % _BLOCK
      continue
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    if length == 0 and kind == 0:
      break
    chunk = data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
    if kind in (_FULL, _LAST):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      records.append(record)
  return records


def _offline_runs(workdir) -> list[list]:
  """The records of each offline W&B run in `workdir`, oldest first."""
  files = sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")))
  return [_records(f) for f in files]


def _history(records) -> list[dict]:
  rows = []
  for r in records:
    if r.WhichOneof("record_type") == "history":
      row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
      rows.append({"step": row.pop("_step"), **row})
  return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def _run_ids(records) -> set[str]:
  return {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}


def _config_items(records) -> dict:
  items = {}
  for r in records:
    kind = r.WhichOneof("record_type")
    update = r.config.update if kind == "config" else r.run.config.update if kind == "run" else []
    items.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in update})
  return items


def _grpo(total_steps: int, **logging):
  cd = runpy.run_path(str(ROOT / "configs" / "grpo_tiny.py"))["get_config"]()
  cd.total_steps = total_steps
  cd.rollout.batch_size = 8
  cd.rollout.max_prompt_len = 24
  cd.rollout.max_new_tokens = 8
  cd.eval.num_prompts = 0
  cd.checkpoint.async_save = False
  cd.logging.update({"wandb": True, **logging})
  return config_lib.from_config_dict(cd)


@pytest.fixture(scope="module")
def grpo_resumed(tmp_path_factory):
  """A GRPO run of 2 steps, then the same workdir raised to 3 (a resume from step 2)."""
  workdir = str(tmp_path_factory.mktemp("grpo") / "run")
  with pytest.MonkeyPatch.context() as mp:
    _offline(tmp_path_factory.mktemp("wandb_env"), mp)
    first = Runner(_grpo(2, wandb_run_name="grpo-test"), workdir, show_progress=False).run()
    runs_after_first = _offline_runs(workdir)
    second = Runner(_grpo(3, wandb_run_name="grpo-test"), workdir, show_progress=False).run()
  return workdir, first, second, runs_after_first


@pytest.mark.slow
def test_a_grpo_run_logs_the_rows_of_metrics_jsonl_and_its_config(grpo_resumed):
  workdir, first, _, runs_after_first = grpo_resumed
  assert first.start_step == 0
  (records,) = runs_after_first
  logged = _history(records)
  assert [row["step"] for row in logged] == [0, 1]
  rows = MetricsWriter.read(os.path.join(workdir, "metrics.jsonl"))[:2]
  assert logged == rows  # same steps, keys and float values (both JSON of the same float64)
  config = _config_items(records)
  assert config["algorithm"]["name"] == "grpo"
  assert config["rollout"]["batch_size"] == 8 and config["total_steps"] == 2
  assert config["logging"]["wandb"] is True
  assert any(r.run.display_name == "grpo-test" for r in records if r.HasField("run"))


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run_and_logs_each_step_once(grpo_resumed):
  workdir, first, second, _ = grpo_resumed
  assert second.start_step == 2
  runs = _offline_runs(workdir)
  assert len(runs) == 2
  run_id = json.loads(pathlib.Path(workdir, RUN_FILE).read_text())["id"]
  assert [_run_ids(records) for records in runs] == [{run_id}, {run_id}]
  logged = [row for records in runs for row in _history(records)]
  assert [row["step"] for row in logged] == [0, 1, 2]
  assert logged == MetricsWriter.read(os.path.join(workdir, "metrics.jsonl"))


class _FakeWandb(types.SimpleNamespace):
  """`wandb` recording what it is asked, for a test of two runs less than a second apart (W&B
  names an offline run's directory by the second it starts in)."""

  def __init__(self):
    super().__init__(calls=[], Settings=dict)

  def init(self, **kwargs):
    self.calls.append(("init", kwargs["id"], kwargs["resume"]))
    return types.SimpleNamespace(
      log=lambda row, step: self.calls.append(("log", step, row)),
      finish=lambda: self.calls.append(("finish",)),
    )


def test_steps_an_interrupted_run_logged_are_not_logged_again(tmp_path, monkeypatch):
  """A run killed after logging step 2 but checkpointed at step 1 reruns step 2: the W&B run
  keeps its one row of step 2; the resumed run continues the same W&B run."""
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  cfg = config_lib.from_config_dict(
    {"model": {"size": "tiny"}, "logging": {"wandb": True}}, config_lib.ExperimentConfig
  )
  workdir = str(tmp_path / "run")
  first = MetricsWriter(workdir, wandb=wandb_log.for_run(cfg, workdir))
  for step in range(3):
    first.write(step, {"loss": float(step)})
  first.close()
  again = MetricsWriter(workdir, start_step=1, wandb=wandb_log.for_run(cfg, workdir))
  for step in range(1, 4):
    again.write(step, {"loss": 10.0 + step})
  again.close()
  run_id = json.loads(pathlib.Path(workdir, RUN_FILE).read_text())["id"]
  assert fake.calls == [
    ("init", run_id, "allow"),
    ("log", 0, {"loss": 0.0}),
    ("log", 1, {"loss": 1.0}),
    ("log", 2, {"loss": 2.0}),
    ("finish",),
    ("init", run_id, "allow"),
    ("log", 3, {"loss": 13.0}),
    ("finish",),
  ]
  assert [row["loss"] for row in MetricsWriter.read(os.path.join(workdir, "metrics.jsonl"))] == [
    0.0,
    11.0,
    12.0,
    13.0,
  ]


def test_a_writer_that_logs_nothing_starts_no_wandb_run(tmp_path, monkeypatch):
  """A finished rerun writes no row: it must start no W&B run and leave no W&B file."""
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  cfg = config_lib.from_config_dict(
    {"model": {"size": "tiny"}, "logging": {"wandb": True}}, config_lib.ExperimentConfig
  )
  workdir = tmp_path / "run"
  MetricsWriter(str(workdir), start_step=3, wandb=wandb_log.for_run(cfg, str(workdir))).close()
  assert fake.calls == [] and sorted(os.listdir(workdir)) == ["tb"]


@pytest.mark.slow
def test_an_sft_run_logs_its_rows(tmp_path):
  workdir = tmp_path / "sft"
  cd = runpy.run_path(str(ROOT / "configs" / "sft_tiny.py"))["get_config"]().to_dict()
  cd.update(total_steps=2, log_every=1)
  cd["supervised"].update(batch_size=8, max_len=32)
  cd["eval"]["every_steps"] = 0
  cd["placement"].update(num_devices=2, tensor=1)
  cd["data"]["data_dir"] = str(tmp_path / "data")
  cd["checkpoint"]["async_save"] = False
  cd["logging"]["wandb"] = True
  cfg = config_lib.from_config_dict(cd)
  Runner(cfg, str(workdir), show_progress=False).run()
  (records,) = _offline_runs(workdir)
  logged = _history(records)
  assert [row["step"] for row in logged] == [0, 1, 2]
  assert logged == MetricsWriter.read(str(workdir / "metrics.jsonl"))
  assert "train/loss" in logged[1] and "eval/loss" in logged[0]
  assert _config_items(records)["supervised"]["batch_size"] == 8


def test_a_bad_wandb_mode_is_one_line():
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.LoggingSection(wandb_mode="offlien")
  assert str(error.value) == (
    "'logging.wandb_mode' must be empty or one of online, offline, disabled, got 'offlien'"
  )
