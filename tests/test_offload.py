"""Idle roles' parameters and optimizer state parked in host memory between their stages."""

import functools
import pathlib
import runpy

import jax
import numpy as np
import optax
import pytest

from rlhfjax.cluster.cluster import Cluster, WeightSource, initial_rngs
from rlhfjax.cluster.role import RoleRuntime
from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.config.model import get_model_config
from rlhfjax.flows import registry
from rlhfjax.mesh import offload
from rlhfjax.placement import strategies
from rlhfjax.placement.spec import Layout, Role, RoleSpec
from rlhfjax.runner import Runner
from rlhfjax.training import steps

pytestmark = pytest.mark.integration

CONFIG = get_model_config("tiny", attention="xla")
SPEC = RoleSpec(
  devices=tuple(range(8)), axes=(("data", 1), ("fsdp", 4), ("tensor", 2)), layout=Layout.TRAINING
)


def test_cpu_backend_has_host_memory_spaces_and_moves_keep_the_partitioning():
  assert offload.host_memory_supported(jax.devices())
  rt = RoleRuntime.create(Role.REFERENCE, SPEC, CONFIG, "lm")
  params = rt.init_params(jax.random.key(0))
  expected = jax.tree.map(np.asarray, params)
  host = offload.to_host(params)
  assert offload.memory_kinds(host) == {"pinned_host"}
  for leaf, sharding in zip(
    jax.tree.leaves(host), jax.tree.leaves(rt.param_shardings), strict=True
  ):
    assert leaf.sharding.spec == sharding.spec
    assert {s.device for s in leaf.addressable_shards} == set(sharding.device_set)
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(params))  # donated: freed
  back = offload.to_device(host)
  assert offload.memory_kinds(back) == {"device"}
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)


def _batch(m=2, b=4, p=5, t=6, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CONFIG.vocab_size, size=(m, b, p + t)).astype(np.int32)
  return {
    "tokens": tokens,
    "attention_mask": np.ones_like(tokens),
    "response_mask": np.ones((m, b, t), np.float32),
    "old_logprobs": rng.normal(size=(m, b, t)).astype(np.float32) - 5,
    "advantages": rng.normal(size=(m, b, t)).astype(np.float32),
  }


def _run(policy_reference: offload.OffloadPolicy, policy_actor: offload.OffloadPolicy):
  """Three iterations of score (reference) then update (actor) on one shared mesh, parking each
  role's idle parts; returns the results, the memory kinds seen and the compile counts."""
  actor = RoleRuntime.create(Role.ACTOR, SPEC, CONFIG, "lm")
  reference = RoleRuntime.create(Role.REFERENCE, SPEC, CONFIG, "lm", mesh=actor.mesh)
  tx = optax.adam(1e-2)
  state, state_sh = actor.train_state(actor.init_params(jax.random.key(1)), tx)
  ref_params = reference.init_params(jax.random.key(2))
  loss = functools.partial(
    steps.actor_loss, config=CONFIG, prompt_len=5, clip_eps=0.2, entropy_coef=0.01
  )
  probe = _batch()
  batch_sh = actor.batch_shardings(probe, leading=1)
  train = jax.jit(
    functools.partial(steps.accumulate_and_apply, loss, tx),
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, actor.replicated),
    donate_argnums=0,
  )
  score = jax.jit(
    functools.partial(steps.response_logprobs, CONFIG, prompt_len=5),
    in_shardings=(reference.param_shardings, *[actor.batch_sharding((4, 11))] * 2),
  )
  kinds, scores = [], []
  ref_params, _ = offload.park(policy_reference, ref_params)
  _, opt = offload.park(policy_actor, opt_state=state.opt_state)
  state = state.replace(opt_state=opt)
  for it in range(3):
    host_batch = _batch(seed=it)
    batch = actor.put_batch(host_batch, leading=1)
    rows = actor.put_batch((host_batch["tokens"][0], host_batch["attention_mask"][0]))
    # Score: the reference comes back, the actor's moments stay parked.
    ref_params, _ = offload.unpark(ref_params)
    kinds.append(("score", offload.memory_kinds(ref_params), offload.memory_kinds(state.opt_state)))
    scores.append(np.asarray(score(ref_params, *rows)))
    ref_params, _ = offload.park(policy_reference, ref_params)
    # Update: the moments come back for the step, the reference stays parked.
    _, opt = offload.unpark(opt_state=state.opt_state)
    state = state.replace(opt_state=opt)
    kinds.append(
      ("update", offload.memory_kinds(ref_params), offload.memory_kinds(state.opt_state))
    )
    state, _ = train(state, batch)
    _, opt = offload.park(policy_actor, opt_state=state.opt_state)
    state = state.replace(opt_state=opt)
    kinds.append(("idle", offload.memory_kinds(ref_params), offload.memory_kinds(state.opt_state)))
  final = jax.tree.map(np.asarray, offload.unpark(state.params, state.opt_state))
  return final, scores, kinds, (train._cache_size(), score._cache_size())


