"""LoRA (`model.lora`, `rlhfjax.models.lora`): adapters over a frozen base. Step 0 is the base
model; an adapted projection and its gradients against NumPy's `W + (alpha / r) A B`; only the
adapters train and only they have optimizer moments; the merged weights run the adapted model;
adapters shard like their kernel's axes with the rank replicated; GRPO with adapters learns and
its rollout runs the merged weights; bad settings are one line."""

import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from runs_testing import LEARNING_RUN, deterministic, shipped_config

from rlhfjax import export, models
from rlhfjax.config import ConfigError
from rlhfjax.config.model import LoraConfig, get_model_config
from rlhfjax.costmodel import memory
from rlhfjax.mesh import meshes, rules
from rlhfjax.models import logprobs, lora, transformer
from rlhfjax.placement.spec import Role, RoleSpec
from rlhfjax.runner import Runner
from rlhfjax.training import steps
from rlhfjax.training.state import init_train_state

pytestmark = pytest.mark.integration  # one learning run; the rest are unit-sized

_CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
ADAPTED = get_model_config("tiny", lora=LoraConfig(rank=4, alpha=8.0))


def _tokens(seed=0, shape=(2, 24)):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 300, shape), jnp.int32)


def _with_random_b(params, scale=0.05):
  """`params` with every `lora_b` drawn at random (at the start they are zero)."""
  key = iter(jax.random.split(jax.random.key(7), 64))
  return jax.tree_util.tree_map_with_path(
    lambda path, x: (
      jax.random.normal(next(key), x.shape) * scale if "lora_b" in jax.tree_util.keystr(path) else x
    ),
    params,
  )


