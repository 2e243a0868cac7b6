"""Stages every online flow composes: prompts in groups, generation, scoring by a role.

`FlowContext` is what a flow is built from: the config, the cluster, the rewards, the
tokenizer and the prompt stream (the runner owns and checkpoints the stream).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rlhfjax import models
from rlhfjax.cluster.cluster import Cluster
from rlhfjax.cluster.rewards import Rewards
from rlhfjax.config import ExperimentConfig
from rlhfjax.data.chat_template import data_template
from rlhfjax.data.records import PromptBatch
from rlhfjax.flows import experience
from rlhfjax.flows.environments import Conversations
from rlhfjax.flows.experience import Sequences
from rlhfjax.placement.spec import Role
from rlhfjax.rollout.sampling import SamplingParams
from rlhfjax.training import steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowContext:
  """What a flow factory (`make_flow(ctx) -> flow`) gets."""

  cfg: ExperimentConfig
  cluster: Cluster
  rewards: Rewards | None
  """None for a flow that reads no prompts (`rlhfjax.flows.registry`): it scores no samples."""
  tokenizer: Any
  prompts: Any
  """The endless, checkpointed prompt iterator (`take(n)`); None for a flow that reads none."""
  workdir: str
  """The run's directory (prepared datasets go to WORKDIR/data unless `data.data_dir`)."""


def sampling(cfg: ExperimentConfig, tokenizer: Any, **changes: Any) -> SamplingParams:
  """The rollout's sampling settings (`changes` override fields, e.g. temperature)."""
  r = cfg.rollout
  params = SamplingParams(
    temperature=r.temperature,
    top_k=r.top_k,
    top_p=r.top_p,
    max_new_tokens=r.max_new_tokens,
    # A checkpoint's own stop tokens too (Llama 3 Instruct ends a turn with <|eot_id|>).
    stop_token_ids=tuple(
      dict.fromkeys(
        (tokenizer.eos_id, *cfg.model.for_role("actor").eos_token_ids, *r.stop_token_ids)
      )
    ),
  )
  return dataclasses.replace(params, **changes)


def conversations(ctx: FlowContext) -> Conversations | None:
  """The environments of one rollout batch (`rollout.environment`), or None for one answer
  per prompt."""
  cfg = ctx.cfg
  if not cfg.rollout.environment:
    return None
  return Conversations(
    cfg.rollout.environment,
    tokenizer=ctx.tokenizer,
    vocab_size=ctx.cluster.roles[Role.ROLLOUT].model.vocab_size,
    chat_template=data_template(cfg.data),
    max_turns=cfg.rollout.max_turns,
    on_error=cfg.rollout.on_environment_error,
    workers=cfg.rollout.environment_workers,
  )


def start_conversations(
  ctx: FlowContext, prompts: PromptBatch, seed: int
) -> tuple[PromptBatch, Conversations | None]:
  """The batch's prompts and environments: each environment's `reset` makes its row's prompt
  (the batch as it is without an environment)."""
  convs = conversations(ctx)
  if convs is None:
    return prompts, None
  return convs.start(prompts, seed, ctx.cfg.rollout.max_prompt_len), convs


def conversation_fields(
  convs: Conversations | None, observed: np.ndarray, rows: Any = slice(None)
) -> dict[str, Any]:
  """`experience.assemble`'s conversation arguments for `rows` of the batch: the observations
  and each turn's rewards (final for a finished conversation)."""
  if convs is None:
    return {}
  rewards = convs.turn_rewards()
  return {
    "observed": observed[rows],
    "environment_turn_rewards": [rewards[i] for i in np.arange(len(rewards))[rows]],
  }


def conversation_stats(convs: Conversations | None, seqs: Sequences) -> Sequences:
  """`seqs` with the batch's conversation stats and observation share."""
  if convs is None:
    return seqs
  real = seqs.attention_mask_bs[:, seqs.prompt_len :].sum()
  stats = convs.stats() | {
    "rollout/observation_share": float(1.0 - seqs.response_mask_bt.sum() / max(real, 1))
  }
  return dataclasses.replace(seqs, conversation_stats=stats)


def rollout_seed(cfg: ExperimentConfig, iteration: int) -> int:
  """Every random choice of iteration `iteration` derives from (seed, iteration)."""
  return (cfg.seed * 1_000_003 + iteration) % 2**31


