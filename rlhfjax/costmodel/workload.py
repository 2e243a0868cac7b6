"""The workload of one RLHF iteration: per-role model shapes, batch shape, the flow's pricing,
dtypes.

A role's model is a registered size name (`rlhfjax.config.model`) or the path of a Hugging
Face `config.json` (or of the checkpoint directory holding it). Critic and reward may be absent
(`none`): GRPO is critic-free, and a rule reward needs no reward model; absent roles get no
devices and no memory in any plan. Which stages run on how many sequences is the flow's
`Pricing` (`rlhfjax.costmodel.pricing`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from rlhfjax import schedules
from rlhfjax.config import OffloadSection
from rlhfjax.config.model import ModelConfig, get_model_config, model_sizes
from rlhfjax.costmodel import fill
from rlhfjax.costmodel.costs import ONE_ANSWER, Conversation
from rlhfjax.costmodel.pricing import PPO, Pricing

REMAT_POLICIES = ("none", "dots_saveable", "full")
OFFLOAD_ALL = OffloadSection(params=("reference", "reward"), optimizer=("actor", "critic"))
"""Every part offload can park: the frozen roles' parameters and the trained roles' moments."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeEngine:
  """A generative judge's engine (`rlhfjax.cluster.judge`; `ExtraRoleSection.judge_engine`)."""

  slots: int
  """Decode slots over all its replicas (rounded up to a multiple of them where it is placed)."""
  capacity: int
  """Prompt tokens its pool holds per slot (the filled template)."""
  verdict: int
  """Tokens it generates per verdict (greedy, priced whole)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """One iteration: `prompts` x `samples_per_prompt` rollouts, scored, then trained on."""

  actor: ModelConfig
  critic: ModelConfig | None = None
  reward: ModelConfig | None = None
  reference: ModelConfig | None = None
  """Defaults to the actor's shape."""
  extra_rewards: Mapping[str, ModelConfig] = dataclasses.field(default_factory=dict)
  """Extra reward models by role name (`model.extra_roles` of kind 'reward', and a judge):
  each scores the sequences the reward model scores (`scored('reward')`), a forward like the
  reward's, or, for a judge (`judges`), generation of its verdicts."""
  judges: Mapping[str, JudgeEngine] = dataclasses.field(default_factory=dict)
  """Of `extra_rewards`, the generative judges and their engines: each prefills the judged
  text (prompt and response, at most its `capacity`) and decodes `verdict` tokens for every
  sequence it scores, and holds its engine's KV pool."""
  reference_from_base: bool = False
  """The reference scores with the actor's frozen base weights on the actor's devices (an actor
  that trains LoRA adapters): placed as the actor, with no weights of its own."""
  pricing: Pricing = PPO
  """The flow's stages: who generates, scores and trains, on how many sequences."""
  prompts: int = 1024
  samples_per_prompt: int = 1
  prompt_len: int = 1024
  prompt_len_mean: float = 0
  """Real prompt tokens on average; 0: every prompt is `prompt_len` long. An engine that pads
  (`padded`) computes on `prompt_len` whatever the real length."""
  response_len_mean: float = 512
  response_len_max: int = 1024
  conversation: Conversation = ONE_ANSWER
  """Multi-turn rollouts (an environment answering each turn): turns, the environment's
  tokens (counted in the response's lengths), its step's seconds and workers; default one
  answer per prompt."""
  ppo_epochs: int = 1
  optimizer_steps: int = 1
  """Optimizer updates per epoch (mini-batches)."""
  micro_batch: int = 0
  """Sequences per device per micro-step of training and scoring; 0: the planner chooses."""
  train_rows: int = 0
  """Sequences per micro-step over a trained role's whole group, as a config fixes it; 0: the
  per-device `micro_batch` (or the planner's choice) decides."""
  generation_batch: int = 0
  """Most sequences one rollout data group decodes at once (the engine's generation batch);
  0: as many as memory allows."""
  kv_memory_fraction: float = 0.0
  """The share of a rollout device's memory generation may fill, its KV cache included
  (rlhfjax's `rollout.kv_memory_fraction`): generation runs in waves of fewer slots until it
  fits, and a placement where one slot does not is over memory; 0: all of it."""
  decode_gathers_weights: bool = False
  """Generation runs on the training layout (ZeRO-3 partitioned weights, as DeepSpeed-Chat's
  hybrid engine with ZeRO-3): every decode step all-gathers every layer's weights."""
  static_batching: bool = True
  """Generation lasts as long as its longest sample (no continuous batching)."""
  padded: bool = True
  """Scoring and training run on sequences padded to `prompt_len + response_len_max` (as
  DeepSpeed-Chat, and rlhfjax with `ppo.packing=False`, do); False: on their real lengths
  (`mean_tokens` per sequence), ideally (every computed token real, as the published OpenRLHF
  cases assume) or, with `packed`, packed into rows with the packing's fill loss. Memory is
  planned for rows of the padded length either way."""
  packed: bool = False
  """The engine packs (rlhfjax's `ppo.packing`; needs `padded=False`): scoring and training run
  on rows of `seq_len` tokens holding several sequences each, best-fit decreasing, in
  micro-batches of a token budget (`train_tokens`, `score_tokens`); a stage computes its real
  tokens over the packing's fill (`rlhfjax.costmodel.fill`)."""
  train_tokens: int = 0
  """With `packed`: tokens per micro-step over a trained role's group (rows x `seq_len`; rlhfjax's
  `ppo.max_tokens_per_micro_batch`); 0: the padded micro-batch's rows x `seq_len`."""
  score_tokens: int = 0
  """With `packed`: tokens per scoring call over a role's group (rlhfjax's
  `rollout.max_tokens_per_score_batch`); 0: the padded scoring micro-batch's rows x `seq_len`."""
  remat: str = "none"
  """Rematerialisation of the train step: 'none', 'dots_saveable' or 'full'."""
  logits_chunk: int = 0
  """Tokens per chunk of the log-prob computation; 0 materialises all logits at once."""
  offload: OffloadSection = dataclasses.field(default_factory=OffloadSection)
  """The roles whose parameters or optimizer moments wait in host memory while idle, as a
  config's `offload` section names them; they count during the role's own stages only."""
  optimizer_on_host: bool = False
  """ZeRO-Offload (DeepSpeed's `offload_optimizer`, OpenRLHF's `--adam_offload`): the trained
  roles' moments live and are updated in host memory; they never take device memory."""
  params_on_host: bool = False
  """DeepSpeed's `offload_param` (ZeRO-3 only): the roles laid out FSDP keep their parameter
  shards in host memory and copy them in for every gather."""
  score_micro_batch: int = 0
  """Sequences per device per micro-step of the scoring forwards; 0: as training's."""
  optimizer_dtype: str | None = None
  """Dtype of the Adam moments; None: the parameters' dtype (optax's default)."""
  pipeline_schedule: str = "1f1b"
  """The schedule of a trained role whose placement has a `stage` axis ('1f1b' or 'gpipe';
  the config's `placement.pipeline_schedule`), priced by `rlhfjax.costmodel.pipeline`."""
  pipeline_recompute: bool = False
  """A pipelined backward runs its stage's forward again from the stashed stage input
  (`placement.pipeline_recompute`) instead of keeping each micro-batch's residuals."""
  fuse_actor_critic: bool = False
  """Actor and critic pipelines on the same devices run as one fused schedule
  (`ppo.fuse_actor_critic`, RLHFuse's intra-stage fusion)."""

  def __post_init__(self):
    if not set(self.judges) <= set(self.extra_rewards):
      raise ValueError(f"judges {sorted(self.judges)} must be extra rewards too")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
    for name in ("prompts", "samples_per_prompt", "prompt_len", "response_len_max"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if not 0 < self.response_len_mean <= self.response_len_max:
      raise ValueError(
        f"response_len_mean={self.response_len_mean} must be in (0, response_len_max="
        f"{self.response_len_max}]"
      )
    if self.conversation.observation_tokens >= self.response_len_mean:
      raise ValueError(
        f"observation_tokens={self.conversation.observation_tokens} must be below "
        f"response_len_mean={self.response_len_mean}, which counts them: the model's own "
        "tokens are the rest"
      )
    if not 0 <= self.prompt_len_mean <= self.prompt_len:
      raise ValueError(
        f"prompt_len_mean={self.prompt_len_mean} must be in [0, prompt_len={self.prompt_len}]"
      )
    if self.ppo_epochs < 1 or self.optimizer_steps < 1:
      raise ValueError("ppo_epochs and optimizer_steps must be >= 1")
    if min(self.micro_batch, self.score_micro_batch, self.logits_chunk, self.train_rows) < 0:
      raise ValueError("micro_batch, score_micro_batch, train_rows and logits_chunk must be >= 0")
    if self.pipeline_schedule not in schedules.SCHEDULES:
      raise ValueError(
        f"pipeline_schedule must be one of {', '.join(schedules.SCHEDULES)}, got "
        f"{self.pipeline_schedule!r}"
      )
    if self.packed and self.padded:
      raise ValueError("packed=True computes on real lengths packed into rows: set padded=False")
    for name in ("train_tokens", "score_tokens"):
      if not (getattr(self, name) == 0 or getattr(self, name) >= self.seq_len):
        raise ValueError(
          f"{name}={getattr(self, name)} must be 0 or at least one row, prompt_len + "
          f"response_len_max = {self.seq_len}"
        )

  @property
  def sequences(self) -> int:
    return self.prompts * self.samples_per_prompt

  def scored(self, role: str) -> int:
    """Sequences `role`'s forward scores in one iteration (0: it scores nothing); an extra
    reward model scores what the reward model does."""
    return self._stage(self.pricing.scored, "reward" if role in self.extra_rewards else role)

  def trained(self, role: str) -> int:
    """Sequences `role` trains on in one epoch (0: it is not trained)."""
    return self._stage(self.pricing.trained, role)

  def _stage(self, stage, role: str) -> int:
    if role not in stage:
      return 0
    return self.prompts * min(stage[role] or self.samples_per_prompt, self.samples_per_prompt)

  @property
  def seq_len(self) -> int:
    """Padded length of a scored or trained sequence."""
    return self.prompt_len + self.response_len_max

  @property
  def compute_len(self) -> float:
    """Tokens per sequence that scoring and training compute on (a packed stage computes
    `mean_tokens` over its packing's fill: `packing`)."""
    return self.seq_len if self.padded else self.mean_tokens

  def packing(self, sequences: int, max_rows: int, multiple: int = 1) -> fill.PackedStage:
    """`sequences` of this workload's lengths packed as a packing engine runs them: rows of
    `seq_len` tokens, micro-batches of at most `max_rows` rows (`rlhfjax.costmodel.fill`)."""
    return fill.packed_stage(
      sequences,
      max_rows=max_rows,
      multiple=multiple,
      prompt_len=self.prompt_len,
      prompt_mean=self.prompt_mean,
      response_mean=self.response_len_mean,
      response_max=self.response_len_max,
    )

  @property
  def prompt_mean(self) -> float:
    """Real prompt tokens on average."""
    return self.prompt_len_mean or self.prompt_len

  @property
  def prompt_tokens(self) -> float:
    """Prompt tokens the rollout prefills and attends to: padded, or the real ones."""
    return self.prompt_len if self.padded else self.prompt_mean

  @property
  def mean_tokens(self) -> float:
    """Real (prompt + response) tokens of one sequence on average."""
    return self.prompt_mean + self.response_len_mean

  @property
  def reference_model(self) -> ModelConfig:
    return self.reference or self.actor

  def model(self, role: str) -> ModelConfig | None:
    if role in self.extra_rewards:
      return self.extra_rewards[role]
    return self.reference_model if role == "reference" else getattr(self, role)

  def replace(self, **changes) -> Workload:
    return dataclasses.replace(self, **changes)


def resolve_model(name_or_path: str, dtype: str = "bfloat16") -> ModelConfig | None:
  """A registered size, or the shape in a Hugging Face `config.json`; None for 'none'.

  Sizes keep their own dtypes unless they are float32 (the small test sizes), which get
  `dtype`; HF configs get `dtype` for parameters and compute.
  """
  if name_or_path in ("none", ""):
    return None
  if name_or_path in model_sizes():
    config = get_model_config(name_or_path)
    if config.param_dtype == "float32":
      config = config.replace(param_dtype=dtype, dtype=dtype)
    return config
  path = name_or_path
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
    if not os.path.exists(path):
      raise ValueError(f"model {name_or_path!r}: the directory has no config.json")
  if not os.path.exists(path):
    if os.sep in name_or_path or name_or_path.endswith(".json"):
      raise ValueError(f"model {name_or_path!r}: {path} not found")
    raise ValueError(
      f"model {name_or_path!r} is neither a size ({', '.join(model_sizes())}) nor a path that "
      "exists"
    )
  with open(path) as f:
    try:
      hf = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: invalid JSON ({e})") from None
  return config_from_hf_dict(hf, dtype, path)


_SHAPE_KEYS = (
  "hidden_size",
  "num_attention_heads",
  "intermediate_size",
  "ffn_dim",
  "vocab_size",
  "num_hidden_layers",
  "num_key_value_heads",
  "head_dim",
)


def config_from_hf_dict(hf: dict, dtype: str, path: str) -> ModelConfig:
  """The shape fields of a HF config (any decoder-only family; only shapes matter here).

  OPT's two-matrix GeLU MLP of width `ffn_dim` becomes a SwiGLU MLP of two thirds the width:
  the same parameters and FLOPs per token.
  """
  if not isinstance(hf, dict):
    raise ValueError(f"{path}: a model config must be a JSON object, got {type(hf).__name__}")
  for name in _SHAPE_KEYS:
    value = hf.get(name)
    if value is not None and (type(value) is not int or value < 1):
      raise ValueError(f"{path}: {name!r} must be a whole number >= 1, got {value!r}")
  try:
    d = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    mlp = hf.get("intermediate_size") or 4 * d
    if "ffn_dim" in hf:
      mlp = round(2 * hf["ffn_dim"] / 3)
    return ModelConfig(
      vocab_size=hf["vocab_size"],
      hidden_size=d,
      intermediate_size=mlp,
      num_layers=hf["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or d // heads,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      param_dtype=dtype,
      dtype=dtype,
    )
  except KeyError as e:
    raise ValueError(f"{path}: missing {e.args[0]!r}") from None
