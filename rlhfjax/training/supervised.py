"""The loop shared by SFT and reward-model training: one model on one training mesh.

A `SupervisedTrainer` places its model as PPO places a trained role (`RoleRuntime` on a
training-layout mesh, FSDP x tensor), builds the optimizer and the train step PPO uses
(`steps.accumulate_and_apply`, compiled once with explicit shardings and the state donated),
evaluates on the whole held-out split with a second compiled function, writes metrics, plots and
checkpoints, and resumes from the latest checkpoint of its workdir. Subclasses say what the
model predicts: the loss, the evaluation sums, the data and how a checkpoint initialises it.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import numpy as np
import optax
import tqdm

from rlhfjax import checkpoint as ckpt
from rlhfjax import export, launch, rerun, signals
from rlhfjax.cluster.role import RoleRuntime
from rlhfjax.config import ConfigError, RolloutSection, SupervisedConfig, from_config_dict
from rlhfjax.config.model import HeadKind, ModelConfig
from rlhfjax.data import jsonl
from rlhfjax.data import tokenizer as tokenizer_lib
from rlhfjax.data.chat_template import load_chat_template
from rlhfjax.observe import wandb_log
from rlhfjax.observe.compiles import TraceCounter
from rlhfjax.observe.metrics import MetricsWriter, plot_metric
from rlhfjax.placement import memory
from rlhfjax.placement.spec import Role, RoleSpec
from rlhfjax.placement.validate import PlacementError, resolve_num_devices
from rlhfjax.training import steps, weights
from rlhfjax.training.optimizer import learning_rate_schedule, make_optimizer
from rlhfjax.training.state import TrainState

Batch = dict[str, np.ndarray]


@dataclasses.dataclass
class TrainResult:
  """What a run did: its metric rows (train and eval merged per step), where it wrote them, the
  step it started from (0, or the checkpoint it resumed) and how often each function traced."""

  metrics: list[dict[str, float]]
  workdir: str
  start_step: int
  final_step: int
  compilations: dict[str, int]
  stopped: bool = False
  """SIGTERM or Ctrl-C stopped the run before `total_steps`, after writing a checkpoint."""

  def eval_rows(self) -> list[dict[str, float]]:
    return [row for row in self.metrics if any(k.startswith("eval/") for k in row)]


def role_spec(
  cfg: SupervisedConfig, model: ModelConfig, role: Role, head: HeadKind, available_devices: int
) -> RoleSpec:
  """The training mesh of the one trained model, checked like a PPO placement.

  Raises:
    PlacementError: too many devices, a tensor size that does not divide the devices or the
      heads, micro-batches that do not split over the batch shards, or a model that does not
      fit `memory_per_device_gb`.
  """
  placement = cfg.placement
  num_devices = resolve_num_devices(placement.num_devices, available_devices)
  rows = cfg.batch_size // cfg.micro_batches
  if placement.strategy == "auto":
    spec = _planned_spec(cfg, model, head, num_devices)
  else:
    spec = _manual_spec(placement, model, num_devices, rows)
  trained = Role.ACTOR if head == "lm" else Role.CRITIC
  if placement.memory_per_device_gb is not None:
    # Estimated as for PPO's trained role with the same head: parameters, moments, gradients,
    # and the activations and logits of one micro-batch of `max_len` tokens.
    shape = RolloutSection(batch_size=rows, max_prompt_len=cfg.max_len, max_new_tokens=1)
    need = memory.estimate_memory(trained, spec, model, shape, train_rows=rows).total
    budget = placement.memory_per_device_gb * memory.GIB
    if need > budget:
      raise PlacementError(
        f"{role} does not fit: needs {need / memory.GIB:.3g} GiB per device on {num_devices} "
        f"devices but the budget is {placement.memory_per_device_gb:.3g} GiB "
        "(placement.memory_per_device_gb)"
      )
  return spec


def _manual_spec(placement, model: ModelConfig, num_devices: int, rows: int) -> RoleSpec:
  data, tensor = placement.data, placement.tensor
  if num_devices % (data * tensor):
    raise PlacementError(
      f"placement.data x placement.tensor = {data} x {tensor} does not divide "
      f"placement.num_devices={num_devices}"
      if data > 1
      else f"placement.tensor={tensor} does not divide placement.num_devices={num_devices}"
    )
  for name in ("num_heads", "num_kv_heads"):
    if getattr(model, name) % tensor:
      raise PlacementError(
        f"placement.tensor={tensor} does not divide {name}={getattr(model, name)} of the model"
      )
  fsdp = num_devices // tensor // data
  shards = data * fsdp
  if rows % shards:
    raise PlacementError(
      f"a micro-batch of {rows} rows (batch_size / micro_batches) does not split over the "
      f"{'data x fsdp' if data > 1 else 'fsdp'}={shards} batch shards; make it a multiple of "
      f"{shards}"
    )
  return RoleSpec.training(range(num_devices), data=data, fsdp=fsdp, tensor=tensor)


def _planned_spec(cfg: SupervisedConfig, model: ModelConfig, head: HeadKind, n: int) -> RoleSpec:
  """`placement.strategy='auto'`: the planner's fastest split that fits; prints it and the
  runner-up."""
  from rlhfjax.planner import auto, single  # the planner is imported only when asked for

  hw, eff = auto.load_planner_inputs(cfg.placement)
  plans = single.plan(
    model,
    head,
    hw,
    eff,
    n,
    batch_size=cfg.batch_size,
    micro_batches=cfg.micro_batches,
    seq_len=cfg.max_len,
    options=memory.model_options(model),
  )
  if not plans:
    raise PlacementError(
      f"placement.strategy=auto: no data x fsdp x tensor split of {n} devices divides the "
      f"model's heads and a micro-batch of {cfg.batch_size // cfg.micro_batches} rows"
    )
  if not plans[0].fits:
    raise PlacementError(f"placement.strategy=auto: no split fits; closest: {plans[0].why_not}")
  print(single.describe([p for p in plans if p.fits]), flush=True)
  return plans[0].spec()


def split_micro_batches(batch: Batch, micro_batches: int) -> Batch:
  """`[b, ...]` host arrays to `[m, b / m, ...]`, the layout `accumulate_and_apply` scans."""
  return {k: v.reshape(micro_batches, -1, *v.shape[1:]) for k, v in batch.items()}


def compile_train_step(
  runtime: RoleRuntime,
  loss_fn: steps.LossFn,
  tx: optax.GradientTransformation,
  state_shardings: TrainState,
  example_batch: Batch,
  traces: TraceCounter | None = None,
) -> tuple[Any, Any]:
  """`accumulate_and_apply(loss_fn, tx)` jitted for `runtime`'s mesh, as PPO compiles its
  actor step: explicit state and batch shardings (rows over the batch axes, after the leading
  micro-batch axis of `example_batch`), metrics replicated, the state donated.

  Returns:
    The step `(state, batch) -> (state, metrics)` and the batch shardings to put batches in.
  """
  batch_shardings = runtime.batch_shardings(example_batch, leading=1)
  step = functools.partial(steps.accumulate_and_apply, loss_fn, tx)
  if traces is not None:
    step = traces.wrap("train_step", step)
  jitted = jax.jit(
    step,
    in_shardings=(state_shardings, batch_shardings),
    out_shardings=(state_shardings, runtime.replicated),
    donate_argnums=0,
  )
  return jitted, batch_shardings


class SupervisedTrainer(abc.ABC):
  """Trains one model on one mesh; subclasses define the task (see the module docstring)."""

  role: ClassVar[Role]
  head: ClassVar[HeadKind]
  name: ClassVar[str]
  """Short name for the progress bar and messages ('sft', 'rm')."""
  item: ClassVar[str]
  """Name of the trained state in the checkpoint (`rlhfjax.checkpoint` layout)."""
  plot_key: ClassVar[str]
  """The eval metric drawn in `WORKDIR/<plot_name>`."""
  plot_name: ClassVar[str]

  def __init__(self, cfg: SupervisedConfig, workdir: str, *, show_progress: bool = True):
    self.cfg, self.workdir, self.show_progress = cfg, workdir, show_progress
    self.model = cfg.model.for_role(self.role.value)
    self.spec = role_spec(cfg, self.model, self.role, self.head, len(jax.devices()))
    self.runtime = RoleRuntime.create(self.role, self.spec, self.model, self.head)
    self.tokenizer = tokenizer_lib.load_tokenizer(cfg.data.tokenizer)
    if self.tokenizer.vocab_size > self.model.vocab_size:
      raise ConfigError(
        f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocabulary "
        f"only {self.model.vocab_size}"
      )
    self.eval_rows = cfg.batch_size // cfg.micro_batches
    """Rows of an eval batch: one micro-batch, so evaluation never needs more activations."""
    self.tx = make_optimizer(cfg.optimizer, cfg.total_steps)
    self.schedule = learning_rate_schedule(cfg.optimizer, cfg.total_steps)
    self.traces = TraceCounter()
    self.dataset = jsonl.prepare(
      self.data_kind,
      self.data_path(),
      cfg.data.data_dir or os.path.join(workdir, "data"),
      on_bad_record=cfg.data.on_bad_record,
    )
    self.train_batches = self.batches(cfg.data.train_split, train=True)
    self.checkpointer = ckpt.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint)
    self.state, self.state_shardings = self._initial_state()
    self.start_step = self._maybe_resume()
    self._compile()

  # -------------------------------------------------------------------------------------------
  # What a subclass provides.

  data_kind: ClassVar[str]
  """The `rlhfjax.data.jsonl` record kind ('demonstration', 'preference')."""
  batch_keys: ClassVar[tuple[str, ...]]
  """The batch arrays the loss reads (the pipelines may produce more)."""

  @abc.abstractmethod
  def data_file(self) -> str:
    """The JSONL file the config names; empty: the task's bundled one."""

  def data_path(self) -> str:
    if self.data_file():
      return self.data_file()
    try:
      return jsonl.bundled_path(self.cfg.data.task, self.data_kind)
    except ValueError as e:
      raise ConfigError(f"data.task: {e}") from None

  batch_pipeline: ClassVar[Callable[..., Iterator[Batch]]]
  """The `rlhfjax.data.pipeline` batch function for `data_kind` (a staticmethod)."""

  def batches(self, split: str, *, train: bool) -> Iterator[Batch]:
    """Host batches of `split`: endless and shuffled when `train`, else one padded pass."""
    cfg = self.cfg
    return self.batch_pipeline(
      self.dataset.source(split),
      self.tokenizer,
      batch_size=cfg.batch_size if train else self.eval_rows,
      max_len=cfg.max_len,
      seed=cfg.seed,
      repeat=train,
      on_long_prompt=cfg.data.on_long_prompt,
      chat_template=load_chat_template(cfg.data.tokenizer) if cfg.data.chat_template else None,
    )

  @abc.abstractmethod
  def loss_fn(self, params: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss of one micro-batch and its metrics."""

  @abc.abstractmethod
  def eval_sums(self, params: Any, batch: Batch) -> dict[str, jax.Array]:
    """Sums over one eval batch, including 'count' (what every other sum is divided by), so
    that the eval metrics are exact averages over the split however it is batched."""

  @abc.abstractmethod
  def tokens_per_batch(self, batch: Batch) -> int:
    """Real tokens of a host batch, for throughput."""

  @abc.abstractmethod
  def example_batch(self, rows: int) -> Batch:
    """A zero host batch of `rows` rows with the keys, shapes and dtypes of the real ones."""

  init_items: ClassVar[tuple[str, ...]]
  """Checkpoint items `init.checkpoint` may start from, in order of preference."""

  def init_params(self, rng: jax.Array) -> Any:
    """First parameters, in the role's shards: random, or from `cfg.init` (a policy's trunk
    starts a value model with a zero value head, see `rlhfjax.training.weights`)."""
    init = self.cfg.init
    rt = self.runtime
    hf = self.cfg.model.hf_for(self.role.value)
    if not (init.hf_checkpoint or init.checkpoint) and hf:
      source, what = hf, "model.hf"  # a model given as a checkpoint starts from its weights
    elif init.hf_checkpoint:
      source, what = init.hf_checkpoint, "init.hf_checkpoint"
    else:
      source, what = init.checkpoint, "init.checkpoint"
    return weights.load_params(
      source,
      model=self.model,
      head=self.head,
      mesh=rt.mesh,
      layout=rt.spec.layout,
      shardings=rt.param_shardings,
      rng=rng,
      items=self.init_items,
      what=what,
    )

  # -------------------------------------------------------------------------------------------
  # Set-up.

  def _initial_state(self) -> tuple[TrainState, TrainState]:
    return self.runtime.train_state(self.init_params(jax.random.key(self.cfg.seed)), self.tx)

  def _maybe_resume(self) -> int:
    """Restores the latest complete checkpoint of the workdir, if any, and returns its step."""
    if not self.cfg.checkpoint.resume:
      return 0
    step = self.checkpointer.latest_step()
    if step is None:
      return 0
    abstract = weights.abstract_with_shardings(self.state, self.state_shardings)
    items, meta = self.checkpointer.restore(step, {self.item: abstract})
    self.state = items[self.item]
    if "data" in meta:
      self.train_batches.set_state(meta["data"])
    return int(step)

  def _compile(self) -> None:
    """The train and eval steps, jitted once with the shardings of this role's mesh."""
    example = split_micro_batches(self.example_batch(self.cfg.batch_size), self.cfg.micro_batches)
    self._train_step, self.train_batch_shardings = compile_train_step(
      self.runtime, self.loss_fn, self.tx, self.state_shardings, example, self.traces
    )
    self.eval_batch_shardings = self.runtime.batch_shardings(self.example_batch(self.eval_rows))
    self._eval_step = jax.jit(
      self.traces.wrap("eval_step", self.eval_sums),
      in_shardings=(self.runtime.param_shardings, self.eval_batch_shardings),
      out_shardings=self.runtime.replicated,
    )

  # -------------------------------------------------------------------------------------------
  # Running.

  def evaluate(self) -> dict[str, float]:
    """Metrics over the whole held-out split, exact however it is batched."""
    totals: dict[str, float] = {}
    for batch in self.batches(self.cfg.data.eval_split, train=False):
      sums = jax.device_get(self._eval_step(self.state.params, self._put_eval(batch)))
      for key, value in sums.items():
        totals[key] = totals.get(key, 0.0) + float(value)
    count = totals.pop("count", 0.0)
    return {f"eval/{k}": v / max(count, 1.0) for k, v in totals.items()}

  def _put_eval(self, batch: Batch) -> Any:
    return jax.device_put({k: batch[k] for k in self.batch_keys}, self.eval_batch_shardings)

  def _should_eval(self, step: int) -> bool:
    every = self.cfg.eval_every
    return step == self.cfg.total_steps or (every > 0 and step % every == 0)

  def run(self) -> TrainResult:
    cfg = self.cfg
    os.makedirs(self.workdir, exist_ok=True)
    primary = jax.process_index() == 0
    if primary:
      rerun.clear(self.workdir)
    # The row of step s is written before the checkpoint of step s: a run resumed from it
    # keeps rows 1..s and redoes only later ones; a fresh run redoes the evaluation of step 0.
    first_new = self.start_step + 1 if self.start_step else 0
    writer = MetricsWriter(
      self.workdir,
      enabled=primary,
      start_step=first_new,
      wandb=wandb_log.for_run(cfg, self.workdir, enabled=primary),
    )
    rows: list[dict[str, float]] = []
    step = self.start_step
    stop = signals.StopRequest(what=f"{self.name} run").__enter__()
    try:
      if step == 0:
        row = {"step": 0, **self.evaluate()}
        rows.append(row)
        writer.write(0, _drop_step(row))
      bar = tqdm.tqdm(
        range(step, cfg.total_steps),
        desc=self.name,
        disable=not self.show_progress,
        dynamic_ncols=True,
        initial=step,
        total=cfg.total_steps,
      )
      for step in (s + 1 for s in bar):
        row = self._train_one(step, next(self.train_batches))
        if self._should_eval(step):
          start = time.perf_counter()
          row.update(self.evaluate())
          row["time/eval"] = time.perf_counter() - start
        if step % cfg.log_every == 0 or step == cfg.total_steps or "eval/loss" in row:
          rows.append(row)
          writer.write(step, _drop_step(row))
        bar.set_postfix(loss=f"{row['train/loss']:.3f}")
        self._save(step)
        if stop.is_set():
          break
      if step > self.start_step:
        self._save(step, force=True)
      self.checkpointer.wait()
    finally:
      stop.__exit__()
      writer.close()
      self.checkpointer.close()
    stopped = stop.is_set() and step < cfg.total_steps
    if primary:
      self._write_plots()
      if not stopped:
        rerun.mark_finished(self.workdir, step)
    return TrainResult(
      metrics=rows,
      workdir=self.workdir,
      start_step=self.start_step,
      final_step=step,
      compilations=self.traces.counts,
      stopped=stopped,
    )

  def _train_one(self, step: int, batch: Batch) -> dict[str, float]:
    start = time.perf_counter()
    batch = {k: batch[k] for k in self.batch_keys}
    micro = jax.device_put(
      split_micro_batches(batch, self.cfg.micro_batches), self.train_batch_shardings
    )
    self.state, metrics = self._train_step(self.state, micro)
    metrics = jax.device_get(metrics)
    elapsed = time.perf_counter() - start
    row = {"step": step}
    for key, value in metrics.items():
      row[key if "/" in key else f"train/{key}"] = float(value)
    row["train/learning_rate"] = float(self.schedule(step - 1))
    row["time/step"] = elapsed
    row["throughput/tokens_per_s_per_device"] = (
      self.tokens_per_batch(batch) / elapsed / len(self.spec.devices)
    )
    return row

  def _save(self, step: int, *, force: bool = False) -> None:
    meta = {"data": self.train_batches.get_state(), "trainer": self.name, "step": step}
    data = self.cfg.data
    meta |= export.policy_meta(self.item, self.head, self.model, data.tokenizer, data.chat_template)
    self.checkpointer.save(step, {self.item: self.state}, meta=meta, force=force)

  def _write_plots(self) -> None:
    path = os.path.join(self.workdir, "metrics.jsonl")
    if not os.path.exists(path):
      return
    rows = MetricsWriter.read(path)
    plot_metric(rows, "train/loss", os.path.join(self.workdir, "loss.png"), "training loss")
    plot_metric(
      rows, self.plot_key, os.path.join(self.workdir, self.plot_name), f"held-out {self.plot_key}"
    )