def test_step_zero_is_the_base_model_and_merging_runs_the_adapted_one():
  base_config = ADAPTED.replace(lora=None)
  params = models.init_params(ADAPTED, "lm", jax.random.key(0))
  base = models.init_params(base_config, "lm", jax.random.key(0))
  # The same seed gives the same base weights with adapters or without.
  for a, b in zip(jax.tree.leaves(lora.base(params)), jax.tree.leaves(base), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tokens = _tokens()
  np.testing.assert_array_equal(
    np.asarray(transformer.forward_logits(ADAPTED, params, tokens)),
    np.asarray(transformer.forward_logits(base_config, base, tokens)),
  )
  moved = _with_random_b(params)
  adapted = transformer.forward_logits(ADAPTED, moved, tokens)
  merged = transformer.forward_logits(base_config, lora.merged(moved, ADAPTED.lora), tokens)
  base_logits = transformer.forward_logits(base_config, base, tokens)
  scale = float(jnp.max(jnp.abs(adapted)))
  assert float(jnp.max(jnp.abs(adapted - base_logits))) > 0.05 * scale  # the adapters act
  np.testing.assert_allclose(adapted, merged, atol=1e-5 * scale, rtol=0)


class _Projection(nn.Module):
  @nn.compact
  def __call__(self, x):
    lora_config = LoraConfig(rank=3, alpha=6.0)
    return transformer.Linear(
      "btd,dhn->bthn", (5, 2, 4), ("embed", "heads", "head_dim"), lora=lora_config, name="q"
    )(x)


def test_an_adapted_projection_and_its_gradients_equal_numpy():
  """y = x W + (alpha / r) (x A) B for a kernel `[d, h, n]` (A `[d, r]`, B `[r, h, n]`); an SGD
  step on A and B from the NumPy gradients of sum(y * g)."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 3, 5)).astype(np.float32)
  g = rng.normal(size=(2, 3, 2, 4)).astype(np.float32)
  params = nn.unbox(_Projection().init(jax.random.key(0), x)["params"])
  q = dict(params["q"], lora_b=jnp.asarray(rng.normal(size=(3, 2, 4)), jnp.float32))
  w, a, b = (np.asarray(q[k], np.float64) for k in ("kernel", "lora_a", "lora_b"))
  assert a.shape == (5, 3) and b.shape == (3, 2, 4)
  assert np.abs(a).max() <= 1 / np.sqrt(5)  # Kaiming-uniform: bound 1/sqrt(fan_in)
  s = 6.0 / 3
  want = np.einsum("btd,dhn->bthn", x, w) + s * np.einsum("btr,rhn->bthn", x @ a, b)
  apply = lambda p: _Projection().apply({"params": {"q": p}}, x)
  got = apply(q)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  grads = jax.grad(lambda p: jnp.sum(apply(p) * g))(q)
  g64 = g.astype(np.float64)
  d_b = s * np.einsum("btr,bthn->rhn", x @ a, g64)
  d_a = s * np.einsum("btd,bthn,rhn->dr", x, g64, b)
  np.testing.assert_allclose(grads["lora_b"], d_b, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(grads["lora_a"], d_a, rtol=1e-4, atol=1e-5)
  # The adapted weight as one matrix: W + s A B.
  merged = lora.merged({"q": q}, LoraConfig(rank=3, alpha=6.0))["q"]
  assert set(merged) == {"kernel"}
  np.testing.assert_allclose(merged["kernel"], w + s * np.einsum("dr,rhn->dhn", a, b), atol=1e-6)


def test_only_the_adapters_train_and_only_they_have_moments():
  params = models.init_params(ADAPTED, "lm", jax.random.key(0))
  tx = optax.adam(1e-2)
  state = init_train_state(params, tx)
  adapters = [x for x in jax.tree.leaves(lora.adapters(params))]
  moments = jax.tree.leaves(state.opt_state)
  # Adam's mu and nu per adapter, and its step count: nothing for the base.
  assert sum(m.size for m in moments) == 2 * sum(a.size for a in adapters) + 1
  tokens = _tokens(shape=(1, 2, 24))

  def loss_fn(p, batch):
    stats = logprobs.token_stats(ADAPTED, p, batch, jnp.ones_like(batch), 1)
    return -jnp.mean(stats.logp_bt), {}

  new, metrics = jax.jit(lambda s, b: steps.accumulate_and_apply(loss_fn, tx, s, b))(state, tokens)
  assert float(metrics["grad_norm"]) > 0
  trained = lora.trainable(params)
  for (path, old), now, is_trained in zip(
    jax.tree_util.tree_leaves_with_path(params),
    jax.tree.leaves(new.params),
    jax.tree.leaves(trained),
    strict=True,
  ):
    name = jax.tree_util.keystr(path)
    if is_trained and "lora_b" in name:  # A's gradient is 0 while B is: B moves first
      assert np.any(np.asarray(now) != np.asarray(old)), name
    elif not is_trained:
      np.testing.assert_array_equal(np.asarray(now), np.asarray(old), err_msg=name)
  # A value head (no base holds one) trains with the adapters.
  critic = lora.trainable(models.abstract_params(ADAPTED, "value"))
  assert critic["value_head"] and not critic["layers"]["attn"]["q_proj"]["kernel"]


def test_adapters_shard_like_their_kernels_axes_with_the_rank_replicated():
  spec = RoleSpec.training(range(8), fsdp=4, tensor=2)
  mesh = meshes.make_mesh(spec)
  axes = models.logical_axes(ADAPTED, "lm")
  shardings = rules.named_shardings(axes, models.abstract_params(ADAPTED, "lm"), mesh, spec.layout)
  q = shardings["layers"]["attn"]["q_proj"]
  assert axes["layers"]["attn"]["q_proj"]["lora_a"] == ("layers", "embed", None)
  assert q["lora_a"].spec == jax.sharding.PartitionSpec(None, "fsdp", None)
  assert q["lora_b"].spec == jax.sharding.PartitionSpec(None, None, "tensor", None)


def test_the_memory_model_keeps_moments_and_gradients_of_the_adapters_only():
  config = get_model_config("7b", param_dtype="bfloat16")
  adapted = config.replace(lora=LoraConfig(rank=16))
  sharding = memory.Sharding(param_shards=8, batch_shards=8)
  kw = dict(micro_batch=1, seq_len=4096, options=memory.Options(remat="full"))
  full = memory.train_memory(config.replace(param_dtype="float32"), "lm", sharding, **kw)
  lo = memory.train_memory(adapted, "lm", sharding, **kw)
  # Rank 16: a few per cent of the weights, their factors off the model width unsplit by fsdp.
  assert lo.optimizer < full.optimizer / 25 and lo.grads < full.grads / 25
  assert lo.params < full.params  # a bf16 base instead of fp32 masters, plus fp32 adapters
  assert lo.activations == full.activations


def _grpo_lora(variant="colocated", **changes):
  changes = {k.replace("__", "."): v for k, v in changes.items()}
  return shipped_config("grpo_lora_tiny", changes, variant)


def test_grpo_with_adapters_learns_and_the_rollout_runs_the_merged_weights(tmp_path):
  """The learning run of every flow (`runs_testing.LEARNING_RUN`: 15 iterations on 2 devices)
  with rank-8 adapters, disaggregated (the actor on one device, the rollout on the other): the
  reward rises; the reference, the actor's base, starts equal to the actor (KL 0 at the first
  iteration); each sync moves the adapters alone, and the rollout ends holding exactly the
  weights a full sync of the merged adapted weights gives it."""
  changes = {**LEARNING_RUN, "actor_optimizer__learning_rate": 2e-2}
  cfg = _grpo_lora("disaggregated", **changes, placement__rollout_tensor=1)
  runner = Runner(cfg, str(tmp_path), show_progress=False)
  rows = runner.run().metrics
  rewards = [r["reward/mean"] for r in rows]
  first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
  assert last > first + 0.05 and last > 2 * first, rewards
  assert rows[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)
  assert rows[-1]["kl/mean"] > 1e-4  # the adapters moved the policy away from its reference
  _check_reference_is_the_base(runner)
  actor = runner.cluster.states[Role.ACTOR].params
  assert lora.has_adapters(actor) and not lora.has_adapters(runner.cluster.engine.params)
  model = runner.cluster.roles[Role.ACTOR].model
  _check_adapters_only_sync(runner, rows, actor, model)
  # The export is the merged model: `transformers` runs it with the adapted model's logits
  # (fp32; the bound of tests/test_export_e2e.py).
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  done = export.export(str(tmp_path), str(tmp_path / "hf"))
  assert done.step == cfg.total_steps
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  tokens = np.random.default_rng(0).integers(0, 256, size=(2, 12))
  with torch.no_grad():
    theirs = reloaded(input_ids=torch.tensor(tokens)).logits.float().numpy()
  ours = np.asarray(transformer.forward_logits(model, actor, jnp.asarray(tokens, jnp.int32)))
  assert np.max(np.abs(ours - theirs)) <= 1e-4 and np.ptp(ours) > 1.0
  _check_peft_export(tmp_path, tokens, theirs, ours)
  _check_a_later_run_starts_from_the_merged_model(runner, tmp_path, actor, model)
  _check_the_checkpoint_holds_the_adapters_alone(tmp_path / "checkpoints" / str(cfg.total_steps))


def _check_the_checkpoint_holds_the_adapters_alone(step_dir):
  """The actor's parameters in the checkpoint are its adapters, nothing of the base; its
  optimizer state has moments of the adapters only."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  def saved(item):
    tree = ocp.StandardCheckpointHandler().metadata(step_dir / item).tree
    is_leaf = lambda m: isinstance(m, ocp.metadata.ArrayMetadata)  # noqa: E731
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree, is_leaf)]

  params = saved("actor_params")
  assert len(params) == 2 * (7 + 1) and all(("lora_a" in k) != ("lora_b" in k) for k in params)
  moments = [k for k in saved("actor_opt_state") if "kernel" in k or "embedding" in k]
  assert not moments, moments


