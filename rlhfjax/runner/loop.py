"""The loop that runs any flow: checkpoints, resume, SIGTERM, evaluation, metrics, plots.

The runner knows nothing of any algorithm. It builds the cluster of the config's placement,
the rewards and the prompt stream, asks the flow named by `algorithm` (`rlhfjax.flows`) to
declare its roles and compile its programs, materializes the weights (fresh, or restored from
the latest complete checkpoint onto whatever placement the config now names), then calls
`flow.iteration(i)` and writes each returned row with the stage times of the timeline. A flow
on its own dataset (SFT, the reward model: `rlhfjax.flows.registry`) gets no prompt stream and
no rewards, and reports its own held-out metrics, recorded at step 0, every `eval.every_steps`
steps and after the last.

Checkpoints (`rlhfjax.checkpoint`) hold the trained roles' states, the flow's own items and
JSON state, and the prompt iterator's state; every random choice is a function of (`seed`,
iteration), so a resumed run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import threading
import time
from typing import Any

import jax
import tqdm

from rlhfjax import checkpoint as ckpt
from rlhfjax import data, distributed, export, rerun, signals
from rlhfjax.cluster.cluster import HEADS, Cluster
from rlhfjax.cluster.rewards import Rewards
from rlhfjax.config import ConfigError, ExperimentConfig
from rlhfjax.data.chat_template import data_template
from rlhfjax.data.records import PromptBatch
from rlhfjax.flows import registry
from rlhfjax.flows.stages import FlowContext
from rlhfjax.observe import wandb_log
from rlhfjax.observe.metrics import MetricsWriter, plot_metric
from rlhfjax.observe.timeline import Timeline, plot_gantt
from rlhfjax.placement.spec import PlacementSpec, Role, ordered
from rlhfjax.planner.place import place, sized
from rlhfjax.runner import evaluation as evaluation_lib
from rlhfjax.runner import identity as identity_lib
from rlhfjax.runner import machines
from rlhfjax.training import weights

_STAGES = ("generate", "score", "advantages", "update", "sync")
_SHOWN = ("reward/mean", "kl/mean", "loss/policy", "train/loss")
"""Metrics the progress bar shows, those a flow reports."""
_PLOTS = (("reward/mean", "reward.png", "mean reward per iteration"),)
"""(metric, file, title) of the curves drawn for a flow that names none (`flow.plots`)."""


@dataclasses.dataclass
class RunResult:
  metrics: list[dict[str, float]]
  """The rows of the iterations this run executed (a resumed run: from its first step on)."""
  workdir: str
  compilations: dict[str, int]
  start_step: int = 0
  """The iteration this run started at: > 0 when it resumed from a checkpoint."""
  final_step: int = 0
  """The iterations done when it ended (`total_steps`, or fewer when stopped)."""
  preempted: bool = False
  """SIGTERM stopped the run early, after writing a checkpoint."""
  evaluation: dict[str, Any] = dataclasses.field(default_factory=dict)
  """'before' and 'after' evaluations (see `rlhfjax.runner.evaluation`), when they ran."""


class _FirstPromptShown:
  """The prompt stream as the flow takes it, printing (process 0, once) the first prompt it
  hands out as the model receives it: its text with the template's special tokens, and its
  ids. Everything else is the stream's own (`get_state`, ...)."""

  _SHOWN_IDS = 32

  def __init__(self, prompts: data.PromptIterator, tokenizer: Any, show: bool):
    self._prompts, self._tokenizer = prompts, tokenizer
    self._show = show and distributed.is_primary()

  def take_batch(self, n: int, **kwargs: Any) -> PromptBatch:
    batch = self._prompts.take_batch(n, **kwargs)
    if self._show and batch.tokens:
      self._show = False
      ids = list(batch.tokens[0])
      text = self._tokenizer.decode(ids, skip_special_tokens=False)
      more = f", ... ({len(ids)} in all)" if len(ids) > self._SHOWN_IDS else ""
      shown = ", ".join(map(str, ids[: self._SHOWN_IDS]))
      # Above the progress bar, which is open by now.
      tqdm.tqdm.write(f"the first prompt as the model receives it: {text!r}; ids [{shown}{more}]")
    return batch

  def __getattr__(self, name: str) -> Any:
    return getattr(self._prompts, name)


