r"""Peak memory per device of the PPO actor train step, from XLA's analysis: one JSON line each.

  python scripts/bench_memory.py
  python scripts/bench_memory.py --sizes=7b --seq_lens=4096 --remats=full --chunked=true
  python scripts/bench_memory.py --sizes=path/to/Llama-3.1-8B/config.json --seq_lens=32768 \
    --remats=full --chunked=true
  python scripts/bench_memory.py --sizes=path/to/Llama-3.1-8B/config.json --seq_lens=65536 \
    --remats=full --chunked=true --context=8
  python scripts/bench_memory.py --sizes=path/to/Llama-3.1-8B/config.json --seq_lens=4096 \
    --remats=full --chunked=true --lora_rank=16

For each size x sequence length x remat policy x chunked/whole log-probs the step is compiled
ahead of time on abstract inputs for 8 (virtual) devices, nothing allocated, one sequence per
device (with `--context` c > 1, one per c devices, each holding 1/c of its tokens: context
parallelism); each compile gives
two lines, without and with offload of the co-located roles (`rlhfjax.bench.memory_bench`).
A final line per size checks the targets: 4k tokens fit `--budget_gb` with remat, and the
8k peak is at most twice the 4k peak.
"""

import json
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

from absl import app, flags  # noqa: E402

from rlhfjax.bench import memory_bench  # noqa: E402

_SIZES = flags.DEFINE_list(
  "sizes",
  ["1b", "7b"],
  "Model sizes, or Hugging Face config.json paths (or their checkpoint directories): fp32 "
  "master weights and bf16 compute, as the named sizes.",
)
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "4096", "8192"], "Tokens per sequence.")
_REMATS = flags.DEFINE_list(
  "remats", ["none", "full", "dots_with_no_batch_dims_saveable"], "Remat policies."
)
_CHUNKED = flags.DEFINE_list("chunked", ["false", "true"], "Chunked log-probs (true/false).")
_CHUNK_SIZE = flags.DEFINE_integer("chunk_size", 1024, "Tokens per log-prob chunk.")
_CONTEXT = flags.DEFINE_integer(
  "context", 1, "Devices each sequence's tokens are split over (placement.context)."
)
_LORA_RANK = flags.DEFINE_integer(
  "lora_rank", 0, "LoRA adapters of this rank over a frozen bf16 base (model.lora); 0: none."
)
_BUDGET_GB = flags.DEFINE_float("budget_gb", 80.0, "Device memory the targets check against.")


def main(argv):
  del argv
  points = []
  for size in _SIZES.value:
    for seq_len in map(int, _SEQ_LENS.value):
      for remat in _REMATS.value:
        for chunked in (c.lower() == "true" for c in _CHUNKED.value):
          for point in memory_bench.measure(
            size,
            seq_len,
            remat,
            chunked,
            chunk_size=_CHUNK_SIZE.value,
            context=_CONTEXT.value,
            lora_rank=_LORA_RANK.value,
          ):
            points.append(point)
            print(json.dumps(point.as_row()), flush=True)
  for size in _SIZES.value:
    print(json.dumps(memory_bench.targets(points, size, _BUDGET_GB.value)), flush=True)


if __name__ == "__main__":
  app.run(main)