def _check_a_later_run_starts_from_the_merged_model(runner, tmp_path, actor, model):
  """A run that starts from this one's checkpoint (PPO from an SFT with adapters, say) starts
  from the adapted model merged: without adapters as its weights, with them as their base."""
  from rlhfjax.training import weights  # noqa: PLC0415

  rt = runner.cluster.roles[Role.ACTOR]
  merged = lora.merged(actor, model.lora)
  for config in (model.replace(lora=None), model):
    shardings = weights.param_shardings(config, "lm", rt.mesh, rt.spec.layout)
    loaded = weights.load_params(
      str(tmp_path / "checkpoints"),
      model=config,
      head="lm",
      mesh=rt.mesh,
      layout=rt.spec.layout,
      shardings=shardings,
      rng=jax.random.key(3),
      items=("actor",),
      what="init.actor",
    )
    assert lora.has_adapters(loaded) == (config.lora is not None)
    for a, b in zip(jax.tree.leaves(lora.base(loaded)), jax.tree.leaves(merged), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _check_adapters_only_sync(runner, rows, actor, model):
  """Every sync moved the adapters' bytes alone; the rollout's weights after the last one are
  those a full sync of the merged weights moves there (bit for bit), which moves more."""
  cluster = runner.cluster
  assert cluster.syncs_adapters
  adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(lora.adapters(actor)))
  assert {r["sync/bytes"] for r in rows} == {float(adapter_bytes)}
  via_adapters = [np.asarray(x) for x in jax.tree.leaves(cluster.engine.params)]
  full_bytes = cluster.engine.update_params(lora.merged(actor, model.lora))
  for a, b in zip(via_adapters, jax.tree.leaves(cluster.engine.params), strict=True):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert full_bytes == sum(x.nbytes for x in via_adapters) > 2 * adapter_bytes
  assert memory.adapter_bytes(model) == adapter_bytes  # what the planner and show_placement say


def _check_peft_export(tmp_path, tokens, merged_logits, ours):
  """`--adapter` writes a PEFT adapter directory and `--base` the frozen base it applies to:
  `peft` loads the one onto the other with the merged export's logits (the same fp32 bound)."""
  import peft  # noqa: PLC0415
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  adapter = export.export(str(tmp_path), str(tmp_path / "adapter"), part="adapter")
  assert adapter.files == ["adapter_model.safetensors"] and adapter.dtype == "float32"
  export.export(str(tmp_path), str(tmp_path / "base"), part="base")
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16.0)
  assert set(config["target_modules"]) == {
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
  }
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
  with torch.no_grad():
    base_logits = base(input_ids=torch.tensor(tokens)).logits.float().numpy()
  adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
  with torch.no_grad():
    theirs = adapted(input_ids=torch.tensor(tokens)).logits.float().numpy()
  assert np.max(np.abs(theirs - merged_logits)) <= 1e-4
  assert np.max(np.abs(base_logits - ours)) > 100 * 1e-4  # the adapters are what differs
  with pytest.raises(export.ExportError, match="part must be one of merged, adapter, base"):
    export.export(str(tmp_path), str(tmp_path / "x"), part="nope")