def generate(
  ctx: FlowContext,
  prompts: PromptBatch | list[list[int]],
  params: SamplingParams,
  seed: int,
  *,
  on_decode_call: Callable[[], None] | None = None,
) -> Sequences:
  """Responses from the rollout engine laid out as sequences (host token ids), each row with
  its prompt's record.

  The engine's continuous batching admits prompts and returns finished responses through the
  host: the one named host transfer of generation. `on_decode_call` runs before each device
  decode call (`rlhfjax.rollout.streaming.RolloutStream`)."""
  return generate_with_versions(ctx, prompts, params, seed, on_decode_call=on_decode_call)[0]


def generate_with_versions(
  ctx: FlowContext,
  prompts: PromptBatch | list[list[int]],
  params: SamplingParams,
  seed: int,
  *,
  on_decode_call: Callable[[], None] | None = None,
) -> tuple[Sequences, np.ndarray]:
  """`generate`, and the engine's `params_version` of each response token as `[b, t]` int32
  laid out as `Sequences.response_mask_bt` (-1 off the responses): which weights sampled it
  when `on_decode_call` swaps weights in while rows are mid-answer."""
  cfg = ctx.cfg
  prompts, convs = start_conversations(ctx, PromptBatch.of(prompts), seed)
  with ctx.cluster.host("generate"), ctx.cluster.generating():
    out = ctx.cluster.engine.generate(
      prompts.tokens,
      sampling=params,
      seed=seed,
      on_decode_call=on_decode_call,
      turn=None if convs is None else convs.turn,
      turn_tokens=cfg.rollout.max_turn_tokens,
    )
  seqs = experience.assemble(
    prompts.tokens,
    out.tokens,
    out.lengths,
    out.logprobs,
    prompt_len=cfg.rollout.max_prompt_len,
    response_len=cfg.rollout.max_new_tokens,
    pad_id=ctx.tokenizer.pad_id,
    records=prompts.records,
    **conversation_fields(convs, out.observed),
  )
  seqs = conversation_stats(convs, seqs)
  versions_bt = np.full(seqs.response_mask_bt.shape, -1, np.int32)  # -1 past each length
  width = min(versions_bt.shape[1], out.versions.shape[1])
  versions_bt[:, :width] = out.versions[:, :width]
  return seqs, versions_bt


def generate_stage(
  ctx: FlowContext, iteration: int, prompts: PromptBatch | list[list[int]], attempt: int = 0
) -> Sequences:
  """`generate` at the rollout's settings, recorded on the timeline (`attempt` > 0: another
  batch of the same iteration, with its own randomness)."""
  return generate_stage_with_versions(ctx, iteration, prompts, attempt)[0]


def generate_stage_with_versions(
  ctx: FlowContext,
  iteration: int,
  prompts: PromptBatch | list[list[int]],
  attempt: int = 0,
  *,
  on_decode_call: Callable[[], None] | None = None,
) -> tuple[Sequences, np.ndarray]:
  """`generate_stage` through `generate_with_versions`: the batch and each response token's
  engine `params_version`."""
  cluster = ctx.cluster
  with cluster.timeline.stage(
    iteration, "rollout", "generate", cluster.roles[Role.ROLLOUT].devices
  ):
    seed = (rollout_seed(ctx.cfg, iteration) + 104_729 * attempt) % 2**31
    return generate_with_versions(
      ctx, prompts, sampling(ctx.cfg, ctx.tokenizer), seed, on_decode_call=on_decode_call
    )


def release_metrics(ctx: FlowContext) -> dict[str, float]:
  """`rollout/released_bytes` (the rollout's weight bytes freed after the last generation) when
  `rollout.release` frees them between generations; nothing otherwise."""
  if not ctx.cfg.rollout.release:
    return {}
  return {"rollout/released_bytes": float(ctx.cluster.released_bytes)}