def test_offloaded_run_equals_resident_run_exactly_without_recompiles():
  on = offload.OffloadPolicy(params=True, optimizer=True)
  off = offload.OffloadPolicy()
  final, scores, kinds, compiles = _run(on, on)
  final_ref, scores_ref, kinds_ref, _ = _run(off, off)
  device, host = {"device"}, {"pinned_host"}
  assert kinds == [("score", device, host), ("update", host, device), ("idle", host, host)] * 3
  assert {k for _, a, b in kinds_ref for k in (*a, *b)} == device
  assert compiles == (1, 1)
  for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(final_ref), strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(scores, scores_ref, strict=True):
    np.testing.assert_array_equal(a, b)


def _ppo_config(**offload_section):
  cd = runpy.run_path(str(pathlib.Path(__file__).parent.parent / "configs" / "ppo_tiny.py"))[
    "get_config"
  ]("colocated")
  cd.total_steps = 2
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.reward.model_coef = 0.5  # the reward model scores too
  cd.eval.num_prompts = 0
  cd.offload = offload_section
  return from_config_dict(cd)


@pytest.mark.slow
def test_colocated_ppo_with_offload_equals_the_resident_run(tmp_path):
  runs = {}
  for name, section in (
    ("resident", {}),
    (
      "offload",
      {"params": ("reference", "reward", "actor", "critic"), "optimizer": ("actor", "critic")},
    ),
  ):
    trainer = Runner(_ppo_config(**section), str(tmp_path / name), show_progress=False)
    runs[name] = (trainer, trainer.run())
  trainer, result = runs["offload"]
  base = runs["resident"][1]
  assert len(result.metrics) == 2
  for a, b in zip(result.metrics, base.metrics, strict=True):
    for key in ("reward/mean", "kl/mean", "loss/policy", "loss/value", "actor/grad_norm"):
      assert a[key] == b[key], key
  assert set(result.compilations.values()) == {1}, result.compilations
  # Between stages the idle parts live in host memory, the rest on device.
  host, device = {"pinned_host"}, {"device"}
  cluster = trainer.cluster
  assert offload.memory_kinds(cluster.params[Role.REFERENCE]) == host
  assert offload.memory_kinds(cluster.params[Role.REWARD]) == host
  assert offload.memory_kinds(cluster.states[Role.ACTOR].opt_state) == host
  assert offload.memory_kinds(cluster.states[Role.CRITIC].opt_state) == host
  assert offload.memory_kinds(cluster.states[Role.ACTOR].params) == host
  assert offload.memory_kinds(cluster.states[Role.CRITIC].params) == host
  assert offload.memory_kinds(runs["resident"][0].cluster.params[Role.REFERENCE]) == device
  assert offload.memory_kinds(runs["resident"][0].cluster.states[Role.ACTOR].params) == device
  # The sync read a device copy of the actor's parked weights: the rollout holds its final ones.
  for a, b in zip(
    jax.tree.leaves(cluster.states[Role.ACTOR].params),
    jax.tree.leaves(cluster.engine.params),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Every stage found its offloaded state in device memory; the update's optimizer states were
  # requested while a scoring stage on their devices ran (after its start, before its end).
  events = cluster.residency.events
  assert {e.memory_kinds for e in events if e.event == "start"} == {(), ("device",)}
  for role in ("actor", "critic"):
    for it in range(2):
      p = next(
        i
        for i, e in enumerate(events)
        if (e.iteration, e.event, e.role, e.what) == (it, "prefetch", role, "optimizer")
      )
      on_device = ("actor", "reference", "critic", "reward")  # not the host's rule stage
      s = max(
        i
        for i, e in enumerate(events[:p])
        if e.event == "start" and e.what == "score" and e.role in on_device
      )
      end = next(
        i
        for i, e in enumerate(events)
        if i > s and (e.event, e.role, e.what) == ("end", events[s].role, "score")
      )
      assert s < p < end, (role, it)


def test_offload_section_names_only_roles_it_can_park():
  with pytest.raises(
    ConfigError, match=r"'offload\.params' may name reference, reward, actor and critic"
  ):
    _ppo_config(params=("rollout",))
  with pytest.raises(ConfigError, match=r"'offload\.optimizer' may name actor and critic"):
    _ppo_config(optimizer=("reference",))
  # A trained role's parameters come back for the PPO-family stages only.
  dpo = runpy.run_path(str(pathlib.Path(__file__).parent.parent / "configs" / "dpo_tiny.py"))[
    "get_config"
  ]()
  dpo.offload = {"params": ("actor",)}
  with pytest.raises(ConfigError, match="'offload.params' names actor: .* dpo updates"):
    registry.configure(from_config_dict(dpo))


def _prefetch_run(offload_section: dict):
  """Three iterations of [actor, reference, reward] scoring then the actor's update, on one
  co-located cluster; each stage records the memory kinds of the state it uses as it runs."""
  cfg = _ppo_config(**offload_section)
  cluster = Cluster(cfg, strategies.build_placement(cfg.placement, 8))
  rngs = initial_rngs(0)
  tx = optax.adam(1e-2)
  for role in (Role.ACTOR, Role.REFERENCE, Role.REWARD):
    source = WeightSource(source="", what="init", rng=rngs[role])
    (cluster.train(role, source, tx) if role is Role.ACTOR else cluster.freeze(role, source))
  cluster.materialize()
  leaves_sum = lambda tree: sum(jax.numpy.sum(x) for x in jax.tree.leaves(tree))
  score = {
    role: cluster.compile(f"{role.value}_score", leaves_sum, out_shardings=rt.replicated)
    for role, rt in cluster.roles.items()
    if role in (Role.ACTOR, Role.REFERENCE, Role.REWARD)
  }
  shardings = cluster.state_shardings[Role.ACTOR]

  def apply(state):
    grads = jax.tree.map(lambda p: jax.numpy.cos(p), state.params)
    updates, opt = tx.update(grads, state.opt_state, state.params)
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         opt_state=opt)  # fmt: skip

  update = cluster.compile(
    "actor_update", apply, in_shardings=(shardings,), out_shardings=shardings, donate_argnums=0
  )
  seen, scores = [], []

  def scorer(role):
    def run():
      tree = cluster.params[role] if role in cluster.params else cluster.states[role].params
      seen.append((role.value, "score", offload.memory_kinds(tree)))
      return score[role](tree)

    return cluster.stage(role, "score", run)

  def train():
    seen.append(("actor", "update", offload.memory_kinds(cluster.states[Role.ACTOR].opt_state)))
    cluster.states[Role.ACTOR] = update(cluster.states[Role.ACTOR])

  between = []
  for it in range(3):
    todo = [scorer(Role.ACTOR), scorer(Role.REFERENCE), scorer(Role.REWARD)]
    scores.append(np.asarray(cluster.run(todo, it, then=[("actor", "update")])))
    kinds = lambda: (
      offload.memory_kinds(cluster.params[Role.REFERENCE]),
      offload.memory_kinds(cluster.params[Role.REWARD]),
      offload.memory_kinds(cluster.states[Role.ACTOR].opt_state),
    )
    between.append(kinds())
    cluster.run([cluster.stage(Role.ACTOR, "update", train)], it)
    between.append(kinds())
  final = jax.tree.map(np.asarray, cluster.states[Role.ACTOR])
  return cluster, final, scores, seen, between


