"""SFT and reward-model training: objectives against NumPy, placement equality, learning,
checkpoint resume and the entry points."""

import functools
import json
import os
import re
import runpy
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlhfjax import algorithms as alg
from rlhfjax import config as config_lib
from rlhfjax import models
from rlhfjax.cluster.role import RoleRuntime
from rlhfjax.config.model import get_model_config
from rlhfjax.placement.spec import Role, RoleSpec
from rlhfjax.planner.place import place
from rlhfjax.runner import loop
from rlhfjax.training import reward_model, sft, steps
from rlhfjax.training.state import init_train_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = get_model_config("tiny")


# ---------------------------------------------------------------------------------------------
# Objectives against NumPy.


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _sft_case(seed=0, b=3, s=7, v=11):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(b, s, v)).astype(np.float32) * 3
  tokens = rng.integers(0, v, (b, s)).astype(np.int32)
  mask = np.zeros((b, s), np.float32)
  mask[0, 3:6] = 1
  mask[1, 1:7] = 1
  mask[2, 5:6] = 1
  return logits, tokens, mask


def _numpy_nll_and_accuracy(logits, tokens, mask):
  nll, correct, n = 0.0, 0.0, 0.0
  for i in range(tokens.shape[0]):
    for j in range(1, tokens.shape[1]):
      if mask[i, j]:
        nll -= _log_softmax(logits[i, j - 1].astype(np.float64))[tokens[i, j]]
        correct += float(np.argmax(logits[i, j - 1]) == tokens[i, j])
        n += 1
  return nll / n, correct / n


def test_masked_token_nll_and_accuracy_match_numpy():
  logits, tokens, mask = _sft_case()
  nll, accuracy = _numpy_nll_and_accuracy(logits, tokens, mask)
  np.testing.assert_allclose(alg.masked_token_nll(logits, tokens, mask), nll, rtol=1e-5)
  np.testing.assert_allclose(alg.token_accuracy(logits, tokens, mask), accuracy, rtol=1e-6)


def test_masked_token_nll_ignores_prompt_predictions_and_empty_masks():
  logits, tokens, mask = _sft_case()
  loss = alg.masked_token_nll(logits, tokens, mask)
  changed_logits, changed_tokens = logits.copy(), tokens.copy()
  for i, j in zip(*np.nonzero(mask[:, 1:] == 0), strict=True):  # column j + 1 is not scored
    changed_logits[i, j] = np.random.default_rng(j).normal(size=logits.shape[-1]) * 10
    changed_tokens[i, j + 1] = (tokens[i, j + 1] + 1) % logits.shape[-1]
  np.testing.assert_allclose(
    alg.masked_token_nll(changed_logits, changed_tokens, mask), loss, rtol=1e-6
  )
  assert float(alg.masked_token_nll(logits, tokens, np.zeros_like(mask))) == 0.0


def test_bradley_terry_loss_and_accuracy_match_numpy():
  rng = np.random.default_rng(1)
  chosen, rejected = rng.normal(size=6).astype(np.float32), rng.normal(size=6).astype(np.float32)
  chosen[4] = rejected[4]  # a tie counts as wrong
  valid = np.array([1, 1, 0, 1, 1, 1], np.float32)
  keep = valid > 0
  expected = np.mean(np.log1p(np.exp(-(chosen - rejected).astype(np.float64)))[keep])
  np.testing.assert_allclose(alg.bradley_terry_loss(chosen, rejected, valid), expected, rtol=1e-5)
  np.testing.assert_allclose(
    alg.preference_accuracy(chosen, rejected, valid), np.mean((chosen > rejected)[keep])
  )
  # Stable at huge margins: -log sigmoid(-1000) = 1000, not inf.
  big = alg.bradley_terry_loss(jnp.array([0.0, 1000.0]), jnp.array([1000.0, 0.0]), jnp.ones(2))
  np.testing.assert_allclose(big, 500.0, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The SFT loss on the model.


@pytest.fixture(scope="module")
def lm_params():
  return jax.jit(functools.partial(models.init_params, CONFIG, "lm"))(jax.random.key(0))


def _sft_batch(b=4, prompt=6, response=5, s=16, seed=0):
  rng = np.random.default_rng(seed)
  tokens = np.full((b, s), 258, np.int32)
  tokens[:, : prompt + response] = rng.integers(0, 256, (b, prompt + response))
  attention = np.zeros((b, s), np.int32)
  attention[:, : prompt + response] = 1
  loss_mask = np.zeros((b, s), np.float32)
  loss_mask[:, prompt : prompt + response] = 1
  return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask}


