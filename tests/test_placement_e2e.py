"""`scripts/show_placement.py` as a user runs it: every role of every strategy, one device, a
Hugging Face checkpoint's config.json, what remat, chunking and offload save, and bad input in
one line."""

import pathlib
import re
import subprocess
import sys

import pytest

from rlhfjax.config import from_config_dict
from rlhfjax.config import model as model_config
from rlhfjax.config.hf import read_hf_config
from rlhfjax.placement import Role, build_placement, estimate_memory
from rlhfjax.planner import auto

pytestmark = pytest.mark.e2e

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "show_placement.py"

_TYPO_CONFIG = """
import ml_collections
def get_config():
  return ml_collections.ConfigDict(
    {"model": {"size": "tiny"}, "placement": {"num_devices": 8, "stratgy": "colocated"}})
"""

_OPTIONS_CONFIG = """
import runpy
def get_config():
  cd = runpy.run_path("configs/ppo_tiny.py")["get_config"]("colocated")
  cd.model.roles = {"actor": {"remat": "full", "logprob_chunk_size": 16}}
  cd.offload = {"params": ("reference",), "optimizer": ("actor",)}
  cd.reward.model_coef = 0.5  # a reward model: all five roles placed
  return cd
"""

_GOOD_RUNS = {
  "colocated": ["--config.placement.strategy=colocated"],
  "interleaved": ["--config.placement.strategy=interleaved"],
  # 16 devices on this machine's 8: the README's "planned on a laptop" (emulated up to 64).
  "disaggregated": [
    "--config.placement.strategy=disaggregated",
    "--config.placement.num_devices=16",
  ],
  "explicit": ["--config.placement.strategy=explicit"],
}
_BAD_RUNS = {
  "unknown_strategy": (["--config.placement.strategy=foo"], r"unknown placement strategy 'foo'"),
  "zero_devices": (["--config.placement.num_devices=0"], r"num_devices must be >= 1, got 0"),
  "too_many_devices": (["--config.placement.num_devices=99"], r"num_devices=99 exceeds"),
  "unknown_override": (
    ["--config.placement.stratgy=x"],
    r"--config\.placement\.stratgy: no such field; did you mean --config\.placement\.strategy\?",
  ),
  "unknown_field_in_file": (None, r"unknown config field 'placement\.stratgy'; did you mean"),
  "unknown_size": (["--config.model.size=huge"], r"unknown model size 'huge'"),
  # On one device each strategy that cannot be laid out names the flag to change.
  "one_device_colocated": (
    ["--config.placement.num_devices=1"],
    r"rollout_tensor=2 does not divide its 1 devices; set placement\.rollout_tensor to one of 1$",
  ),
  "one_device_interleaved": (
    ["--config.placement.num_devices=1", "--config.placement.strategy=interleaved"],
    r"needs an even number \(on 1 device\(s\) set placement\.strategy=colocated\)$",
  ),
  "one_device_disaggregated": (
    ["--config.placement.num_devices=1", "--config.placement.strategy=disaggregated"],
    r"need at least 1 for the rollout and 1 for training \(on 1 device\(s\) set "
    r"placement\.strategy=colocated\)$",
  ),
  "one_device_explicit": (
    ["--config.placement.num_devices=1", "--config.placement.strategy=explicit"],
    r"out of range for 1 devices \(valid: 0\.\.0; list those in placement\.explicit\.",
  ),
}
# ... and those that can be laid out on one device are.
_ONE_DEVICE_RUNS = {
  "colocated": ["--config.placement.rollout_tensor=1"],
  "auto": ["--config.placement.strategy=auto", "--config.placement.hardware=h100"],
}


# A Hugging Face checkpoint's architecture from its config.json alone (no weights needed to plan):
# the public Qwen2.5-1.5B-Instruct numbers, on one 80 GiB device.
_QWEN_DIR = "configs/hf/qwen2.5-1.5b-instruct"
_HF_RUN = [
  "--config.model.size=",
  f"--config.model.hf={_QWEN_DIR}",
  "--config.placement.num_devices=1",
  "--config.placement.memory_per_device_gb=80",
  "--config.placement.rollout_tensor=1",
]


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
  """Runs every show_placement case at once (each starts JAX) and returns name -> result."""
  typo = tmp_path_factory.mktemp("configs") / "typo.py"
  typo.write_text(_TYPO_CONFIG)
  options = typo.parent / "options.py"
  options.write_text(_OPTIONS_CONFIG)
  # With a reward model, so that all five roles are placed (a rule reward places no reward).
  cases = {
    name: ["--config=configs/ppo_tiny.py", "--config.reward.model_coef=0.5", *args]
    for name, args in _GOOD_RUNS.items()
  }
  cases["options"] = [f"--config={options}"]
  for name, args in _ONE_DEVICE_RUNS.items():
    cases[f"one_device_{name}_works"] = [
      "--config=configs/ppo_tiny.py",
      "--config.placement.num_devices=1",
      *args,
    ]
  cases["hf"] = ["--config=configs/grpo_tiny.py", *_HF_RUN]
  for name, (args, _) in _BAD_RUNS.items():
    cases[name] = [f"--config={typo}"] if args is None else ["--config=configs/ppo_tiny.py", *args]
  processes = {
    name: subprocess.Popen(
      [sys.executable, str(SCRIPT), *args],
      cwd=REPO,
      text=True,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
    )
    for name, args in cases.items()
  }
  results = {}
  for name, process in processes.items():
    stdout, stderr = process.communicate(timeout=120)
    results[name] = (process.returncode, stdout, stderr)
  return results


