"""A generative judge as a reward (issue 42 item 2, `reward.judge`): verdicts parsed against a
Python reference on fixed verdicts; the judge's verdicts are greedy generation without a cache
over the filled template (`rollout_reference`), from its own engine on its own devices; the
combined reward; one-line config errors; a fused GRPO run that logs its parse failures."""

import json

import jax
import numpy as np
import pytest
import rollout_reference
from runs_testing import rows, shipped_config

from rlhfjax import models, rollout
from rlhfjax.cluster.cluster import Cluster, extra_rng
from rlhfjax.cluster.judge import first_number
from rlhfjax.cluster.rewards import Rewards
from rlhfjax.config import ConfigError
from rlhfjax.data.byte_tokenizer import ByteTokenizer
from rlhfjax.flows.experience import assemble
from rlhfjax.placement import memory
from rlhfjax.planner import place
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

TEMPLATE = "Q: {prompt} A: {response} Verdict:"


def verdict_code(verdict: str) -> float:
  """A test parser: the verdict's bytes summed mod 7; a verdict holding no 'a'-'m' letter
  fails (an untrained judge writes both kinds)."""
  if not any("a" <= c <= "m" for c in verdict):
    raise ValueError("no letter a-m")
  return float(sum(verdict.encode()) % 7)


def _judge_config(**changes):
  return shipped_config(
    "grpo_tiny",
    {
      "model.extra_roles": {"critic_llm": {"kind": "judge", "size": "tiny"}},
      "placement.extra_roles": {"critic_llm": {"mode": "own", "devices": 4, "tensor": 2}},
      "reward.judge": "critic_llm",
      "reward.judge_template": TEMPLATE,
      "reward.judge_parser": f"{__name__}:verdict_code",
      "reward.judge_failure_score": -1.0,
      "reward.judge_coef": 0.5,
      "reward.model_coef": 0.0,
      "reward.fn_coef": 2.0,
      **changes,
    },
  )


def test_verdicts_parse_to_scores_as_python_does():
  cfg = _judge_config()
  from rlhfjax.cluster.judge import Judge

  class _Nothing:  # (`scores_of` needs no cluster)
    roles: dict = {}

  judge = Judge(cfg, _Nothing(), ByteTokenizer())
  verdicts = ["abc", "ZZZ", "", "hello m", "123", "a\u00e9b"]
  want, failures = [], 0
  for v in verdicts:
    try:
      want.append(verdict_code(v))
    except ValueError:
      want.append(-1.0)
      failures += 1
  np.testing.assert_array_equal(judge.scores_of(verdicts), np.asarray(want, np.float32))
  assert judge.take_failures() == failures == 3 and judge.take_failures() == 0
  assert first_number("Score: 8/10") == 8.0 and first_number("-1.5 points") == -1.5
  with pytest.raises(ValueError, match="no number"):
    first_number("good")


