"""GRPO side by side with Tunix (the JAX peer) on one model, batch and machine.

  python -m venv .venv-tunix && .venv-tunix/bin/pip install google-tunix==0.1.7
  python scripts/bench_tunix.py --tunix_python=.venv-tunix/bin/python

This script installs nothing. Both systems run a Llama of 2 layers, width 128, 4 heads of 32,
2 KV heads, MLP 512 and a vocabulary of 1024 (random weights, byte tokens) on 8 emulated
devices: GRPO with 8 prompts x 4 samples, 32 new tokens, one epoch and one mini-batch per
iteration, the bundled vowels rule as the reward and k3 KL to the reference in the loss.
Placements: co-located (every role on all 8 devices) and disaggregated (training on 4, the
rollout on the other 4; rlhfjax generates one step off-policy, Tunix overlaps its rollout with
training as it does when the meshes differ).

Each (system, placement) runs in a fresh process, alternating rlhfjax and Tunix for
`--rounds` rounds, so both see the same machine load. One JSON object per (system, placement):
the steady iteration seconds (median of the iterations after `--warmup`, over every round)
and, for Tunix, the ratio Tunix / rlhfjax. Without `--tunix_python`, or if Tunix fails, rlhfjax
is still measured and the Tunix line says why (the command and its last error line).

rlhfjax's roles are data parallel (explicit placement, `data` axis): at this size the weights
fit every device, and the co-located rollout then reads the actor's arrays with no copy
(`rlhfjax.mesh.sharing`). Tunix shards over its default ('fsdp', 'tp') axes with tp = 1.
`--with_fsdp` also runs rlhfjax in the strategies' FSDP layout (`rlhfjax_fsdp` lines), the
layout of the earlier measurements, alternating with the other two.
"""

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_TUNIX_PYTHON = flags.DEFINE_string(
  "tunix_python", "", "Python of a virtualenv with google-tunix==0.1.7 (empty: rlhfjax only)."
)
_PLACEMENTS = flags.DEFINE_list("placements", ["colocated", "disaggregated"], "Placements.")
_ITERATIONS = flags.DEFINE_integer("iterations", 12, "GRPO iterations per run.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "First iterations left out (compiles).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Alternating rounds of both systems.")
_WITH_FSDP = flags.DEFINE_bool(
  "with_fsdp",
  False,
  "Also run rlhfjax in the strategies' FSDP training layout (a copy to the rollout each sync).",
)
_WORKER = flags.DEFINE_string("worker", "", "Internal: the system a child runs.")
_PLACEMENT = flags.DEFINE_string("placement", "colocated", "Internal: the child's placement.")

DEVICES = 8
MODEL = dict(
  num_layers=2,
  hidden_size=128,
  num_heads=4,
  head_dim=32,
  num_kv_heads=2,
  intermediate_size=512,
  vocab_size=1024,
)
PROMPTS, SAMPLES, NEW_TOKENS, PROMPT_LEN = 8, 4, 32, 32
KL_COEF, LEARNING_RATE = 0.01, 1e-3
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_PROMPTS_FILE = os.path.join(_ROOT, "rlhfjax", "data", "bundled", "vowels", "prompts.jsonl")


def _emulate_devices() -> None:
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
  )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ---------------------------------------------------------------------------------------------
# rlhfjax (this interpreter).


