"""Interruptible generation with bounded staleness (`ppo.max_staleness`, `rlhfjax.flows.partial`):
weights swapped in between decode calls, every token's version recorded and within the bound,
the behaviour log-probs in the actor's loss, resume, a worker's errors and shutdown."""

import shutil
import threading

import jax
import numpy as np
import pytest
from runs_testing import deterministic, shipped_config

from rlhfjax import checkpoint as ckpt
from rlhfjax import models, programs, rollout
from rlhfjax.algorithms import losses
from rlhfjax.config import ConfigError
from rlhfjax.config.model import get_model_config
from rlhfjax.flows import stages
from rlhfjax.placement.spec import RoleSpec
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_BASE = {
  "total_steps": 3,
  "rollout.batch_size": 8,
  "rollout.max_new_tokens": 8,
  "rollout.slots": 2,
  "rollout.decode_chunk": 2,
  "eval.num_prompts": 0,
  "ppo.ppo_epochs": 1,
}


def _config(variant: str = "disaggregated", **changes):
  """GRPO on the tiny model: 2 prompts x 4 samples, 8 new tokens, 2 decode slots and decode
  calls of at most 2 steps (so a batch takes several decode calls: the boundaries a sync lands
  on); `changes` as `ppo__field`."""
  dotted = {name.replace("__", "."): value for name, value in changes.items()}
  return shipped_config("grpo_tiny", {**_BASE, **dotted}, variant)


def _land_syncs_mid_batch(worker, k: int, steps: int) -> None:
  """Makes every sync land at a known point: the sync to version v waits until batch
  j = v + k - 1 (the newest the bound lets version v - 1 start) reached its second decode call,
  and batch j >= k holds that call until the sync is posted. So batch j >= k starts with
  version j - k and its rows are mid-answer when version j - k + 1 lands: tokens of both."""
  reached = {j: threading.Event() for j in range(steps)}

  def hook(batch: int, call: int) -> None:
    if call == 1:
      reached[batch].set()
      if batch >= k:
        worker.wait_posted(batch - k + 1)

  sync = worker.sync

  def sync_when_reached(version: int, iteration: int) -> int:
    if version + k - 1 < steps:
      assert reached[version + k - 1].wait(timeout=300), "the batch never reached the call"
    return sync(version, iteration)

  worker.before_decode_call = hook
  worker.sync = sync_when_reached


# ---------------------------------------------------------------------------------------------
# The engine: weights swapped in between decode calls.

_MODEL = get_model_config("tiny")
_SAMPLING = rollout.SamplingParams(temperature=1.0, max_new_tokens=9, stop_token_ids=(3, 7))


def _prompts(n=10):
  rng = np.random.default_rng(0)
  return [rng.integers(0, _MODEL.vocab_size, int(k)).tolist() for k in rng.integers(1, 8, n)]


@pytest.fixture(scope="module")
def weights():
  return [models.init_params(_MODEL, "lm", jax.random.key(seed)) for seed in (1, 2)]


def _engine(params):
  # The engine's calls are `decode_chunk` steps long once a hook is set: 2 here, so a swap
  # lands mid-answer.
  config = rollout.EngineConfig(num_slots=4, prompt_buckets=(8,), max_new_tokens=9, decode_chunk=2)
  spec = RoleSpec.generation([0, 1, 2, 3], data=2, tensor=2)
  return rollout.Engine.for_role(_MODEL, config, spec, params)