def test_offload_prefetches_the_next_stage_during_the_current_one():
  section = {"params": ("reference", "reward"), "optimizer": ("actor",)}
  cluster, final, scores, seen, between = _prefetch_run(section)
  resident, final_ref, scores_ref, seen_ref, _ = _prefetch_run({})
  # Each stage found its state in device memory; between the calls it is in host memory, but
  # for the actor's moments, which the scoring call prefetched for the update that follows.
  device, host = {"device"}, {"pinned_host"}
  assert len(seen) == 12
  assert [kinds for *_, kinds in seen] == [device] * len(seen)
  assert between == [(host, host, device), (host, host, host)] * 3
  # Same numbers as the resident run, every program compiled once.
  for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(final_ref), strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(scores, scores_ref, strict=True):
    np.testing.assert_array_equal(a, b)
  assert set(cluster.traces.counts.values()) == {1}, cluster.traces.counts
  # The order of the cluster's own decisions: each part is requested while the stage before
  # its own runs (after that stage's start, before its end), and parked after its stage.
  events = [(e.event, e.role, e.what, e.memory_kinds) for e in cluster.residency.events]
  d = ("device",)
  one_iteration = [
    ("start", "actor", "score", ()),
    ("prefetch", "reference", "params", ()),
    ("end", "actor", "score", ()),
    ("start", "reference", "score", d),
    ("prefetch", "reward", "params", ()),
    ("end", "reference", "score", ()),
    ("park", "reference", "params", ()),
    ("start", "reward", "score", d),
    ("prefetch", "actor", "optimizer", ()),
    ("end", "reward", "score", ()),
    ("park", "reward", "params", ()),
    ("start", "actor", "update", d),
    ("end", "actor", "update", ()),
    ("park", "actor", "optimizer", ()),
  ]
  assert events == one_iteration * 2  # the log keeps the last two iterations
  assert [e.iteration for e in cluster.residency.events] == [1] * 14 + [2] * 14
  # Without offload nothing moves: only the stages are logged, and everything stays on device.
  assert {e.event for e in resident.residency.events} == {"start", "end"}
  assert [kinds for *_, kinds in seen_ref] == [device] * len(seen_ref)
