"""Rollout: KV-cache generation for the rollout role, with continuous batching over slots."""

from rlhfjax.rollout.batching import GenerateOutput, as_prompt_list, generate
from rlhfjax.rollout.engine import Engine, EngineConfig, Prefix, SlotView
from rlhfjax.rollout.paged_decode import PagedState
from rlhfjax.rollout.sampling import GREEDY, SamplingParams, sample, truncated_logits
from rlhfjax.rollout.streaming import Finished, RolloutStream, StreamStats

__all__ = [
  "GREEDY",
  "Engine",
  "EngineConfig",
  "Finished",
  "GenerateOutput",
  "PagedState",
  "Prefix",
  "RolloutStream",
  "SamplingParams",
  "SlotView",
  "StreamStats",
  "as_prompt_list",
  "generate",
  "sample",
  "truncated_logits",
]