def test_the_judge_generates_on_its_own_devices_as_generation_without_a_cache():
  cfg = _judge_config()
  spec = place.place(cfg, 8)
  assert spec["critic_llm"].devices == (4, 5, 6, 7)
  cluster = Cluster(cfg, spec)
  tokenizer = ByteTokenizer()
  rewards = Rewards(cfg, cluster, tokenizer)
  cluster.materialize()
  rng = np.random.default_rng(0)
  prompts = [tokenizer.encode(t) for t in ("2+2=", "hello", "what is 7*6?", "x")]
  responses = rng.integers(32, 127, (4, 10)).astype(np.int32)
  seqs = assemble(
    prompts, responses, np.asarray([10, 3, 7, 1]), np.zeros((4, 10), np.float32),
    prompt_len=cfg.rollout.max_prompt_len, response_len=cfg.rollout.max_new_tokens, pad_id=0,
  )  # fmt: skip
  judge = rewards.judge
  got = judge.verdicts(seqs)
  # Its engine's weights live on its four devices (data 2 x tensor 2).
  for leaf in jax.tree.leaves(judge.engine.params):
    assert {s.device.id for s in leaf.addressable_shards} == {4, 5, 6, 7}
  # The memory check counts the engine as it is: its KV pool on one device is the bytes the
  # engine allocates there, and its weights too but for the norm scales, which the cost model
  # divides over 'tensor' like every weight and the engine keeps whole on each device.
  estimate = memory.estimate_placement_memory(spec, cfg.model, cfg.rollout)["critic_llm"]
  on_device = lambda tree: sum(
    s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
    if s.device.id == 4
  )  # fmt: skip
  assert estimate.kv_cache == on_device(judge.engine.init_decode_state().cache)
  judge_model = cluster.roles["critic_llm"].model
  norms = (2 * judge_model.num_layers + 1) * judge_model.hidden_size * 4
  assert 0 <= on_device(judge.engine.params) - estimate.params <= norms // 2
  # The reference: greedy generation without a cache over the same filled templates.
  filled = [
    TEMPLATE.replace("{prompt}", tokenizer.decode(p)).replace("{response}", tokenizer.decode(r))
    for p, r in zip(seqs.prompts, seqs.responses, strict=True)
  ]
  ids = [tokenizer.encode(t) for t in filled]
  assert ids == judge.prompts(seqs)
  # The judge's weights from their source (random, from the seed and the role's name) again,
  # as the reference's; the role's own copy went once the engine had its own.
  assert "critic_llm" not in cluster.params
  model = cluster.roles["critic_llm"].model
  params = models.init_params(model, "lm", extra_rng(cfg.seed, "critic_llm"))
  ref = rollout_reference.generate(
    model, params, ids,
    rollout.SamplingParams(temperature=0.0, stop_token_ids=(tokenizer.eos_id,)),
    max_new_tokens=cfg.model.extra_roles["critic_llm"].max_new_tokens,
  )  # fmt: skip
  want = [tokenizer.decode(ref.tokens[i, : ref.lengths[i]]) for i in range(4)]
  assert got == want and len(set(want)) > 1
  # The combined reward: the rule and the judge, weighted (host scores, fp32).
  todo = rewards.stages(None, seqs, 0)
  assert [(s.role, s.devices) for s in todo] == [("reward_fn", ()), ("critic_llm", (4, 5, 6, 7))]
  results = dict(zip([s.role for s in todo], cluster.run(todo, 0), strict=True))
  judged = judge.scores_of(want)
  np.testing.assert_array_equal(results["critic_llm"], judged)
  combined = np.asarray(cluster.fetch(rewards.combine(results), "test"))
  expected = np.float32(2.0) * results["reward_fn"] + np.float32(0.5) * judged
  np.testing.assert_allclose(combined, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  ("changes", "message"),
  [
    ({"reward.judge": "nobody"}, r"'reward.judge'='nobody': no extra role of kind 'judge'"),
    ({"reward.judge": ""}, r"'model.extra_roles.critic_llm' is a judge but 'reward.judge' is ''"),
    ({"reward.judge_template": "{prompt} says"}, r"'reward.judge_template' must contain \{resp"),
    ({"reward.judge_parser": "nocolon"}, r"'reward.judge_parser' must be 'module:function'"),
  ],
)
def test_a_bad_judge_config_is_one_line(changes, message):
  with pytest.raises(ConfigError, match=message) as error:
    _judge_config(**changes)
  assert "\n" not in str(error.value)


def test_a_fused_run_judges_samples_as_they_finish_and_counts_failures(tmp_path):
  cfg = _judge_config(
    **{
      "total_steps": 1,
      "rollout.batch_size": 8,
      "rollout.max_new_tokens": 8,
      "rollout.fused_scoring": True,
      "rollout.score_micro_batch": 4,
      "eval.num_prompts": 0,
    }
  )
  Runner(cfg, str(tmp_path), show_progress=False).run()
  (row,) = rows(str(tmp_path))
  assert 0 <= row["reward/judge_failures"] <= 8
  timeline = json.loads((tmp_path / "timeline.json").read_text())
  judged = [e for e in timeline if e["role"] == "critic_llm"]
  assert len(judged) == 2 and all(e["devices"] == [4, 5, 6, 7] for e in judged)  # 2 micro-batches
