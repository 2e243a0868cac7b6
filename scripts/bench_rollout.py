r"""Rollout engine throughput: one JSON line per (size, batch, prompt length, new tokens).

  python scripts/bench_rollout.py --size=small --batch=8 --prompt_len=64 --new_tokens=128
  python scripts/bench_rollout.py --size=1b --batch=1,16,64 --copy_mib=4096 --matmul_n=8192
  python scripts/bench_rollout.py --size=small --batch=64 --temperature=1 --nono_cache

With `--engines`, one line per engine instead: a dense KV cache (the engine with a page per
slot) and small pages on a long-tailed length mix in the same KV memory
(`rlhfjax.bench.engines_bench`):

  python scripts/bench_rollout.py --engines=dense,paged,paged_prefix_shared

Sizes: the registered model sizes ('tiny', '125m', '1b', ...) and 'small' (benchmark only);
--hidden_size etc. override a size's fields.
"""

import json

from absl import app, flags

from rlhfjax.bench import engines_bench, rollout_bench
from rlhfjax.config.model import SHAPE_FIELDS

_SIZE = flags.DEFINE_string("size", "small", "Model size.")
_BATCH = flags.DEFINE_list("batch", ["8"], "Decode batch sizes (comma separated).")
_PROMPT_LEN = flags.DEFINE_list("prompt_len", ["64"], "Prompt lengths.")
_NEW_TOKENS = flags.DEFINE_list("new_tokens", ["128"], "New tokens per prompt.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per measurement (median).")
_NO_CACHE = flags.DEFINE_bool("no_cache", True, "Also time the no-cache baseline.")
_COPY_MIB = flags.DEFINE_integer("copy_mib", 256, "Size of the bandwidth probe in MiB.")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 1024, "Side of the matmul-rate probe.")
_OVERRIDES = {
  name: flags.DEFINE_integer(name, None, f"Override the size's {name}.") for name in SHAPE_FIELDS
}
_ENGINES = flags.DEFINE_list(
  "engines", [], f"Compare engines {engines_bench.ENGINES} on a long-tailed mix instead."
)
_GROUPS = flags.DEFINE_integer("groups", 16, "--engines: prompts (each asked --group_size times).")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 4, "--engines: samples per prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 512, "--engines: response token limit.")
_MEAN_NEW = flags.DEFINE_integer("mean_new_tokens", 64, "--engines: mean response length.")
_DENSE_SLOTS = flags.DEFINE_integer(
  "dense_slots", 8, "--engines: slots of the dense cache (a page per slot); the KV budget."
)
_PAGED_SLOTS = flags.DEFINE_integer("paged_slots", 32, "--engines: the paged engines' slots.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "--engines: tokens per page.")
_DECODE_CHUNK = flags.DEFINE_integer("decode_chunk", 64, "--engines: decode steps per call.")
_TEMPERATURE = flags.DEFINE_float(
  "temperature", 0.0, "Sampling temperature of the decode rows (0: greedy; a run's 1 draws)."
)
_DTYPE = flags.DEFINE_enum(
  "dtype", None, ["float32", "bfloat16"], "Override compute and parameter dtype."
)


def main(argv):
  del argv
  overrides = {k: f.value for k, f in _OVERRIDES.items() if f.value is not None}
  if _DTYPE.value:
    overrides.update(dtype=_DTYPE.value, param_dtype=_DTYPE.value)
  if _ENGINES.value:
    workload = engines_bench.Workload(
      groups=_GROUPS.value,
      group_size=_GROUP_SIZE.value,
      max_prompt_len=int(_PROMPT_LEN.value[0]),
      max_new_tokens=_MAX_NEW.value,
      mean_new_tokens=_MEAN_NEW.value,
    )
    budget = engines_bench.Budget(
      dense_slots=_DENSE_SLOTS.value,
      paged_slots=_PAGED_SLOTS.value,
      page_size=_PAGE_SIZE.value,
      decode_chunk=_DECODE_CHUNK.value,
    )
    for record in engines_bench.run(
      tuple(_ENGINES.value),
      workload,
      budget,
      size=_SIZE.value,
      repeats=min(_REPEATS.value, 2),
      model_overrides=overrides,
    ):
      print(json.dumps(record), flush=True)
    return
  for batch in _BATCH.value:
    for prompt_len in _PROMPT_LEN.value:
      for new_tokens in _NEW_TOKENS.value:
        bench = rollout_bench.BenchConfig(
          size=_SIZE.value,
          batch=int(batch),
          prompt_len=int(prompt_len),
          new_tokens=int(new_tokens),
          repeats=_REPEATS.value,
          no_cache=_NO_CACHE.value,
          temperature=_TEMPERATURE.value,
        )
        record = rollout_bench.run(
          bench,
          copy_bytes=_COPY_MIB.value << 20,
          matmul_n=_MATMUL_N.value,
          model_overrides=overrides,
        )
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
  app.run(main)