@pytest.mark.parametrize("strategy", list(_GOOD_RUNS))
def test_show_placement_prints_every_role(script_runs, strategy):
  returncode, stdout, stderr = script_runs[strategy]
  assert returncode == 0, stderr
  lines = stdout.splitlines()
  n = 16 if strategy == "disaggregated" else 8
  assert lines[0].startswith(f"{strategy} placement on {n} devices")
  for role in Role:
    assert any(line.split()[:1] == [role.value] for line in lines), (role, stdout)
  assert any(line.startswith(f"summary: {strategy} on {n} devices") for line in lines), stdout
  assert lines[-1].startswith("options: peak device"), stdout
  if strategy == "disaggregated":
    assert any(
      line.split()[:5] == ["rollout", "8-15", "data=4", "tensor=2", "generation"] for line in lines
    ), stdout


@pytest.mark.parametrize("strategy", list(_ONE_DEVICE_RUNS))
def test_show_placement_on_one_device(script_runs, strategy):
  returncode, stdout, stderr = script_runs[f"one_device_{strategy}_works"]
  assert returncode == 0, stderr
  lines = stdout.splitlines()
  # auto reports the strategy its planner chose; on one device only colocated fits.
  assert any(line.startswith("colocated placement on 1 devices") for line in lines), stdout
  for role in (Role.ACTOR, Role.CRITIC, Role.ROLLOUT):
    assert any(line.split()[:2] == [role.value, "0"] for line in lines), (role, stdout)


def test_show_placement_plans_a_hugging_face_checkpoint_from_its_config_json(script_runs):
  returncode, stdout, stderr = script_runs["hf"]
  assert returncode == 0, stderr
  lines = stdout.splitlines()
  assert lines[0].startswith("colocated placement on 1 devices")
  model, _ = read_hf_config(REPO / _QWEN_DIR)
  assert (model.num_layers, model.hidden_size, model.param_dtype) == (28, 1536, "bfloat16")
  # The actor trains fp32 masters (`model.fp32_masters`); the reference holds the bf16 weights.
  gib = lambda itemsize: f"{model_config.param_count(model) * itemsize / 2**30:.2f}"
  actor = next(line.split() for line in lines if line.startswith("actor "))
  reference = next(line.split() for line in lines if line.startswith("reference "))
  assert (actor[7], reference[7]) == (gib(4), gib(2)), stdout
  assert any(line.startswith("summary: colocated on 1 devices") for line in lines), stdout


def test_show_placement_prints_what_remat_chunks_and_offload_save(script_runs, monkeypatch):
  returncode, stdout, stderr = script_runs["options"]
  assert returncode == 0, stderr
  lines = stdout.splitlines()
  start = lines.index(next(line for line in lines if line.startswith("memory options per role")))
  assert lines[start].endswith("in MiB (planner's memory model)")
  header = re.split(r"\s{2,}", lines[start + 1].strip())
  rows = {line.split()[0]: line.split() for line in lines[start + 2 : start + 7]}
  assert set(rows) == {role.value for role in Role}
  cell = lambda role, column: rows[role][header.index(column)]
  assert [cell("actor", c) for c in ("remat", "chunk", "offload")] == ["full", "16", "optimizer"]
  assert cell("reference", "offload") == "params" and cell("critic", "offload") == "-"
  # The numbers are the planner's memory model of the actor with and without its options.
  namespace = {}
  monkeypatch.chdir(REPO)
  exec(_OPTIONS_CONFIG, namespace)
  config = from_config_dict(namespace["get_config"]())
  spec = build_placement(config.placement, 8)
  rows_per_step = auto.train_rows(config)
  model = config.model.for_role("actor")
  est = lambda m: estimate_memory(
    Role.ACTOR, spec[Role.ACTOR], m, config.rollout, train_rows=rows_per_step
  )
  with_options = est(model)
  plain = est(model.replace(remat="none", logprob_chunk_size=None)).total
  remat_only = est(model.replace(logprob_chunk_size=None)).total
  mib = lambda n: f"{n / 2**20:.2f}"
  assert cell("actor", "plain") == mib(plain)
  assert cell("actor", "with options") == mib(with_options.total)
  assert cell("actor", "remat saves") == mib(plain - remat_only)
  assert float(cell("actor", "remat saves")) > 0 and float(cell("actor", "chunk saves")) > 0
  assert cell("actor", "idle") == mib(with_options.params + with_options.optimizer)
  assert cell("actor", "idle offloaded") == mib(with_options.params)  # the moments are parked
  assert cell("reference", "idle offloaded") == "-"
  plain_peak, configured_peak = map(float, re.findall(r"([0-9.]+) MiB", lines[-1])[:2])
  assert configured_peak < plain_peak


@pytest.mark.parametrize("case", list(_BAD_RUNS))
def test_show_placement_bad_input_exits_2_with_one_error_line(script_runs, case):
  returncode, stdout, stderr = script_runs[case]
  assert returncode == 2, (stdout, stderr)
  assert "Traceback" not in stderr
  lines = stderr.splitlines()
  assert len(lines) == 1, stderr
  assert lines[0].startswith("error: ")
  assert re.search(_BAD_RUNS[case][1], lines[0], flags=re.IGNORECASE), lines[0]