def test_sft_loss_is_the_response_nll_and_ignores_padding(lm_params):
  batch = _sft_batch()
  loss, metrics = sft.sft_loss(lm_params, batch, config=CONFIG)
  logits = np.asarray(models.forward_logits(CONFIG, lm_params, batch["tokens"]))
  nll, accuracy = _numpy_nll_and_accuracy(logits, batch["tokens"], batch["loss_mask"])
  np.testing.assert_allclose(loss, nll, rtol=1e-4)
  np.testing.assert_allclose(metrics["token_accuracy"], accuracy, atol=1e-6)
  padded = {**batch, "tokens": batch["tokens"].copy()}
  padded["tokens"][:, 12:] = 7  # pad columns: neither attended to nor scored
  np.testing.assert_allclose(sft.sft_loss(lm_params, padded, config=CONFIG)[0], loss, rtol=1e-6)


def test_sft_loss_scores_response_tokens_not_prompt_tokens(lm_params):
  batch = _sft_batch()
  loss = float(sft.sft_loss(lm_params, batch, config=CONFIG)[0])
  response = {**batch, "tokens": batch["tokens"].copy()}
  response["tokens"][:, 8] = (response["tokens"][:, 8] + 1) % 256
  assert abs(float(sft.sft_loss(lm_params, response, config=CONFIG)[0]) - loss) > 1e-4
  # Marking prompt tokens as targets changes the loss: the default mask really excludes them.
  with_prompt = {**batch, "loss_mask": batch["attention_mask"].astype(np.float32)}
  assert abs(float(sft.sft_loss(lm_params, with_prompt, config=CONFIG)[0]) - loss) > 1e-4


def test_preference_loss_scores_last_real_tokens_in_one_forward(lm_params):
  # A value model is the trunk plus a value head (no second initialisation to compile).
  params = {k: v for k, v in lm_params.items() if k != "lm_head"}
  params["value_head"] = jax.random.normal(jax.random.key(2), (CONFIG.hidden_size,))
  a, b = _sft_batch(seed=1), _sft_batch(seed=2)
  b["attention_mask"][:, 9:] = 0  # rejected sequences shorter
  batch = {
    "chosen_tokens": a["tokens"],
    "chosen_mask": a["attention_mask"],
    "rejected_tokens": b["tokens"],
    "rejected_mask": b["attention_mask"],
    "valid": np.array([1, 1, 1, 0], np.float32),
  }
  loss, metrics = reward_model.preference_loss(params, batch, config=CONFIG)
  values_a = models.forward_values(CONFIG, params, a["tokens"], a["attention_mask"])
  values_b = models.forward_values(CONFIG, params, b["tokens"], b["attention_mask"])
  chosen, rejected = np.asarray(values_a[:, 10]), np.asarray(values_b[:, 8])
  margin = (chosen - rejected)[:3]
  np.testing.assert_allclose(loss, np.mean(np.log1p(np.exp(-margin))), rtol=1e-4)
  np.testing.assert_allclose(metrics["accuracy"], np.mean(margin > 0))


# ---------------------------------------------------------------------------------------------
# One SFT step on 1 device equals the step on 8 (fsdp=4 x tensor=2).