def test_weights_swapped_between_decode_calls_version_each_token(weights):
  a, b = weights
  prompts = _prompts()
  only_a = _engine(a).generate(prompts, sampling=_SAMPLING, seed=5)
  engine = _engine(a)
  assert engine.params_version == 1
  calls = []

  def swap():
    calls.append(engine.params_version)
    if len(calls) == 2:  # before the second decode call
      engine.update_params(b)

  out = engine.generate(prompts, sampling=_SAMPLING, seed=5, on_decode_call=swap)
  assert engine.params_version == 2 and len(calls) == out.decode_calls > 2
  versions, lengths = out.versions, out.lengths
  assert np.all(versions[~out.mask] == -1)
  spans = 0
  for i, n in enumerate(lengths):
    v = versions[i, :n]
    # Each response: tokens of the first weights, then of the second (never back).
    assert set(v.tolist()) <= {1, 2} and np.all(np.diff(v) >= 0), v
    if v[0] == 2:  # its prompt may have been prefilled (queued) before the swap
      continue
    if v[-1] == 1:  # done before it: the first weights' response
      np.testing.assert_array_equal(out.tokens[i], only_a.tokens[i])
      np.testing.assert_allclose(out.logprobs[i], only_a.logprobs[i], atol=1e-5, rtol=0)
    else:  # mid-answer: the first weights' tokens up to the swap, the KV cache kept
      spans += 1
      a_part = int(np.sum(v == 1))
      np.testing.assert_array_equal(out.tokens[i, :a_part], only_a.tokens[i, :a_part])
  assert spans >= 1 and any(v[0] == 2 for v in versions) and any(v[0] == 1 for v in versions)


# ---------------------------------------------------------------------------------------------
# Configuration.


def test_max_staleness_config_errors(tmp_path):
  with pytest.raises(ConfigError, match=r"'ppo.max_staleness' must be >= 0"):
    _config(ppo__max_staleness=-1)
  with pytest.raises(
    ConfigError, match=r"^'ppo.async_rollout' .* and 'ppo.max_staleness'=1 .*: set one$"
  ):
    _config(ppo__max_staleness=1, ppo__async_rollout=True)
  with pytest.raises(ValueError, match=r"^ppo.max_staleness needs the rollout on its own devices"):
    Runner(_config("colocated", ppo__max_staleness=1), str(tmp_path / "a"), show_progress=False)
  with pytest.raises(ConfigError, match="'rollout.fused_scoring' .* 'ppo.max_staleness'"):
    Runner(
      _config(ppo__max_staleness=1, rollout__fused_scoring=True),
      str(tmp_path / "b"),
      show_progress=False,
    )
  with pytest.raises(ConfigError, match="synchronous rollout, not 'ppo.max_staleness'"):
    Runner(
      _config(ppo__max_staleness=2, ppo__dynamic_sampling_rounds=1),
      str(tmp_path / "c"),
      show_progress=False,
    )


def test_max_staleness_0_is_the_synchronous_flow(tmp_path):
  default = Runner(_config(total_steps=2), str(tmp_path / "default"), show_progress=False)
  zero = Runner(
    _config(total_steps=2, ppo__max_staleness=0), str(tmp_path / "zero"), show_progress=False
  )
  assert zero.flow.partial is None and not zero.flow.off_policy
  a, b = default.run().metrics, zero.run().metrics
  assert [deterministic(r) for r in a] == [deterministic(r) for r in b]
  assert not any(key.startswith("rollout/staleness") for key in b[0])


# ---------------------------------------------------------------------------------------------
# Runs.


def _iterate(runner, steps: int, check) -> list[dict]:
  """Runs the iterations one by one (calling `check(iteration, row)` after each), then closes
  the flow as the runner does."""
  rows = []
  try:
    for i in range(steps):
      rows.append(runner.iterate(i))
      check(i, rows[-1])
  finally:
    runner.flow.close()
  return rows


