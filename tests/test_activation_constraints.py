"""The trainer's compiled programs apply the model's activation sharding constraints."""

import functools
import json
import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax.bench import memory_bench
from rlhfjax.cluster.cluster import Cluster, WeightSource
from rlhfjax.config import OptimizerConfig, from_config_dict
from rlhfjax.placement import strategies
from rlhfjax.placement.spec import Role
from rlhfjax.training import steps
from rlhfjax.training.optimizer import make_optimizer

pytestmark = pytest.mark.unit

_CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
SEQ, PROMPT, ROWS = 127, 31, 8


def _peak(stats) -> int:
  return (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
  )


def _actor_steps():
  """The cluster's real actor step (co-located: FSDP over 8 devices) and the same step jitted
  as the trainer compiled it before (no mesh or rules context), with their inputs' shapes."""
  cd = runpy.run_path(str(_CONFIGS / "ppo_tiny.py"))["get_config"]("colocated")
  cfg = from_config_dict(cd)
  cluster = Cluster(cfg, strategies.build_placement(cfg.placement, 8))
  actor = cluster.roles[Role.ACTOR]
  tx = make_optimizer(OptimizerConfig(), 1000)
  cluster.train(Role.ACTOR, WeightSource(source="", what="init", rng=jax.random.key(0)), tx)
  loss = functools.partial(
    steps.actor_loss, config=actor.model, prompt_len=PROMPT, clip_eps=0.2, entropy_coef=0.0
  )
  real = cluster.train_step("actor_step", Role.ACTOR, loss)
  shardings = cluster.state_shardings[Role.ACTOR]
  plain = jax.jit(
    functools.partial(steps.accumulate_and_apply, loss, tx),
    in_shardings=(shardings, None),
    out_shardings=(shardings, actor.replicated),
    donate_argnums=0,
  )
  batch = memory_bench.actor_batch(actor, ROWS, SEQ, PROMPT)
  return cluster, real, plain, batch


def test_the_real_train_step_splits_activations_over_the_batch():
  cluster, real, plain, batch = _actor_steps()
  state = cluster.abstract_states()["actor"]
  constrained = _peak(real.lower(state, batch).compile().memory_analysis())
  unconstrained = _peak(plain.lower(state, batch).compile().memory_analysis())
  bench, _ = memory_bench.actor_step_memory(
    cluster.roles[Role.ACTOR].model, 8, SEQ, prompt_len=PROMPT, micro_batch=ROWS
  )
  # XLA's own analysis: without the constraints every device holds the whole batch's
  # activations; with them the real step needs what bench_memory reports.
  assert constrained < 0.5 * unconstrained, (constrained, unconstrained)
  assert constrained == _peak(bench)

  # Same numbers: one step from the same state and batch through both programs.
  cluster.materialize()
  rng = np.random.default_rng(0)
  host = {
    "tokens": rng.integers(1, 300, size=(1, ROWS, SEQ)).astype(np.int32),
    "attention_mask": np.ones((1, ROWS, SEQ), np.int32),
    "response_mask": (rng.random((1, ROWS, SEQ - PROMPT)) < 0.9).astype(np.float32),
    "old_logprobs": rng.normal(size=(1, ROWS, SEQ - PROMPT)).astype(np.float32) - 5,
    "advantages": rng.normal(size=(1, ROWS, SEQ - PROMPT)).astype(np.float32),
  }
  put = lambda: cluster.upload(Role.ACTOR, host, "batch", leading=1)
  copy = lambda: jax.tree.map(jnp.copy, cluster.states[Role.ACTOR])
  state_a, metrics_a = real(copy(), put())
  state_b, metrics_b = plain(copy(), put())
  # A different layout sums in a different order: equal within the tolerance test_ppo.py
  # allows between placements (each placement's layout is also a different summation order).
  leaves_a = jax.tree.leaves((state_a, metrics_a))
  leaves_b = jax.tree.leaves((state_b, metrics_b))
  for a, b in zip(leaves_a, leaves_b, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  assert float(metrics_a["loss/policy"]) == pytest.approx(float(metrics_b["loss/policy"]), rel=1e-6)
  assert cluster.traces.counts == {"actor_step": 1}


def test_bench_memory_takes_a_config_json(tmp_path):
  """`--sizes` takes a Hugging Face config.json (or its directory): its shape, with the named
  sizes' fp32 masters and bf16 compute."""
  hf = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "vocab_size": 1000,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
  }
  (tmp_path / "config.json").write_text(json.dumps(hf))
  for where in (tmp_path, tmp_path / "config.json"):
    model = memory_bench.bench_model(str(where))
    assert (model.hidden_size, model.num_kv_heads, model.num_layers) == (256, 2, 3)
    assert (model.param_dtype, model.dtype) == ("float32", "bfloat16")
  assert memory_bench.bench_model("7b").hidden_size == 4096
  with pytest.raises(ValueError, match="not found"):
    memory_bench.bench_model(str(tmp_path / "nope" / "config.json"))
  # `--context`: one sequence of 4096 tokens over the 8 devices peaks far below one such
  # sequence per device (XLA's analysis of the compiled step).
  measure = lambda seq, context: memory_bench.measure(
    str(tmp_path), seq, "full", True, chunk_size=128, context=context
  )[0]
  split, whole = measure(4096, 8), measure(4096, 1)
  assert (split.context, split.as_row()["context"], whole.context) == (8, 8, 1)
  assert split.step_peak_gb < 0.5 * whole.step_peak_gb, (split, whole)
  # `--lora_rank`: adapters over a frozen bf16 base; the co-located critic has them too, the
  # frozen reference and reward none: less resident memory and a smaller step.
  adapted = memory_bench.measure(str(tmp_path), 4096, "full", True, chunk_size=128, lora_rank=4)
  assert adapted[0].as_row()["lora_rank"] == 4
  assert adapted[0].colocated_resident_gb < whole.colocated_resident_gb
  assert adapted[0].step_peak_gb < whole.step_peak_gb
  with pytest.raises(ValueError, match="--context=3 must divide the 8 devices"):
    measure(4096, 3)