def _check_reference_is_the_base(runner):
  """The reference (`model.lora.reference`='base') is placed as the actor, holds no weights
  and scored on the actor's devices with the actor's base weights: its log-probs equal those
  of a reference loaded separately from the same source, after the adapters have moved."""
  cluster = runner.cluster
  assert runner.placement[Role.REFERENCE] == runner.placement[Role.ACTOR]
  assert Role.REFERENCE not in cluster.params
  scored = {r.devices for r in cluster.timeline.records if r.role == "reference"}
  assert scored == {cluster.roles[Role.ACTOR].devices}, scored
  own = cluster._load(Role.REFERENCE)  # what a placed reference loads from the same source
  from_base = cluster.weights(Role.REFERENCE)
  assert not lora.has_adapters(from_base)
  for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(from_base), strict=True):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rt, actor = cluster.roles[Role.REFERENCE], cluster.roles[Role.ACTOR]
  b, s = 4, runner.cfg.rollout.max_seq_len
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (b, s)), jnp.int32)
  mask = jnp.ones((b, s), jnp.int32)
  score = jax.jit(
    lambda params: steps.response_logprobs(
      rt.model, params, tokens, mask, prompt_len=runner.cfg.rollout.max_prompt_len
    )
  )
  ref = np.asarray(score(from_base))
  np.testing.assert_array_equal(ref, np.asarray(score(own)))
  adapted = jax.jit(
    lambda params: steps.response_logprobs(
      actor.model, params, tokens, mask, prompt_len=runner.cfg.rollout.max_prompt_len
    )
  )(cluster.weights(Role.ACTOR))
  assert np.max(np.abs(np.asarray(adapted) - ref)) > 1e-3  # the base is not the adapted actor


@pytest.mark.parametrize(
  "changes,message",
  [
    ({"model__lora__rank": -1}, r"'model.lora.rank' must be >= 0"),
    ({"model__lora__targets": ("q", "qkv")}, r"'model.lora.targets': unknown projection\(s\) qkv"),
    ({"model__lora__rank": 57}, r"LoRA rank 57 exceeds the smallest adapted projection"),
    ({"model__lora__reference": "copy"}, r"'model.lora.reference' must be one of base, placed"),
    (
      {"model__lora__quantize": "int4"},
      r"'model.lora.quantize' must be one of '', 'int8', 'nf4' \('': the base in its own",
    ),
    (
      {"model__lora__quantize": "nf4", "model__overrides": {"intermediate_size": 150}},
      r"nf4 quantizes down_proj in blocks of 4 to 64 along its intermediate_size, 150",
    ),
    (
      {"model__lora__quantize": "int8", "model__lora__rank": 0},
      r"'model.lora.quantize'='int8' quantizes the frozen base .* set 'model.lora.rank' > 0",
    ),
    (
      {"offload__params": ("reference",)},
      r"'offload.params' names reference, but the reference runs the actor's base weights",
    ),
  ],
)
def test_bad_lora_settings_are_one_line(changes, message):
  with pytest.raises(ConfigError, match=message):
    cfg = _grpo_lora(**changes)
    cfg.model.for_role("actor")


def test_show_placement_names_the_adapted_roles():
  from rlhfjax.flows import registry
  from rlhfjax.placement import format_adapters, strategies

  cfg = registry.configure(_grpo_lora())
  spec = strategies.build_placement(cfg.placement, 8).only(registry.roles_of(cfg))
  line = format_adapters(cfg, spec)
  assert line.startswith("adapters: LoRA rank 8, alpha 16 on q, k, v, o, gate, up, down, lm_head")
  assert " of actor: " in line  # GRPO trains the actor alone; the reference stays whole
  assert format_adapters(registry.configure(_grpo_lora(model__lora__rank=0)), spec) is None
  # The reference is the actor's base (`model.lora.reference`='base'): placed as the actor with
  # no weights, and the line says so; 'placed' places a copy of its own where the strategy says.
  from rlhfjax.placement import estimate_placement_memory
  from rlhfjax.planner.place import plan_placement

  assert registry.reference_from_base(cfg)
  for where in ("base", "placed"):
    config = registry.configure(
      _grpo_lora(model__lora__reference=where, placement__strategy="interleaved")
    )
    placed = plan_placement(config, 8)
    estimates = estimate_placement_memory(placed, config.model, config.rollout)
    if where == "base":
      assert placed[Role.REFERENCE] == placed[Role.ACTOR]
      assert estimates[Role.REFERENCE].params == 0 < estimates[Role.REFERENCE].total
    else:
      assert placed[Role.REFERENCE].devices == (0, 1, 2, 3)  # interleaved: the first half
      assert estimates[Role.REFERENCE].params > 0
  from_base = format_adapters(cfg, spec, reference_from_base=True)
  assert from_base.endswith(
    "the reference is the actor's base weights with the adapters off, on the actor's devices "
    "(no copy placed)"
  )