@pytest.mark.parametrize("k", [1, 2])
def test_every_token_is_within_the_bound_and_syncs_land_mid_batch(tmp_path, k):
  steps = 4
  runner = Runner(
    _config(total_steps=steps, ppo__max_staleness=k), str(tmp_path), show_progress=False
  )
  worker = runner.flow.partial
  _land_syncs_mid_batch(worker, k, steps)

  def check(i, row):
    versions = runner.flow.versions_bt
    tokens = versions[versions >= 0]
    assert tokens.size == round(row["response/length"] * 8)
    assert i - k <= tokens.min() and tokens.max() <= i, (i, versions)
    assert row["rollout/staleness_max"] == i - tokens.min() <= k
    assert row["rollout/staleness_mean"] == pytest.approx(np.mean(i - tokens))
    spans = [len(set(v[v >= 0].tolist())) > 1 for v in versions]
    assert row["rollout/interrupted_frac"] == pytest.approx(np.mean(spans))
    if i >= k:  # the sync to i - k + 1 landed while this batch generated
      assert any(spans) and row["rollout/syncs_mid_batch"] >= 1
      assert tokens.min() == i - k  # its first tokens are as old as the bound allows
    else:  # generated by version 0 before any sync
      assert tokens.max() == 0 and row["rollout/syncs_mid_batch"] == 0
    assert row["sync/bytes"] > 0

  rows = _iterate(runner, steps, check)
  assert {r["step"] for r in rows} == set(range(steps))
  # The worker left with the flow; the engine holds the last update's weights.
  assert not worker._thread.is_alive()
  assert worker._version == steps


@pytest.fixture
def programs_built_anew():
  """The test patches a function the programs trace: no program built before it (without the
  patch) is shared with it, and none built with the patch outlives it."""
  programs.clear()
  yield
  programs.clear()


@pytest.mark.parametrize("packing", [True, False])
def test_the_actor_loss_weighs_tokens_by_their_behaviour_logprobs(
  tmp_path, monkeypatch, packing, programs_built_anew
):
  """The importance weights the actor's loss (padded or packed) reads are the truncated ratios
  to the rollout's own log-probs, token by token, in a batch whose tokens span two versions
  (decoupled PPO: `ppo.rollout_correction='none'` is 'tis' when generating ahead)."""
  seen = []

  def spy(logp, old, advantages, *, weights_bt=None, **kw):
    assert weights_bt is not None, "the actor's loss got no importance weights"
    jax.debug.callback(lambda o, w: seen.append((np.asarray(o), np.asarray(w))), old, weights_bt)
    return original(logp, old, advantages, weights_bt=weights_bt, **kw)

  original = losses.policy_token_terms
  monkeypatch.setattr(losses, "policy_token_terms", spy)
  monkeypatch.setattr("rlhfjax.algorithms.policy_token_terms", spy)
  runner = Runner(
    _config(total_steps=2, ppo__max_staleness=1, ppo__packing=packing),
    str(tmp_path),
    show_progress=False,
  )
  cap = runner.cfg.ppo.rollout_correction_cap
  worker = runner.flow.partial
  _land_syncs_mid_batch(worker, 1, 2)
  batches = []
  take = worker.take
  worker.take = lambda batch: batches.append(take(batch)) or batches[-1]

  def check(i, row):
    jax.effects_barrier()
    got = batches[i]
    mask = got.seqs.response_mask_bt > 0
    want = np.sort(got.seqs.rollout_logprobs_bt[mask].astype(np.float64))
    old = np.concatenate([o.reshape(-1) for o, _ in seen]).astype(np.float64)
    weights = np.concatenate([w.reshape(-1) for _, w in seen]).astype(np.float64)
    # Every response token once per epoch, weighed min(exp(old - rollout), cap) > 0 (padding
    # slots weigh 0): below the cap, the weight gives back the token's rollout log-prob.
    real = weights > 0
    assert real.sum() == mask.sum()
    kept = real & (weights < cap)
    behaviour = np.sort(old[kept] - np.log(weights[kept]))
    nearest = want[np.clip(np.searchsorted(want, behaviour), 0, len(want) - 1)]
    below = want[np.clip(np.searchsorted(want, behaviour) - 1, 0, len(want) - 1)]
    # float32 log-probs and weights: |d log w| <= 2^-23 * (1 + |log w|), plus old's own ulp.
    tol = 4e-6 * (1.0 + np.abs(behaviour))
    assert np.all(np.minimum(np.abs(nearest - behaviour), np.abs(below - behaviour)) <= tol)
    np.testing.assert_array_equal(weights[real & ~kept], cap)
    if i == 1:  # version-0 tokens trained by version 1: the actor's log-probs differ
      assert np.max(np.abs(weights[real] - 1.0)) > 1e-4
      assert got.versions_bt[mask].min() == 0 and got.versions_bt.max() == 1
    assert row["rollout_correction/corrected_frac"] == pytest.approx(
      np.mean(weights[real] >= cap), abs=1e-6
    )
    seen.clear()

  _iterate(runner, 2, check)