def grouped_prompts(ctx: FlowContext, group_size: int) -> PromptBatch:
  """`rollout.batch_size / group_size` new prompts, each repeated `group_size` times (with its
  record, so every sample of a group sees its prompt's fields)."""
  return ctx.prompts.take_batch(ctx.cfg.rollout.batch_size // group_size).repeat(group_size)


def logprob_scorer(ctx: FlowContext, role: Role, name: str, rows: int | None = None) -> Any:
  """`fn(params, tokens_bs, attention_bs) -> logprobs_bt` compiled on `role`'s mesh for `rows`
  rows (None: the rollout batch)."""
  cfg, rt = ctx.cfg, ctx.cluster.roles[role]
  b, p, t = rows or cfg.rollout.batch_size, cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens
  fn = functools.partial(
    steps.response_logprobs, rt.model, prompt_len=p, temperature=cfg.rollout.temperature
  )
  return _scorer(ctx, role, name, fn, (b, t))


def value_scorer(ctx: FlowContext, role: Role, name: str, rows: int | None = None) -> Any:
  """`fn(params, tokens_bs, attention_bs) -> values_bt` compiled on `role`'s mesh for `rows`
  rows (None: the rollout batch)."""
  cfg, rt = ctx.cfg, ctx.cluster.roles[role]
  b, p, t = rows or cfg.rollout.batch_size, cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens
  fn = functools.partial(steps.response_values, rt.model, prompt_len=p)
  return _scorer(ctx, role, name, fn, (b, t))


def _scorer(ctx: FlowContext, role: Role, name: str, fn: Any, out_shape: tuple[int, ...]):
  rt = ctx.cluster.roles[role]
  b, s = out_shape[0], ctx.cfg.rollout.max_seq_len
  batch = (rt.batch_sharding((b, s)), rt.batch_sharding((b, s)))
  return ctx.cluster.scorer(
    name,
    fn,
    in_shardings=(rt.param_shardings, *batch),
    out_shardings=rt.batch_sharding(out_shape),
    role=role,
  )


def packed_logprob_scorer(ctx: FlowContext, role: Role, name: str) -> Any:
  """`fn(params, tokens, positions, segments) -> logprobs` of packed rows (`[r, w]`, slot `c`
  the log-prob of token `c + 1`) compiled on `role`'s mesh, once per row count."""
  cfg, rt = ctx.cfg, ctx.cluster.roles[role]

  def fn(params, tokens, positions, segments):
    return models.packed_token_stats(
      rt.model, params, tokens, positions, segments, cfg.rollout.temperature
    ).logp_bt

  return _packed_scorer(ctx, role, name, fn)


def packed_value_scorer(ctx: FlowContext, role: Role, name: str) -> Any:
  """`fn(params, tokens, positions, segments) -> values` of packed rows (`[r, w]`) compiled on
  `role`'s mesh (critic or reward model), once per row count."""
  model = ctx.cluster.roles[role].model
  fn = functools.partial(models.forward_packed, model, head="value")
  return _packed_scorer(ctx, role, name, fn)


def _packed_scorer(ctx: FlowContext, role: Role, name: str, fn: Any):
  """`fn` on `role`'s mesh; with pipeline stages a forward-only pipeline over the packed rows
  (`Cluster.scorer`: rows are independent, each attends within its own segments)."""
  rt = ctx.cluster.roles[role]
  return ctx.cluster.scorer(
    name, fn, in_shardings=(rt.param_shardings, None, None, None), role=role
  )


def score_stage(ctx: FlowContext, role: Role, scorer: Any, inputs: tuple[jax.Array, ...]):
  """A stage scoring `inputs` (on any mesh: tokens and attention mask, or packed rows) with
  `role`'s weights on its own mesh."""
  cluster = ctx.cluster

  def run():
    return scorer(cluster.weights(role), *cluster.move(role, inputs))

  return cluster.stage(role, "score", run)


def minibatch_splitter(
  ctx: FlowContext,
  role: Role,
  name: str,
  shapes: dict[str, tuple[int, ...]],
  *,
  mini: int,
  micro: int,
  seed: int,
) -> Any:
  """`fn(batch, step) -> (mini-batch, ...)`: the rows of `batch` shuffled on `role`'s mesh by a
  permutation keyed by (`seed`, the role's optimizer step `step`), split into `mini`
  mini-batches of `micro` micro-batches (leaves `[micro, rows, ...]`)."""
  rt = ctx.cluster.roles[role]
  b = next(iter(shapes.values()))[0]
  size = b // mini
  rows = size // micro

  def split(batch, step):
    order = minibatch_order(seed, step, b)
    out = []
    for k in range(mini):
      idx = order[k * size : (k + 1) * size]
      out.append({n: x[idx].reshape(micro, rows, *x.shape[1:]) for n, x in batch.items()})
    return tuple(out)

  out_shardings = tuple(
    {n: rt.batch_sharding((micro, rows, *shape[1:]), leading=1) for n, shape in shapes.items()}
    for _ in range(mini)
  )
  return ctx.cluster.compile(name, split, out_shardings=out_shardings)


def minibatch_order(seed: int, step: jax.Array, b: int) -> jax.Array:
  """The order the rows of a batch are dealt into mini-batches at optimizer step `step`."""
  return jax.random.permutation(jax.random.fold_in(jax.random.key(seed), step), b)