def test_the_planner_scores_a_reference_on_the_actors_base_on_the_actors_devices():
  """The planner's workload knows the reference runs on the actor's base: it places the
  reference as the actor, with no weights, prices its scoring there as the same work, and
  plans less memory than with a reference of its own on the same devices."""
  from rlhfjax.costmodel import efficiency, hardware
  from rlhfjax.flows import registry
  from rlhfjax.placement import strategies
  from rlhfjax.planner import auto, evaluate

  hw, eff = hardware.load_hardware("h100"), efficiency.load_efficiency(None)
  plans = {}
  for where in ("base", "placed"):
    workload = auto.workload_of(registry.configure(_grpo_lora(model__lora__reference=where)))
    assert workload.reference_from_base == (where == "base")
    spec = strategies.disaggregated(8, split_reference_reward=False)
    plans[where] = evaluate.evaluate(spec, workload, hw, eff, micro_batch=4)

  def scored(plan):
    (record,) = [
      r for r in plan.replay.records if (r.role, r.stage, r.iteration) == ("reference", "score", 0)
    ]
    return record

  base, placed = plans["base"], plans["placed"]
  assert base.spec[Role.REFERENCE] == base.spec[Role.ACTOR]
  assert base.memory[Role.REFERENCE].params == 0 < placed.memory[Role.REFERENCE].params
  assert scored(base).devices == base.spec[Role.ACTOR].devices
  assert scored(base).seconds == pytest.approx(scored(placed).seconds, rel=1e-9)
  assert base.peak_memory_gib < placed.peak_memory_gib  # no reference copy
  # The disaggregated rollout gets the adapters alone, merged into a base copy of its own: a
  # shorter sync than the whole weights', and the base twice in the rollout's memory.
  workload = auto.workload_of(registry.configure(_grpo_lora()))
  spec = strategies.disaggregated(8)
  full = workload.replace(actor=workload.actor.replace(lora=None))
  adapted, whole = (evaluate.evaluate(spec, w, hw, eff, micro_batch=4) for w in (workload, full))

  def sync(plan):
    return next(r.seconds for r in plan.replay.records if r.stage == "sync")

  assert sync(adapted) < sync(whole)
  rollout = adapted.memory[Role.ROLLOUT]
  assert rollout.params == 2 * whole.memory[Role.ROLLOUT].params + rollout.transfer


def test_the_readme_memory_figures_of_a_qwen_checkpoint_with_and_without_adapters():
  """The README's figures for its Qwen2.5-1.5B command (`show_placement.py`'s estimates), with
  `model.lora.rank=16` and without, and over an int8 base: the peak, the actor's and the
  reference's."""
  from rlhfjax.flows import registry
  from rlhfjax.placement import estimate_placement_memory
  from rlhfjax.placement.memory import device_totals
  from rlhfjax.planner import auto, place

  readme = (_CONFIGS.parent / "README.md").read_text()
  readme = " ".join(readme.split())
  command = {
    "model.size": "",
    "model.hf": str(_CONFIGS / "hf" / "qwen2.5-1.5b-instruct"),
    "placement.num_devices": 1,
    "placement.memory_per_device_gb": 80.0,
    "placement.rollout_tensor": 1,
    "rollout.batch_size": 32,
    "rollout.max_prompt_len": 512,
    "rollout.max_new_tokens": 512,
    "ppo.micro_batches": 8,
  }
  gib = {}
  variants = {
    16: {"model.lora.rank": 16},
    0: {},
    "int8": {"model.lora.quantize": "int8"},
    "nf4": {"model.lora.quantize": "nf4"},
  }
  for rank, extra in variants.items():
    changes = {**command, "model.lora.rank": 16 if rank in ("int8", "nf4") else rank, **extra}
    config = registry.configure(shipped_config("grpo_tiny", changes))
    spec = place.plan_placement(config, available_devices=8)
    config, _ = place.sized(config, spec)
    train_rows, score_rows = auto.memory_rows(config)
    estimates = estimate_placement_memory(
      spec, config.model, config.rollout, train_rows=train_rows, score_rows=score_rows
    )
    peak = max(device_totals(spec, estimates).values())
    gib[rank] = {"peak": peak / 2**30, **{r.value: e.total / 2**30 for r, e in estimates.items()}}
  lora, full = gib[16], gib[0]
  assert (
    f"peaks at {lora['peak']:.2f} GiB instead of {full['peak']:.2f}: the actor "
    f"{lora['actor']:.2f} GiB instead of {full['actor']:.2f}, the reference its scoring's "
    f"{lora['reference']:.2f} and no weights" in readme
  ), (lora, full)
  assert (
    f"prints a peak of {full['peak']:.2f} GiB of the 80: the actor {full['actor']:.2f} GiB"
    in readme
  )
  int8, nf4 = gib["int8"], gib["nf4"]
  assert f"the actor takes {int8['actor']:.2f} GiB and the peak is {int8['peak']:.2f}" in readme, (
    int8
  )
  assert f"with `nf4`, {nf4['actor']:.2f} GiB and {nf4['peak']:.2f}" in readme, nf4