def _one_step(spec: RoleSpec, params, batch):
  runtime = RoleRuntime.create(Role.ACTOR, spec, CONFIG, "lm")
  tx = optax.sgd(0.5)  # params move by the gradient itself (Adam's first step is ~sign(g))
  loss_fn = functools.partial(sft.sft_loss, config=CONFIG)
  shardings = runtime.train_state_shardings(tx)
  state = jax.jit(init_train_state, static_argnums=1, out_shardings=shardings)(
    jax.device_put(params, runtime.param_shardings), tx
  )
  micro = steps.split_micro_batches(batch, 2)
  batch_shardings = runtime.batch_shardings(micro, leading=1)
  step = jax.jit(
    functools.partial(steps.accumulate_and_apply, loss_fn, tx),
    in_shardings=(shardings, batch_shardings),
    out_shardings=(shardings, runtime.replicated),
    donate_argnums=0,
  )
  new_state, metrics = step(state, jax.device_put(micro, batch_shardings))
  return runtime, new_state, metrics


def test_sft_step_on_one_device_equals_step_on_eight(lm_params):
  batch = _sft_batch(b=8)
  _, one, m1 = _one_step(RoleSpec.training([0]), lm_params, batch)
  runtime, eight, m8 = _one_step(RoleSpec.training(range(8), fsdp=4, tensor=2), lm_params, batch)
  np.testing.assert_allclose(m1["loss"], m8["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m8["grad_norm"], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
  kernel = eight.params["layers"]["mlp"]["up_proj"]["kernel"]
  assert kernel.sharding == runtime.param_shardings["layers"]["mlp"]["up_proj"]["kernel"]
  assert len({s.device for s in kernel.addressable_shards}) == 8
  assert {d.id for d in one.params["embedding"].sharding.device_set} == {0}


# ---------------------------------------------------------------------------------------------
# The SFT and reward-model flows: learning, placement, resume.


def _load_config(path: str, cls=config_lib.ExperimentConfig, **fields):
  config = runpy.run_path(os.path.join(REPO, path))["get_config"]().to_dict()
  for dotted, value in fields.items():
    *parents, leaf = dotted.split("__")
    node = config
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config_lib.from_config_dict(config, cls)


@pytest.mark.parametrize(
  ("path", "role"),
  [
    ("configs/sft_tiny.py", Role.ACTOR),
    ("configs/rm_tiny.py", Role.REWARD),
  ],
)
def test_shipped_configs_load_and_validate(path, role):
  cfg = _load_config(path)
  assert cfg.model.size == "tiny" and cfg.placement.num_devices == 8
  spec = place(cfg, 8)[role]
  assert spec.axes == (("data", 1), ("fsdp", 4), ("tensor", 2))


def _small(path, cls, workdir, **fields):
  defaults = dict(
    placement__num_devices=4,
    placement__tensor=2,
    supervised__batch_size=16,
    supervised__micro_batches=2,
    supervised__max_len=48,
    eval__every_steps=0,
    log_every=1,
    data__data_dir=str(workdir.parent / "data"),
    checkpoint__every_steps=6,
    checkpoint__async_save=False,
  )
  return _load_config(path, cls, **{**defaults, **fields})


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("sft") / "run"
  cfg = _small("configs/sft_tiny.py", config_lib.ExperimentConfig, workdir, total_steps=12)
  trainer = loop.Runner(cfg, str(workdir), show_progress=False)
  return workdir, trainer, trainer.run()


def _eval_rows(result):
  return [row for row in result.metrics if any(k.startswith("eval/") for k in row)]


@pytest.mark.slow
def test_sft_run_lowers_eval_loss_on_the_role_devices(sft_run):
  workdir, trainer, result = sft_run
  evals = _eval_rows(result)
  assert [row["step"] for row in evals] == [0, 12]
  assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] - 1.0, evals
  assert result.compilations == {"eval_step": 1, "train_step": 1}
  for leaf in jax.tree.leaves(trainer.cluster.states[Role.ACTOR]):
    assert {s.device.id for s in leaf.addressable_shards} == {0, 1, 2, 3}
  assert {"loss.png", "eval_loss.png", "metrics.jsonl"} <= set(os.listdir(workdir))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "6"]


