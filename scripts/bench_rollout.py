r"""Rollout engine throughput: one JSON line per (size, batch, prompt length, new tokens).

  python scripts/bench_rollout.py --size=small --batch=8 --prompt_len=64 --new_tokens=128
  python scripts/bench_rollout.py --size=1b --batch=1,16,64 --copy_mib=4096 --matmul_n=8192

Sizes: the registered model sizes ('tiny', '125m', '1b', ...) and 'small' (benchmark only);
--hidden_size etc. override a size's fields.
"""

import json

from absl import app, flags

from rlhfjax.bench import rollout_bench
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
_DTYPE = flags.DEFINE_enum(
  "dtype", None, ["float32", "bfloat16"], "Override compute and parameter dtype."
)


def main(argv):
  del argv
  overrides = {k: f.value for k, f in _OVERRIDES.items() if f.value is not None}
  if _DTYPE.value:
    overrides.update(dtype=_DTYPE.value, param_dtype=_DTYPE.value)
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