def test_a_role_may_train_adapters_of_its_own_rank_or_its_full_weights():
  """`model.roles.<role>.lora_rank` over `model.lora.rank`: PPO's critic with rank 4 beside the
  actor's 8, or with its full weights; the placement line names each rank; a frozen role's
  rank is one line."""
  from rlhfjax.flows import registry
  from rlhfjax.placement import format_adapters, strategies

  def ppo(**changes):
    changes = {k.replace("__", "."): v for k, v in changes.items()}
    return registry.configure(shipped_config("ppo_tiny", {"model.lora.rank": 8, **changes}))

  cfg = ppo(model__roles={"critic": {"lora_rank": 4}})
  assert cfg.model.for_role("actor").lora.rank == 8 and cfg.model.for_role("critic").lora.rank == 4
  assert cfg.model.for_role("reference").lora is None and cfg.model.reference_from_base
  spec = strategies.build_placement(cfg.placement, 8).only(registry.roles_of(cfg))
  line = format_adapters(cfg, spec)
  assert "of actor (rank 8), critic (rank 4):" in line, line
  full_critic = ppo(model__roles={"critic": {"lora_rank": 0}})
  assert full_critic.model.for_role("critic").lora is None
  assert full_critic.model.adapted_roles == ("actor",)
  with pytest.raises(ConfigError, match=r"'model.roles.reference.lora_rank'=4: ppo does not train"):
    ppo(model__roles={"reference": {"lora_rank": 4}})
  with pytest.raises(ConfigError, match=r"'lora_rank' must be >= 0"):
    ppo(model__roles={"critic": {"lora_rank": -1}})


# ---------------------------------------------------------------------------------------------
# QLoRA: the frozen base's adapted kernels in int8 (`model.lora.quantize='int8'`).


def test_int8_kernels_are_within_half_a_step_of_the_float_ones_and_run_as_them():
  """`quantize_kernel` against NumPy: per output channel (the dimensions the einsum does not
  contract) `s = max |W| / 127`, `q = round(W / s)`, so every weight is within `s / 2` of
  `q * s`; a model whose kernels are int8 computes what the float model with the dequantized
  kernels computes (the forward dequantizes in float32 first)."""
  rng = np.random.default_rng(0)
  w = rng.normal(size=(3, 56, 4, 12)).astype(np.float32) * 0.02  # stacked q_proj [l, d, h, n]
  shape, axes = lora.scale_layout("btd,dhn->bthn", w.shape[1:], ("embed", "heads", "kv"))
  assert shape == (1, 4, 12) and axes == (None, "heads", "kv")
  stored = lora.quantize_kernel(jnp.asarray(w), (3, *shape))
  assert set(stored) == {"kernel", lora.SCALE}
  q, s = stored["kernel"], stored[lora.SCALE]
  amax = np.max(np.abs(w), axis=1, keepdims=True)
  np.testing.assert_allclose(np.asarray(s), amax / 127, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(q), np.clip(np.round(w / (amax / 127)), -127, 127))
  assert q.dtype == jnp.int8 and np.max(np.abs(np.asarray(q, np.int32))) == 127
  err = np.abs(np.asarray(lora.dequantize_kernel(q, s)) - w)
  assert np.all(err <= np.asarray(s) / 2 * (1 + 1e-6))

  quantized, params, got = _quantized_model_runs_as_its_floats("int8", jnp.int8)
  tokens = _tokens()
  mask = jnp.ones_like(tokens)
  logits = jax.jit(models.forward_logits, static_argnums=0)
  # Merged, the rollout's weights: float32 kernels, no scales, the same adapted model.
  merged = lora.merged(params, quantized.lora)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(merged))
  plain = get_model_config("tiny")
  np.testing.assert_allclose(
    np.asarray(logits(plain, merged, tokens, mask)), np.asarray(got), rtol=1e-5, atol=1e-5
  )


