r"""Single-GPU efficiency of a 1B PPO actor: train-step MFU and the rollout engine's decode
bandwidth (batch 64 and 256), JSON lines.

  python scripts/bench_gpu.py [--batch=8 --seq_len=2048 --decode_batch=64 --cache_len=2048]

First the device's measured copy bandwidth and bf16 matmul rate beside its datasheet peaks,
which the MFU and bandwidth fractions are taken against (`step_bench.peaks`: H100 or H200).
The decode rows run each of `--paged_kernels` ('auto': the Pallas kernel on a GPU; 'gather':
pages gathered into a contiguous cache, then XLA's attention).

The train step keeps fp32 master weights and trains in bf16 with the size's remat, chunked
log-probs and cuDNN flash attention ('auto' picks it on a GPU); decode runs bf16 weights.
First prints the attention kernels' agreement with the einsum path (`--check`).
See `rlhfjax.bench.step_bench` for what is counted.
"""

import json

from absl import app, flags

from rlhfjax.bench import step_bench
from rlhfjax.config.model import get_model_config

_SIZE = flags.DEFINE_string("size", "1b", "Model size.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per train step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence (a quarter prompt).")
_REMAT = flags.DEFINE_list("remat", ["full"], "Remat policies to time.")
_CHUNK = flags.DEFINE_integer("chunk", 1024, "Log-prob chunk (0: whole logits).")
_DECODE_BATCH = flags.DEFINE_list("decode_batch", ["64", "256"], "Decode slots.")
_CACHE_LEN = flags.DEFINE_integer("cache_len", 2048, "KV cache length of a decode slot.")
_CHECK = flags.DEFINE_bool("check", True, "Compare attention kernels with the einsum path.")
_CEILINGS = flags.DEFINE_bool("ceilings", True, "Measure copy bandwidth and bf16 matmul rate.")
_COPY_MIB = flags.DEFINE_integer("copy_mib", 4096, "Size of the bandwidth probe in MiB.")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 8192, "Side of the matmul-rate probe.")
_PAGED_KERNELS = flags.DEFINE_list(
  "paged_kernels", ["auto", "gather"], "Paged attention kernels to time ('auto', 'gather', ...)."
)


def main(argv):
  del argv
  if _CEILINGS.value:
    print(json.dumps(step_bench.ceilings(_COPY_MIB.value << 20, _MATMUL_N.value)), flush=True)
  if _CHECK.value:
    for row in step_bench.attention_check():
      print(json.dumps(row), flush=True)
  for remat in _REMAT.value:
    config = get_model_config(_SIZE.value, remat=remat, logprob_chunk_size=_CHUNK.value or None)
    row = step_bench.train_step(config, _BATCH.value, _SEQ_LEN.value, _SEQ_LEN.value // 4)
    print(json.dumps({"size": _SIZE.value, **row}), flush=True)
  rollout = get_model_config(_SIZE.value, param_dtype="bfloat16")
  for batch in map(int, _DECODE_BATCH.value):
    for kernel in _PAGED_KERNELS.value:
      try:
        row = step_bench.paged_decode_step(rollout, batch, _CACHE_LEN.value, kernel=kernel)
      except Exception as e:  # noqa: BLE001 - reported (a kernel that does not build here)
        error = str(e)[:500]
        row = {"bench": "paged_decode_step", "batch": batch, "kernel": kernel, "error": error}
      print(json.dumps({"size": _SIZE.value, **row}), flush=True)


if __name__ == "__main__":
  app.run(main)