def rlhfjax_config(placement: str, iterations: int, fsdp: bool = False):
  """The `ExperimentConfig` of rlhfjax's side: configs/grpo_tiny.py at the benchmark's sizes,
  data parallel (or, with `fsdp`, the `colocated` / `disaggregated` strategies' FSDP)."""
  import runpy

  from rlhfjax.config import from_config_dict

  variant = "disaggregated_async" if placement == "disaggregated" else "colocated"
  cd = runpy.run_path(os.path.join(_ROOT, "configs", "grpo_tiny.py"))["get_config"](variant)
  cd.total_steps = iterations
  cd.model.overrides = dict(MODEL)
  cd.rollout.batch_size = PROMPTS * SAMPLES
  cd.rollout.max_new_tokens = NEW_TOKENS
  cd.rollout.max_prompt_len = PROMPT_LEN
  cd.ppo.group_size = SAMPLES
  cd.ppo.ppo_epochs = cd.ppo.mini_batches = cd.ppo.micro_batches = 1
  cd.ppo.kl_loss_coef = KL_COEF
  cd.actor_optimizer.learning_rate = LEARNING_RATE
  cd.eval.num_prompts = 0
  cd.checkpoint.every_steps = 0
  cd.checkpoint.async_save = False
  if fsdp:
    cd.placement.tensor = cd.placement.rollout_tensor = 1
    return from_config_dict(cd)
  training = tuple(range(DEVICES)) if placement == "colocated" else tuple(range(DEVICES // 2))
  rollout = training if placement == "colocated" else tuple(range(DEVICES // 2, DEVICES))
  cd.placement.strategy = "explicit"
  for role in ("actor", "reference", "critic", "reward"):
    cd.placement.explicit[role] = {
      "devices": training,
      "axes": {"data": len(training)},
      "layout": "training",
    }
  cd.placement.explicit.rollout = {
    "devices": rollout,
    "axes": {"data": len(rollout)},
    "layout": "generation",
  }
  together = ("actor", "reference", "critic", "reward")
  cd.placement.explicit.colocate = (
    (together + ("rollout",),) if placement == "colocated" else (together,)
  )
  return from_config_dict(cd)


def _rlhfjax_times(placement: str, fsdp: bool = False) -> list[float]:
  from rlhfjax import launch
  from rlhfjax.runner import Runner

  launch.quiet_logging()
  cfg = rlhfjax_config(placement, _ITERATIONS.value, fsdp)
  rows = Runner(cfg, tempfile.mkdtemp(), show_progress=False).run().metrics
  return [r["time/iteration"] for r in rows]


# ---------------------------------------------------------------------------------------------
# Tunix (its own virtualenv's interpreter).


class _ByteTokenizer:
  """Bytes 3..258; 0 pads, 1 begins, 2 ends (the methods Tunix's tokenizer adapter asks for)."""

  def encode(self, text, **_):
    return [b + 3 for b in text.encode()]

  def decode(self, ids, **_):
    return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

  def bos_id(self):
    return 1

  def eos_id(self):
    return 2

  def pad_id(self):
    return 0


def _vowel_reward(prompts, completions, **_):
  return [sum(c in "aeiou" for c in s) / len(s.encode()) if s else 0.0 for s in completions]


def _tunix_times(placement: str) -> list[float]:
  import itertools

  import jax
  import numpy as np
  import optax
  from tunix.models import dummy_model_creator
  from tunix.models.llama3 import model as llama3
  from tunix.rl import rl_cluster as rl
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  config = llama3.ModelConfig(
    num_layers=MODEL["num_layers"],
    vocab_size=MODEL["vocab_size"],
    embed_dim=MODEL["hidden_size"],
    hidden_dim=MODEL["intermediate_size"],
    num_heads=MODEL["num_heads"],
    head_dim=MODEL["head_dim"],
    num_kv_heads=MODEL["num_kv_heads"],
    rope_theta=10_000,
    norm_eps=1e-5,
  )
  devices = np.array(jax.devices()[:DEVICES])
  if placement == "colocated":
    train_mesh = rollout_mesh = jax.sharding.Mesh(devices.reshape(DEVICES, 1), ("fsdp", "tp"))
  else:
    half = DEVICES // 2
    train_mesh = jax.sharding.Mesh(devices[:half].reshape(half, 1), ("fsdp", "tp"))
    rollout_mesh = jax.sharding.Mesh(devices[half:].reshape(half, 1), ("fsdp", "tp"))
  create = dummy_model_creator.create_dummy_model
  actor = create(llama3.Llama3, config, mesh=train_mesh, random_seed=0)
  reference = create(llama3.Llama3, config, mesh=train_mesh, random_seed=0)
  cluster_config = rl.ClusterConfig(
    role_to_mesh={
      rl.Role.ACTOR: train_mesh,
      rl.Role.REFERENCE: train_mesh,
      rl.Role.ROLLOUT: rollout_mesh,
    },
    rollout_engine="vanilla",
    offload_to_cpu=False,
    training_config=rl.RLTrainingConfig(
      actor_optimizer=optax.adam(LEARNING_RATE),
      eval_every_n_steps=10**9,
      max_steps=_ITERATIONS.value,
    ),
    rollout_config=base_rollout.RolloutConfig(
      max_tokens_to_generate=NEW_TOKENS,
      max_prompt_length=PROMPT_LEN,
      kv_cache_size=PROMPT_LEN + NEW_TOKENS + 8,
      temperature=1.0,
      top_p=1.0,
      top_k=None,
    ),
  )
  cluster = rl.RLCluster(
    actor=actor, reference=reference, tokenizer=_ByteTokenizer(), cluster_config=cluster_config
  )
  learner = grpo_learner.GRPOLearner(
    rl_cluster=cluster,
    algo_config=grpo_learner.GRPOConfig(
      num_generations=SAMPLES,
      num_iterations=1,
      beta=KL_COEF,
      kl_loss_mode="low_var_kl",  # k3, as configs/grpo_tiny.py
      epsilon=0.2,
    ),
    reward_fns=[_vowel_reward],
  )
  with open(_PROMPTS_FILE) as f:
    # Cut as rlhfjax's `data.on_long_prompt='truncate'` does (one id left for a BOS).
    texts = [json.loads(line)["prompt"][: PROMPT_LEN - 1] for line in f if line.strip()]
  stream = itertools.cycle(texts)
  # One array of strings per batch: Tunix repeats each leaf of a batch along its first axis.
  batches = (
    {"prompts": np.array(list(itertools.islice(stream, PROMPTS)))} for _ in itertools.count()
  )
  ends = []
  step = learner._run_global_step

  def timed(*args, **kwargs):
    out = step(*args, **kwargs)
    ends.append(time.perf_counter())
    return out

  learner._run_global_step = timed
  start = time.perf_counter()
  learner.train(itertools.islice(batches, _ITERATIONS.value))
  marks = [start, *ends]
  return [b - a for a, b in itertools.pairwise(marks)]


# ---------------------------------------------------------------------------------------------
# The driver.


def _child(system: str, placement: str) -> dict:
  python = _TUNIX_PYTHON.value if system == "tunix" else sys.executable
  command = [
    python,
    os.path.abspath(__file__),
    f"--worker={system}",
    f"--placement={placement}",
    f"--iterations={_ITERATIONS.value}",
  ]
  env = dict(os.environ)
  if system == "tunix":
    env.pop("PYTHONPATH", None)  # Tunix's own jax, flax and optax, not this environment's
  proc = subprocess.run(command, capture_output=True, text=True, env=env)
  lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
  if proc.returncode or not lines:
    error = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
    return {"error": error[-1] if error else f"exit status {proc.returncode}", "command": command}
  return json.loads(lines[-1])


def _drive() -> None:
  systems = ["rlhfjax"] + (["rlhfjax_fsdp"] if _WITH_FSDP.value else [])
  systems += ["tunix"] if _TUNIX_PYTHON.value else []
  times: dict[tuple[str, str], list[float]] = {}
  errors: dict[tuple[str, str], dict] = {}
  for _ in range(_ROUNDS.value):
    for placement in _PLACEMENTS.value:
      for system in systems:
        key = (system, placement)
        if key in errors:
          continue
        out = _child(system, placement)
        if "error" in out:
          errors[key] = out
        else:
          times.setdefault(key, []).extend(out["times"][_WARMUP.value :])
  load = os.getloadavg()[0]
  for placement in _PLACEMENTS.value:
    ours = times.get(("rlhfjax", placement))
    base = statistics.median(ours) if ours else None
    for system in systems if "tunix" in systems else [*systems, "tunix"]:
      key = (system, placement)
      row = {"system": system, "placement": placement, "load_1min": round(load, 2)}
      if key in times:
        steady = statistics.median(times[key])
        row["iteration_s"] = round(steady, 4)
        row["iterations_measured"] = len(times[key])
        if system != "rlhfjax" and base:
          row[f"{system}_over_rlhfjax"] = round(steady / base, 3)
      elif key in errors:
        row.update(errors[key])
      else:
        row["error"] = "not run: pass --tunix_python=PATH of a venv with google-tunix==0.1.7"
      print(json.dumps(row), flush=True)


def main(argv):
  del argv
  if not _WORKER.value:
    _drive()
    return
  _emulate_devices()
  run = {
    "rlhfjax": _rlhfjax_times,
    "rlhfjax_fsdp": functools.partial(_rlhfjax_times, fsdp=True),
    "tunix": _tunix_times,
  }[_WORKER.value]
  print(json.dumps({"times": run(_PLACEMENT.value)}), flush=True)


if __name__ == "__main__":
  app.run(main)