def _drop_step(row: Mapping[str, float]) -> dict[str, float]:
  return {k: v for k, v in row.items() if k != "step"}


def run_script(
  trainer_cls: type[SupervisedTrainer], config_cls: type[SupervisedConfig], config_dict, workdir
) -> None:
  """The body of `scripts/train_sft.py` and `scripts/train_rm.py`: `workdir` is made absolute
  and locked (`launch.open_run`); bad config or data is one `error:` line; a finished run says
  so and changes nothing; the run ends by printing the first and last held-out `plot_key` of
  the whole run (its earlier, interrupted parts too)."""
  workdir = launch.open_run(config_dict, workdir)
  try:
    cfg = from_config_dict(config_dict, config_cls)
    if cfg.checkpoint.resume and rerun.is_finished(workdir, cfg.total_steps):
      print(rerun.finished_line(workdir))
      return
    trainer = trainer_cls(cfg, workdir)
  except ValueError as error:  # ConfigError, PlacementError, DataError, CheckpointError
    launch.fail(error)
  result = trainer.run()
  key = trainer_cls.plot_key
  path = os.path.join(result.workdir, "metrics.jsonl")
  evals = [row for row in MetricsWriter.read(path) if key in row] if os.path.exists(path) else []
  first_last = " -> ".join(f"{row[key]:.3f}" for row in (evals[0], evals[-1])) if evals else "-"
  print(
    f"{key} {first_last}; steps {result.start_step} -> {result.final_step}; "
    f"outputs in {result.workdir}"
  )
  if result.stopped:
    print("stopped: checkpoint written; rerun the same command to resume")