def test_nf4_kernels_match_numpy_and_run_as_their_dequantized_floats():
  """'nf4' against NumPy: in blocks of `gcd(56, 64)` = 8 weights along the contracted width,
  each block's absmax as its scale and each weight the nearest NF4 level of `w / absmax`, two
  codes a byte, the even one in the low nibble; the scales quantized again (QLoRA's double
  quantization): per output channel the largest in float32, each block's as the nearest of
  255ths of it (uint8). So every weight is within half the widest gap between levels (0.139)
  of its block's scale plus the channel's largest over 510; a zero block keeps no scale.
  A model of 'nf4' kernels computes what the float model with the dequantized kernels
  computes."""
  rng = np.random.default_rng(1)
  w = rng.normal(size=(3, 56, 4, 12)).astype(np.float32) * 0.02  # stacked q_proj [l, d, h, n]
  w[0, :8, 0, 0] = 0  # a zero block
  eqn = "btd,dhn->bthn"
  shape, axes = lora.scale_layout(eqn, w.shape[1:], ("embed", "heads", "kv"), "nf4")
  assert shape == (7, 4, 12) and axes == ("embed", "heads", "kv")
  top_shape, top_axes = lora.max_layout(eqn, w.shape[1:], ("embed", "heads", "kv"))
  assert top_shape == (1, 4, 12) and top_axes == (None, "heads", "kv")
  assert lora.stored_shape(eqn, w.shape[1:], "nf4") == (28, 4, 12)
  stored = lora.quantize_kernel(jnp.asarray(w), (3, *shape), "nf4", (3, *top_shape))
  q, s, top = stored["kernel"], stored[lora.SCALE], stored[lora.SCALE_MAX]
  assert q.dtype == jnp.uint8 and q.shape == (3, 28, 4, 12)
  assert s.dtype == jnp.uint8 and top.dtype == jnp.float32 and top.shape == (3, 1, 4, 12)
  levels = np.asarray(lora.NF4_LEVELS, np.float32)
  blocks = w.reshape(3, 7, 8, 4, 12).astype(np.float64)
  amax = np.max(np.abs(blocks), axis=2, keepdims=True)
  normed = blocks / np.where(amax > 0, amax, 1)
  codes = np.argmin(np.abs(normed[..., None] - levels), axis=-1).reshape(w.shape)
  channel_max = np.max(amax, axis=1, keepdims=True)  # [3, 1, 1, 4, 12]
  np.testing.assert_allclose(np.asarray(top), channel_max.reshape(3, 1, 4, 12), rtol=1e-7)
  fractions = np.round(amax / channel_max * 255)
  np.testing.assert_array_equal(np.asarray(s), fractions.reshape(3, 7, 4, 12))
  assert np.asarray(s)[0, 0, 0, 0] == 0 and np.all(np.asarray(s).max(axis=1) == 255)
  packed = np.asarray(q)
  np.testing.assert_array_equal(packed & 15, codes[:, 0::2])
  np.testing.assert_array_equal(packed >> 4, codes[:, 1::2])
  got = np.asarray(lora.dequantize_kernel(q, s, top))
  scale = fractions * (channel_max / 255)
  want = (levels[codes].reshape(blocks.shape) * scale).reshape(w.shape)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
  half_gap = np.max(np.diff(levels)) / 2
  bound = half_gap * amax + channel_max / 510  # the level's error, the scale's
  assert np.all(np.abs(got - w) <= np.broadcast_to(bound, blocks.shape).reshape(w.shape) * 1.0001)
  assert np.all(got[0, :8, 0, 0] == 0)

  _quantized_model_runs_as_its_floats("nf4", jnp.uint8)