def test_resume_regenerates_the_pending_batches_within_the_bound(tmp_path):
  k, steps = 2, 4
  changes = {"total_steps": steps, "ppo__max_staleness": k, "checkpoint__every_steps": 2}
  whole = Runner(_config(**changes), str(tmp_path), show_progress=False)
  result = whole.run()
  assert all(r["rollout/staleness_max"] <= k for r in result.metrics)
  directory = tmp_path / "checkpoints"
  assert ckpt.complete_steps(directory) == [2, steps]
  meta = ckpt.read_meta(directory / "2")
  assert len(meta["pending_prompts"]) == 2  # batches 2 and 3, drawn, not trained
  final_data = ckpt.read_meta(directory / str(steps))["data"]
  shutil.rmtree(directory / str(steps))  # as if killed after the checkpoint of step 2

  resumed = Runner(_config(**changes), str(tmp_path), show_progress=False)
  assert resumed.start_step == 2
  submitted = []
  submit = resumed.flow.partial.submit
  resumed.flow.partial.submit = lambda batch, prompts: (
    submitted.append((batch, prompts.tokens)) or submit(batch, prompts)
  )
  rows = resumed.run().metrics
  # The pending batches were generated again from their saved prompts, and nothing else.
  assert [batch for batch, _ in submitted] == [2, 3]
  assert [tokens for _, tokens in submitted] == [p["tokens"] for p in meta["pending_prompts"]]
  assert ckpt.read_meta(directory / str(steps))["data"] == final_data
  assert [r["step"] for r in rows] == [2, 3]
  assert all(0 <= r["rollout/staleness_max"] <= k for r in rows)


def test_a_worker_error_reaches_the_run_as_it_is(tmp_path):
  runner = Runner(_config(ppo__max_staleness=1), str(tmp_path), show_progress=False)
  error = ValueError("the rollout broke")

  def hook(batch, call):
    if batch == 1:
      raise error

  runner.flow.partial.before_decode_call = hook
  with pytest.raises(ValueError) as raised:
    runner.run()
  assert raised.value is error
  assert not runner.flow.partial._thread.is_alive()


def test_close_stops_a_worker_in_the_middle_of_a_batch(tmp_path):
  runner = Runner(_config(ppo__max_staleness=1), str(tmp_path), show_progress=False)
  worker = runner.flow.partial
  inside = threading.Event()

  def hook(batch, call):
    inside.set()
    worker.wait_posted(100)  # never posted: only `close` ends this wait

  worker.before_decode_call = hook
  worker.start(0)
  worker.submit(0, stages.grouped_prompts(runner.ctx, 4))
  assert inside.wait(timeout=120)
  runner.flow.close()
  assert not worker._thread.is_alive()
  with pytest.raises(RuntimeError, match="closed"):
    worker.submit(1, stages.grouped_prompts(runner.ctx, 4))


def test_async_rollout_resumes_exactly(tmp_path):
  """`ppo.async_rollout` (one batch ahead, synced between batches) keeps its exact resume with
  the pending batches saved as a list."""
  changes = {"total_steps": 4, "ppo__async_rollout": True, "checkpoint__every_steps": 2}
  whole = Runner(_config(**changes), str(tmp_path), show_progress=False).run().metrics
  directory = tmp_path / "checkpoints"
  assert len(ckpt.read_meta(directory / "2")["pending_prompts"]) == 1
  shutil.rmtree(directory / "4")
  resumed = Runner(_config(**changes), str(tmp_path), show_progress=False)
  assert resumed.start_step == 2
  rows = resumed.run().metrics
  assert [deterministic(r) for r in rows] == [deterministic(r) for r in whole[2:]]