class TooManySkippedUpdates(RuntimeError):
  """Updates were skipped for non-finite losses or gradients `ppo.max_skipped_updates` times
  in a row: the run stops rather than burn compute on a diverged model."""


class Runner:
  """Builds the cluster and the flow from an `ExperimentConfig` and runs its iterations."""

  def __init__(self, cfg: ExperimentConfig, workdir: str, *, show_progress: bool = True):
    cfg = registry.configure(cfg)
    self.cfg, self.workdir, self.show_progress = cfg, workdir, show_progress
    factory = registry.resolve(cfg)
    self.placement: PlacementSpec = place(cfg, len(jax.devices()))
    cfg, pool = sized(cfg, self.placement)
    self.cfg = cfg
    if pool is not None and distributed.is_primary():
      print(pool.describe(), flush=True)
    distributed.check_placement(self.placement)
    machines.warn_tensor_across_hosts(self.placement)
    self.prediction = None
    """With `placement.strategy=auto`, the planner's prediction, drawn beside the timeline."""
    if cfg.placement.strategy == "auto" and len(self.placement.roles) > 1:
      from rlhfjax.planner import auto

      self.prediction = auto.predicted_plan(cfg, self.placement)
    self.tokenizer = data.load_tokenizer(cfg.data.tokenizer)
    vocab = min(cfg.model.for_role(role).vocab_size for role in self.placement.roles)
    if self.tokenizer.vocab_size > vocab:
      raise ConfigError(
        f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocabulary "
        f"only {vocab}"
      )
    self.template = data_template(cfg.data)
    self.prompts: data.PromptIterator | None = None
    """The prompt stream; None for a flow that reads its own dataset (SFT, reward model)."""
    self.eval_prompts = PromptBatch.of([])
    if registry.reads_prompts(cfg):
      self.prompts, self.eval_prompts = self._load_prompts()
    self.cluster = Cluster(cfg, self.placement)
    self.timeline, self.traces = self.cluster.timeline, self.cluster.traces
    self.ctx = FlowContext(
      cfg=cfg,
      cluster=self.cluster,
      # A flow on its own dataset (SFT, reward model) scores no samples.
      rewards=Rewards(cfg, self.cluster, self.tokenizer) if self.prompts is not None else None,
      tokenizer=self.tokenizer,
      prompts=_FirstPromptShown(self.prompts, self.tokenizer, show_progress)
      if self.prompts is not None
      else None,
      workdir=workdir,
    )
    self.flow = factory(self.ctx)
    if not self.cluster.uses(Role.ROLLOUT):
      # The held-out evaluation samples responses: a flow without a rollout (offline DPO, SFT)
      # reports its own held-out metrics.
      self.eval_prompts = PromptBatch.of([])
    self.own_evaluation = getattr(self.flow, "evaluate", None)
    """The flow's own held-out metrics (`rlhfjax.flows.registry`), if it has them."""
    self.step_base = 1 if getattr(self.flow, "steps_from_one", False) else 0
    """The step the row of iteration 0 is logged at."""
    # The extra roles (`model.extra_roles`) too: another reward model is another run.
    roles = [str(role) for role in ordered(self.cluster.roles) if self.cluster.uses(role)]
    self.identity = identity_lib.identity(cfg, roles, self.tokenizer, self.template)
    """What this run's checkpoints mean (`rlhfjax.runner.identity`): fixed once the flow has
    declared its roles."""
    self.checkpointer = ckpt.Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint)
    resume_step = self.checkpointer.latest_step() if cfg.checkpoint.resume else None
    self.start_step = 0 if resume_step is None else resume_step
    if resume_step is None:
      self.cluster.materialize()
    else:
      self._restore(resume_step)
      self._continue_timeline(resume_step)
      if show_progress:  # every entry that resumes says so: train.py, each pipeline stage
        print(f"resuming from the checkpoint of step {resume_step} in {workdir}", flush=True)

  def _load_prompts(self) -> tuple[data.PromptIterator, PromptBatch]:
    """The endless, shuffled training prompts and the first `eval.num_prompts` held-out ones,
    each with its record (the prompt line's extra fields, named 'file:line')."""
    cfg = self.cfg
    d = cfg.data
    dataset = distributed.primary_first(
      lambda: data.prepare(
        "prompt",
        d.prompts or data.bundled_path(d.task, "prompt"),
        d.data_dir or os.path.join(self.workdir, "data"),
        on_bad_record=d.on_bad_record,
      )
    )
    template = self.template
    stream = functools.partial(
      data.prompt_iterator,
      tokenizer=self.tokenizer,
      max_prompt_len=cfg.rollout.max_prompt_len,
      seed=cfg.seed,
      on_long_prompt=d.on_long_prompt,
      chat_template=template,
    )
    train = stream(dataset.source(d.train_split), origin=dataset.path(d.train_split))
    eval_prompts = PromptBatch.of([])
    if cfg.eval.num_prompts:
      held_out = stream(
        dataset.source(d.eval_split), repeat=False, origin=dataset.path(d.eval_split)
      )
      eval_prompts = held_out.take_batch(cfg.eval.num_prompts, allow_fewer=True)
    return train, eval_prompts

  # -------------------------------------------------------------------------------------------
  # Checkpoints.

  def _restore(self, step: int) -> None:
    """Reads checkpoint `step` straight into this placement's shards (which may differ from
    the placement that saved it) and the loop's and the flow's state from its meta."""
    abstract = {**self.cluster.abstract_states(), **self.flow.abstract_items()}
    items, meta = self.checkpointer.restore(
      step, abstract, lambda meta, where: identity_lib.check(meta, self.identity, where)
    )
    if meta.get("seed") != self.cfg.seed:
      raise ckpt.CheckpointError(
        f"{self.checkpointer.directory / str(step)} was written with seed {meta.get('seed')}, "
        f"the config says {self.cfg.seed}: resume with the same seed or another workdir"
      )
    self.cluster.materialize(restored=items)
    if self.prompts is not None:
      self.prompts.set_state(meta["data"])
    self.flow.restore(items, meta)

  def _continue_timeline(self, step: int) -> None:
    """The timeline continues the interrupted run's: its records of the iterations before
    `step` (those the checkpoint holds; `_save` wrote them first) are kept."""
    path = os.path.join(self.workdir, "timeline.json")
    if distributed.is_primary() and os.path.exists(path):
      kept = [r for r in Timeline.read_json(path) if r.iteration < step]
      self.timeline.continue_from(kept)

  def _checkpoint_meta(self, step: int) -> dict[str, Any]:
    # What `export` rebuilds: the first trained role (the actor, or the one model trained).
    exported = (self.cluster.trained or (Role.ACTOR,))[0]
    meta = {
      identity_lib.KEY: self.identity,
      "step": step,
      # Every random choice derives from (seed, iteration): this is the whole RNG state.
      "seed": self.cfg.seed,
      "placement": self.placement.strategy,
      **self.flow.meta(),
      **weights.adapters_meta(
        {
          role.value: weights.SavedAdapters.of(model, self.cluster.weight_source(role))
          for role in self.cluster.trained
          if (model := self.cluster.roles[role].model).lora is not None
        }
      ),
      **export.policy_meta(
        exported.value,
        HEADS[exported],
        self.cfg.model.for_role(exported.value),
        self.cfg.data.tokenizer,
        self.cfg.data.chat_template,
        base=getattr(self.cluster.weight_source(exported), "source", ""),
      ),
    }
    if self.prompts is not None:
      meta["data"] = self.prompts.get_state()
    return meta

  def _save(self, step: int, *, force: bool = False) -> bool:
    """Checkpoint after `step` iterations (on the schedule, or always with `force`), and
    before it the timeline of those iterations, which a run resumed from it continues."""
    if not self.checkpointer.due(step, force=force):
      return False
    if distributed.is_primary() and self.timeline.records:
      self.timeline.write_json(os.path.join(self.workdir, "timeline.json"), before=step)
    with self.cluster.resident():  # `save` returns once the arrays are copied
      items = self.cluster.checkpoint_states()
      items.update(self.flow.checkpoint_items())
      return self.checkpointer.save(step, items, self._checkpoint_meta(step), force=force)

  # -------------------------------------------------------------------------------------------
  # The loop.

  def evaluate(self) -> dict[str, Any]:
    with self.cluster.resident():
      return evaluation_lib.evaluate(self.ctx, self.eval_prompts)

  def _stage_times(self, iteration: int) -> dict[str, float]:
    records = self.timeline.for_iteration(iteration)
    times = {}
    for stage in _STAGES:
      rs = [r for r in records if r.stage == stage]
      times[f"time/{stage}"] = (max(r.end for r in rs) - min(r.start for r in rs)) if rs else 0.0
    return times

  def iterate(self, iteration: int) -> dict[str, float]:
    """One iteration outside `run` (a benchmark alternating runners): its metrics row with
    the stage times; nothing written."""
    return self._iteration(iteration)

  def _iteration(self, iteration: int) -> dict[str, float]:
    row = self.flow.iteration(iteration)
    self.cluster.park()  # offloaded state waits in host memory until its next stage
    if self.timeline.for_iteration(iteration):  # a flow of one role dispatches no stages
      row.update(self._stage_times(iteration))
    if self.prompts is not None:
      row.update({f"data/{k}": float(v) for k, v in self.prompts.stats.items()})
    return row

  def _periodic_evaluation(self, iteration: int) -> dict[str, float]:
    """`eval/*` metrics after every `eval.every_steps`-th iteration but the last (the final
    evaluation follows it; a flow's own held-out metrics go into the last row too). Tied to
    the iteration, so a resumed run neither repeats nor skips one; the evaluation's fixed seed
    makes it the uninterrupted run's."""
    every, done = self.cfg.eval.every_steps, iteration + 1
    if self.own_evaluation is not None:
      if done != self.cfg.total_steps and not (every and done % every == 0):
        return {}
      start = time.perf_counter()
      return {**self.own_evaluation(), "time/eval": time.perf_counter() - start}
    if not (every and self.eval_prompts) or done % every or done == self.cfg.total_steps:
      return {}
    result = self.evaluate()
    return {f"eval/{k}": float(v) for k, v in result.items() if isinstance(v, float)}

  def run(self) -> RunResult:
    """Runs the iterations from `start_step` to `total_steps`, with an evaluation before the
    first (of a fresh run) and after the last. SIGTERM stops it after the current iteration
    with a checkpoint."""
    cfg = self.cfg
    os.makedirs(self.workdir, exist_ok=True)
    primary = distributed.is_primary()
    if primary:
      rerun.clear(self.workdir)
    # A resumed run keeps the rows of the iterations its checkpoint holds and redoes the rest.
    writer = MetricsWriter(
      self.workdir,
      enabled=primary,
      start_step=self.start_step + self.step_base if self.start_step else 0,
      wandb=wandb_log.for_run(cfg, self.workdir, enabled=primary),
    )
    evaluation = evaluation_lib.read_evaluation(self.workdir, self.start_step)
    if self.start_step == 0 and self.eval_prompts:
      evaluation = {"before": self.evaluate()}
      evaluation_lib.write_evaluation(self.workdir, evaluation)
    rows: list[dict[str, float]] = []
    if self.start_step == 0 and self.own_evaluation is not None:
      rows.append({"step": 0, **self.own_evaluation()})
      writer.write(0, {k: v for k, v in rows[-1].items() if k != "step"})
    preempted = threading.Event()
    restore_handler = signals.on_stop(preempted.set, f"{self.cfg.algorithm.name} run")
    bar = tqdm.tqdm(
      range(self.start_step, cfg.total_steps),
      desc=self.cfg.algorithm.flow or self.cfg.algorithm.name,
      initial=self.start_step,
      total=cfg.total_steps,
      disable=not (self.show_progress and primary),
      dynamic_ncols=True,
    )
    done = self.start_step
    try:
      for iteration in bar:
        row = self._iteration(iteration)
        periodic = self._periodic_evaluation(iteration)
        row.update(periodic)
        rows.append(row)
        step = iteration + self.step_base
        if periodic or step % cfg.log_every == 0 or iteration == cfg.total_steps - 1:
          writer.write(step, {k: v for k, v in row.items() if k != "step"})
        bar.set_postfix({k: f"{row[k]:.3f}" for k in _SHOWN if k in row})
        self._check_skipped(iteration, row)
        done = iteration + 1
        # Every process of a job stops after the same iteration, whichever was asked to.
        asked = distributed.flagged(preempted.is_set(), "stop")
        if asked and not preempted.is_set():
          preempted.set()
          if primary:
            tqdm.tqdm.write(
              f"stopping the {cfg.algorithm.name} run after this iteration with a checkpoint: "
              f"process {asked[0]} was asked to stop", file=sys.stderr,
            )  # fmt: skip
        if preempted.is_set():
          self._save(done, force=True)
          break
        self._save(done, force=done == cfg.total_steps)
    finally:
      restore_handler()
      self.flow.close()
      writer.close()
      self.checkpointer.wait()
    stopped_early = preempted.is_set() and done < cfg.total_steps
    if not stopped_early and self.eval_prompts and "after" not in evaluation:
      evaluation["after"] = self.evaluate()
      evaluation_lib.write_evaluation(self.workdir, evaluation)
    if primary:
      self._write_outputs(writer.rows())
      # How often each program was traced (compiled) by name: the packed programs once per
      # row-count bucket (`rlhfjax.data.packing.row_buckets`), every other one once.
      with open(os.path.join(self.workdir, "compilations.json"), "w") as f:
        json.dump(dict(sorted(self.traces.counts.items())), f, indent=1)
      if not stopped_early:
        rerun.mark_finished(self.workdir, max(self.start_step, cfg.total_steps))
    self.checkpointer.close()
    return RunResult(
      metrics=rows,
      workdir=self.workdir,
      compilations=self.traces.counts,
      start_step=self.start_step,
      final_step=done,
      preempted=stopped_early,
      evaluation=evaluation,
    )

  def _check_skipped(self, iteration: int, row: dict[str, float]) -> None:
    """Too many updates in a row skipped for non-finite values stop the run."""
    limit = self.cfg.ppo.max_skipped_updates
    skipped_in_row = int(row.get("update/skipped_in_row", 0))
    if skipped_in_row >= limit:
      raise TooManySkippedUpdates(
        f"stopped at iteration {iteration}: the last {skipped_in_row} updates had a "
        "non-finite "
        f"loss or gradients and were skipped (ppo.max_skipped_updates={limit}); the weights "
        f"are those of the last finite update. Check the rewards and the learning rates."
      )

  def _write_outputs(self, rows: list[dict[str, float]]) -> None:
    """Timeline (this run's iterations) and the flow's curves (every row of metrics.jsonl, so
    a resumed run plots the whole run)."""
    for key, name, title in getattr(self.flow, "plots", _PLOTS):
      plot_metric(rows, key, os.path.join(self.workdir, name), title=title)
    if not self.timeline.records:
      return
    self.timeline.write_json(os.path.join(self.workdir, "timeline.json"))
    newest = max((r.iteration for r in self.timeline.records), default=0)
    last = [r for r in self.timeline.records if r.iteration > newest - 3]
    title = f"{self.placement.strategy}: last iterations"
    if self.prediction is None:
      plot_gantt(last, os.path.join(self.workdir, "timeline.png"), title=title)
    else:  # predicted and measured, two panels on one time axis
      from rlhfjax.planner.report import write_beside

      write_beside(self.prediction, last, self.workdir, title)