def _quantized_model_runs_as_its_floats(quantization: str, dtype):
  """`(model, params, logits)` of the adapted tiny model over a `quantization` base (every
  adapted kernel, and only those, of `dtype`), its logits those of the float model with the
  dequantized kernels (the forward dequantizes in float32 first)."""
  quantized = ADAPTED.replace(quantized=ADAPTED.lora.targets, quantization=quantization)
  params = _with_random_b(models.init_params(quantized, "lm", jax.random.key(0)))
  leaves = jax.tree_util.tree_leaves_with_path(params)
  stored = {
    jax.tree_util.keystr(p) for p, x in leaves if x.dtype == dtype and p[-1].key != lora.SCALE
  }
  adapted = {jax.tree_util.keystr(p[:-1]) for p, _ in leaves if str(p[-1]) == "['lora_a']"}
  assert stored == {f"{k}['kernel']" for k in adapted} and len(stored) == 7  # q k v o gate up down
  tokens = _tokens()
  mask = jnp.ones_like(tokens)
  logits = jax.jit(models.forward_logits, static_argnums=0)
  got = logits(quantized, params, tokens, mask)
  want = logits(ADAPTED, lora.dequantized(params), tokens, mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  return quantized, params, got


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_a_float_checkpoint_loads_as_a_quantized_base_with_its_own_scales(tmp_path, quantization):
  """QLoRA from a Hugging Face checkpoint: the adapted kernels are the checkpoint's quantized
  (`quantize_kernel` of its float weights), sharded as the float kernels would be, the rest
  as saved, and the adapters fresh."""
  from hf_dirs import TINY_QWEN2, write_checkpoint

  from rlhfjax.training import weights

  write_checkpoint(tmp_path / "qwen2", TINY_QWEN2)
  model = TINY_QWEN2.replace(
    lora=LoraConfig(rank=4), quantized=("q", "down"), quantization=quantization
  )
  spec = RoleSpec.training(range(8), fsdp=4, tensor=2)
  mesh = meshes.make_mesh(spec)
  load = lambda m: weights.load_params(  # noqa: E731
    str(tmp_path / "qwen2"),
    model=m,
    head="lm",
    mesh=mesh,
    layout=spec.layout,
    shardings=weights.param_shardings(m, "lm", mesh, spec.layout),
    rng=jax.random.key(0),
    items=("actor",),
    what="init.actor",
  )
  got, float_params = load(model), load(model.replace(quantized=()))
  for name in ("q_proj", "k_proj"):
    proj = got["layers"]["attn"][name]
    base = float_params["layers"]["attn"][name]["kernel"]
    if name == "k_proj":  # not quantized
      assert proj["kernel"].dtype == base.dtype and lora.SCALE not in proj
      np.testing.assert_array_equal(np.asarray(proj["kernel"]), np.asarray(base))
      continue
    top = proj[lora.SCALE_MAX].shape if quantization == "nf4" else None
    want = lora.quantize_kernel(base, proj[lora.SCALE].shape, quantization, top)
    assert set(want) == {k for k in proj if k not in (*lora.ADAPTER_LEAVES, "bias")}
    for leaf, value in want.items():
      np.testing.assert_array_equal(np.asarray(proj[leaf]), np.asarray(value))
    assert proj["kernel"].sharding.is_equivalent_to(base.sharding, base.ndim)
    where = lambda x: {  # noqa: E731
      (d.device.id, tuple((i.start, i.stop) for i in d.index)) for d in x.addressable_shards
    }
    if quantization == "int8":
      assert where(proj["kernel"]) == where(base) and len({i for _, i in where(base)}) > 1
    else:  # the codes split as the float kernel, two to a byte along its contracted width
      halved = {
        (d, (i[0], tuple(None if x is None else x // 2 for x in i[1]), *i[2:]))  # [l, d, ...]
        for d, i in where(base)
      }
      assert where(proj["kernel"]) == halved
      assert len({i for _, i in where(base)}) > 1
  want = jnp.int8 if quantization == "int8" else jnp.uint8
  assert got["layers"]["mlp"]["down_proj"]["kernel"].dtype == want
  assert np.all(np.asarray(got["layers"]["attn"]["q_proj"]["lora_b"]) == 0)


@pytest.mark.parametrize("variant,quantization", [("colocated", "int8"), ("disaggregated", "nf4")])
def test_grpo_over_a_quantized_base(tmp_path, variant, quantization):
  """Two GRPO iterations with adapters over a quantized base: int8, co-located on 8 devices
  (the merged weights cast for the rollout; the reference placed as a copy of its own), and
  nf4, disaggregated (the rollout's dequantized base copy, the adapters moved alone; the
  reference on the actor's base): either reference is the quantized base (KL 0 at first); the
  actor's bytes are what the memory model says; the rollout ends with the merged, dequantized
  weights; and a resume from the first checkpoint repeats the second iteration."""
  changes = {"model.lora.quantize": quantization, "total_steps": 2, "eval.num_prompts": 0}
  changes["checkpoint.every_steps"] = 1
  if variant == "disaggregated":
    changes.update({"placement.num_devices": 2, "placement.rollout_tensor": 1})
  else:
    changes["model.lora.reference"] = "placed"
  cfg = shipped_config("grpo_lora_tiny", changes, variant)
  assert cfg.model.reference_from_base == (variant == "disaggregated")
  assert cfg.model.for_role("reference").quantized == cfg.model.lora.targets
  assert cfg.model.for_role("actor").quantization == quantization
  runner = Runner(cfg, str(tmp_path / "run"), show_progress=False)
  rows = runner.run().metrics
  assert rows[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl/mean"] > 0
  cluster = runner.cluster
  if variant == "colocated":  # the placed reference holds the actor's int8 base itself
    reference = cluster.weights(Role.REFERENCE)["layers"]["attn"]["q_proj"]
    actor_q = cluster.weights(Role.ACTOR)["layers"]["attn"]["q_proj"]
    assert reference["kernel"].dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(reference["kernel"]), np.asarray(actor_q["kernel"]))
  actor, model = cluster.weights(Role.ACTOR), cluster.roles[Role.ACTOR].model
  assert model.quantized == model.lora.targets
  assert sum(x.nbytes for x in jax.tree.leaves(actor)) == (
    memory.stored_param_bytes(model, "lm") + memory.adapter_bytes(model)
  )
  # float32 weights: int8 about a quarter of their bytes over the adapted kernels, nf4 an
  # eighth plus a scale per block of 8 (the tiny model's width).
  assert memory.stored_param_bytes(model, "lm") < {"int8": 0.6, "nf4": 0.5}[
    quantization
  ] * memory.stored_param_bytes(model.replace(quantized=()), "lm")
  wanted = models.abstract_params(cluster.roles[Role.ROLLOUT].model, "lm")
  merged = jax.tree.map(
    lambda x, w: np.asarray(x).astype(w.dtype), lora.merged(actor, model.lora), wanted
  )
  # The sync merges in its own compiled program, this reference eagerly: a merged element is
  # the dequantized base plus a sum of `rank` adapter products, so the two orders of the same
  # float32 sums differ by at most rank + 1 roundings of the largest term.
  for a, b in zip(jax.tree.leaves(cluster.engine.params), jax.tree.leaves(merged), strict=True):
    ulps = (model.lora.rank + 1) * np.finfo(b.dtype).eps * np.abs(b).max()
    np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=ulps)
  assert cluster.syncs_adapters == (variant == "disaggregated")
  if variant == "disaggregated":
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "run", cut, ignore=shutil.ignore_patterns(".lock", "finished.json"))
    shutil.rmtree(cut / "checkpoints" / "2")
    resumed = Runner(cfg, str(cut), show_progress=False)
    assert resumed.start_step == 1
    again = resumed.run().metrics
    assert deterministic(again[-1]) == deterministic(rows[1])