@pytest.mark.slow
def test_sft_rerun_resumes_from_the_checkpoint(sft_run):
  workdir, trainer, first = sft_run
  cfg = _small("configs/sft_tiny.py", config_lib.ExperimentConfig, workdir, total_steps=15)
  again = loop.Runner(cfg, str(workdir), show_progress=False)
  state, first_state = again.cluster.states[Role.ACTOR], trainer.cluster.states[Role.ACTOR]
  assert again.start_step == 12 and int(state.step) == 12
  # The data iterator continues where the first run stopped, not from the start.
  assert again.flow.train.get_state() == trainer.flow.train.get_state()
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(first_state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  result = again.run()
  assert (result.start_step, result.final_step) == (12, 15)
  with open(workdir / "metrics.jsonl") as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == sorted(set(steps)) and steps[-1] == 15


@pytest.mark.slow
def test_reward_model_from_sft_beats_chance_on_held_out_pairs(sft_run, tmp_path):
  sft_workdir, _, _ = sft_run
  cfg = _small(
    "configs/rm_tiny.py",
    config_lib.ExperimentConfig,
    tmp_path / "rm",
    total_steps=20,
    init__reward=str(sft_workdir / "checkpoints"),
  )
  trainer = loop.Runner(cfg, str(tmp_path / "rm"), show_progress=False)
  params = trainer.cluster.states[Role.REWARD].params
  assert not np.any(np.asarray(params["value_head"]))  # fresh head at zero
  result = trainer.run()
  first, last = _eval_rows(result)[0], _eval_rows(result)[-1]
  assert last["eval/accuracy"] > 0.6, (first, last)
  assert last["eval/loss"] < first["eval/loss"]


# ---------------------------------------------------------------------------------------------
# Entry points.


def _script(name, *args, workdir, cwd=REPO):
  return subprocess.run(
    [sys.executable, os.path.join(REPO, "scripts", name), f"--workdir={workdir}", *args],
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  ("script", "config", "metric"),
  [
    ("train_sft.py", "configs/sft_tiny.py", "eval/loss"),
    ("train_rm.py", "configs/rm_tiny.py", "eval/accuracy"),
  ],
)
def test_scripts_train_end_to_end(tmp_path, script, config, metric):
  """From another current directory, with a relative workdir and data directory (orbax wants
  absolute paths: the entry point makes them so), then resumed the same way."""
  run = functools.partial(
    _script,
    script,
    f"--config={os.path.join(REPO, config)}",
    "--config.placement.num_devices=2",
    "--config.placement.tensor=1",
    "--config.supervised.batch_size=8",
    "--config.supervised.micro_batches=1",
    "--config.data.data_dir=data",
    workdir="runs/run",
    cwd=tmp_path,
  )
  result = run("--config.total_steps=3")
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(rf"{metric} [\d.]+ -> [\d.]+; steps 0 -> 3", result.stdout), result.stdout
  assert os.path.isdir(tmp_path / "runs" / "run" / "checkpoints" / "3")
  assert os.path.isdir(tmp_path / "data")
  resumed = run("--config.total_steps=4")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "steps 3 -> 4" in resumed.stdout, resumed.stdout
  assert os.path.isdir(tmp_path / "runs" / "run" / "checkpoints" / "4")


@pytest.mark.parametrize(
  ("script", "args", "pattern"),
  [
    (
      "train_sft.py",
      ["--config.supervised.batch_sise=4"],
      r"--config\.supervised\.batch_sise: no such field; did you mean "
      r"--config\.supervised\.batch_size\?",
    ),
    ("train_rm.py", ["--config.supervised.micro_batches=3"], r"'micro_batches'=3 must divide"),
    ("train_sft.py", ["--config.placement.tensor=3"], r"tensor=3 does not divide"),
  ],
)
def test_scripts_fail_in_one_line_on_bad_config(tmp_path, script, args, pattern):
  config = "configs/sft_tiny.py" if script == "train_sft.py" else "configs/rm_tiny.py"
  result = _script(script, f"--config={config}", *args, workdir=tmp_path)
  assert result.returncode == 2, (result.stdout, result.stderr)
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  assert re.search(pattern, lines[0], flags=re.IGNORECASE), lines[0]
