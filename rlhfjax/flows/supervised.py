"""What SFT and reward-model training share: one model trained on one dataset.

The flow trains its one role (placed alone on its mesh, see `rlhfjax.planner.place`) with
the optimizer and the train step PPO uses (`Cluster.train_step`, `steps.accumulate_and_apply`
over `supervised.micro_batches`); each iteration is one optimizer update on the next batch of
the training split. `evaluate` scores the whole held-out split with a second compiled function
as exact averages however it is batched; the runner records it at step 0, every
`eval.every_steps` steps and after the last. Rows are numbered by the updates done (the row of
iteration i is step i + 1). Subclasses say what the model predicts: the role, the data and the
loss (`rlhfjax.flows.sft`, `rlhfjax.flows.rm`).

With `supervised.packing` the update runs on packed micro-batches of the batch's sequences
(`rlhfjax.flows.packed_update`; a reward model's pair kept in one), their losses weighted so the
update is the whole batch's exact mean; evaluation stays padded.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import jax
import numpy as np

from rlhfjax import data, distributed
from rlhfjax.cluster.cluster import WeightSource
from rlhfjax.config import ConfigError, ExperimentConfig
from rlhfjax.data import packed_batches
from rlhfjax.data.chat_template import data_template
from rlhfjax.flows import packed_update
from rlhfjax.flows.base import Flow
from rlhfjax.flows.stages import FlowContext
from rlhfjax.placement.spec import Role
from rlhfjax.training import steps
from rlhfjax.training.optimizer import learning_rate_schedule, make_optimizer

Batch = dict[str, np.ndarray]


def one_model(role: Role) -> dict[str, Any]:
  """The `FlowSpec` of a flow that trains `role` alone on its own dataset, batched by the
  `supervised` section (`rlhfjax.planner.single` sizes it)."""
  return {
    "roles": lambda cfg: frozenset({role}),
    "trains": (role,),
    "section": "supervised",
    "prompts": False,
  }


class SupervisedFlow(Flow):
  """Trains `role` on `data_kind` records; see the module docstring."""

  role: ClassVar[Role]
  optimizer_section: ClassVar[str]
  """The config section of the trained role's optimizer."""
  data_kind: ClassVar[str]
  """The `rlhfjax.data.jsonl` record kind ('demonstration', 'preference')."""
  data_field: ClassVar[str]
  """The `data` field naming its JSONL file (empty: the task's bundled one)."""
  batch_dtypes: ClassVar[dict[str, type]]
  """The batch arrays the loss reads (the pipelines may produce more): `[b, max_len]` each,
  but 'valid', `[b]`."""
  token_masks: ClassVar[tuple[str, ...]]
  """The arrays that mark a batch's real tokens, for throughput."""
  batch_pipeline: ClassVar[Callable[..., Iterator[Batch]]]
  """The `rlhfjax.data.pipeline` batch function of `data_kind` (a staticmethod)."""
  loss: ClassVar[Callable[..., Any]]
  """`loss(params, batch, *, config) -> (loss, metrics)` of one micro-batch (a staticmethod)."""
  eval_sums: ClassVar[Callable[..., Any]]
  """`eval_sums(params, batch, *, config) -> sums` over one eval batch, including 'count'
  (what every other sum is divided by; a staticmethod)."""
  sides: ClassVar[tuple[tuple[str, str], ...]]
  """The (tokens, attention mask) arrays of each sequence of an example: one for SFT, the
  chosen and the rejected one for a pair."""
  loss_masks: ClassVar[tuple[str, ...]] = ()
  """The masks of the sides' tokens `packed_loss` weighs (`slot_weight`)."""
  packed_loss: ClassVar[Callable[..., Any]]
  """`packed_loss(params, micro, *, config) -> (loss, metrics)`: one packed micro-batch's
  contribution to the batch's loss (a staticmethod; `rlhfjax.training.packed`)."""
  headline: ClassVar[str]
  """The held-out metric drawn in `WORKDIR/<plot_file>` and reported at the end of a run."""
  plot_file: ClassVar[str]
  steps_from_one = True

  @property
  def plots(self) -> tuple[tuple[str, str, str], ...]:
    return (
      ("train/loss", "loss.png", "training loss"),
      (self.headline, self.plot_file, f"held-out {self.headline}"),
    )

  def __init__(self, ctx: FlowContext):
    self.ctx = ctx
    cfg, cluster = ctx.cfg, ctx.cluster
    sup = cfg.supervised
    optimizer = getattr(cfg, self.optimizer_section)
    tx = make_optimizer(optimizer, cfg.total_steps)
    self.schedule = learning_rate_schedule(optimizer, cfg.total_steps)
    name = self.role.value
    source = WeightSource(
      source=getattr(cfg.init, name), what=f"init.{name}", rng=jax.random.key(cfg.seed)
    )
    cluster.train(self.role, source, tx)
    self.model = cluster.roles[self.role].model
    self.eval_rows = sup.batch_size // sup.micro_batches
    """Rows of an eval batch: one micro-batch, so evaluation never needs more activations."""
    d = cfg.data
    path = getattr(d, self.data_field) or self._bundled(cfg)
    dataset = distributed.primary_first(
      lambda: data.prepare(
        self.data_kind,
        path,
        d.data_dir or os.path.join(ctx.workdir, "data"),
        on_bad_record=d.on_bad_record,
      )
    )
    self.batches = functools.partial(
      self.batch_pipeline,
      tokenizer=ctx.tokenizer,
      max_len=sup.max_len,
      seed=cfg.seed,
      on_long_prompt=d.on_long_prompt,
      chat_template=data_template(d),
    )
    self.train = self.batches(dataset.source(d.train_split), batch_size=sup.batch_size)
    self._held_out = dataset.source(d.eval_split)
    # The losses as functions of values (not of this flow), so a second run of the same config
    # in this process reuses the compiled steps (`rlhfjax.programs`).
    self._loss = functools.partial(type(self).loss, config=self.model)
    self._packed_loss = functools.partial(type(self).packed_loss, config=self.model)
    self._step = cluster.train_step("train_step", self.role, self._loss)
    if sup.packing:
      k, budget = len(self.sides), sup.max_tokens_per_micro_batch
      if 0 < budget < k * sup.max_len:
        raise ConfigError(
          f"'supervised.max_tokens_per_micro_batch'={budget} is below one pair's capacity, "
          f"2 x supervised.max_len = {k * sup.max_len}"
        )
      self._max_rows = packed_update.max_rows(
        budget, sup.max_len, k * sup.batch_size // sup.micro_batches
      )
      self._rows_multiple = packed_update.rows_multiple(cluster, self.role)
      self._packed_step = packed_update.PackedStep(
        cluster, self.role, "train_step", self._packed_loss, field="supervised.packing"
      )
    runtime = cluster.roles[self.role]
    shape = {"valid": (self.eval_rows,)}
    example = {
      k: np.zeros(shape.get(k, (self.eval_rows, sup.max_len)), dtype)
      for k, dtype in self.batch_dtypes.items()
    }
    self._eval = cluster.compile(
      "eval_step",
      functools.partial(type(self).eval_sums, config=self.model),
      in_shardings=(runtime.param_shardings, runtime.batch_shardings(example)),
      out_shardings=runtime.replicated,
      role=self.role,
    )

  def _bundled(self, cfg: ExperimentConfig) -> str:
    try:
      return data.bundled_path(cfg.data.task, self.data_kind)
    except ValueError as e:
      raise ConfigError(f"data.task: {e}") from None

  def packed_micro_batches(self, host: Batch) -> list[Batch]:
    """The packed micro-batches of a host batch (`packed_batches.right_padded_micro_batches`)."""
    return packed_batches.right_padded_micro_batches(
      host,
      self.sides,
      self.loss_masks,
      max_len=self.ctx.cfg.supervised.max_len,
      max_rows=self._max_rows,
      multiple=self._rows_multiple,
      pad_id=self.ctx.tokenizer.pad_id,
    )

  def iteration(self, iteration: int) -> dict[str, float]:
    """One optimizer update on the next training batch; its row is step `iteration + 1`."""
    cluster, sup = self.ctx.cluster, self.ctx.cfg.supervised
    step = iteration + 1
    host = next(self.train)
    start = time.perf_counter()
    batch = {k: host[k] for k in self.batch_dtypes}
    if sup.packing:
      update = self._packed_step
      micro = packed_update.upload(cluster, self.role, self.packed_micro_batches(host), "batch")
    else:
      update = self._step
      micro = cluster.upload(
        self.role, steps.split_micro_batches(batch, sup.micro_batches), "batch", leading=1
      )
    # Run in place, not dispatched: one role has nothing to overlap with.
    metrics = cluster.fetch(cluster.update_stage(self.role, update, micro).fn())
    elapsed = time.perf_counter() - start
    row: dict[str, float] = {"step": step}
    for key, value in metrics.items():
      row[key if "/" in key else f"train/{key}"] = float(value)
    row["train/learning_rate"] = float(self.schedule(iteration))
    row["time/step"] = elapsed
    devices = len(cluster.roles[self.role].devices)
    tokens = sum(int(np.sum(batch[k])) for k in self.token_masks)
    row["throughput/tokens_per_s_per_device"] = tokens / elapsed / devices
    return row

  def evaluate(self) -> dict[str, float]:
    """Metrics over the whole held-out split, exact however it is batched."""
    cluster = self.ctx.cluster
    totals: dict[str, float] = {}
    for batch in self.batches(self._held_out, batch_size=self.eval_rows, repeat=False):
      on_device = cluster.upload(self.role, {k: batch[k] for k in self.batch_dtypes}, "eval_batch")
      sums = cluster.fetch(self._eval(cluster.weights(self.role), on_device), "eval_sums")
      for key, value in sums.items():
        totals[key] = totals.get(key, 0.0) + float(value)
    count = totals.pop("count", 0.0)
    return {f"eval/{k}": v / max(count, 1.0) for k, v in totals.items()}

  def meta(self) -> dict[str, Any]:
    return {**super().meta(), "train_data": self.train.get_state()}

  def restore(self, items: dict[str, Any], meta: dict[str, Any]) -> None:
    super().restore(items, meta)
    self.train.set_state(meta["train_data"])
