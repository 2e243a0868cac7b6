r"""Device memory an idle role gives back by offloading to host memory, and the copy rates: one
JSON line per part (`rlhfjax.bench.offload_bench`).

  python scripts/bench_offload.py [--size=1b --repeats=3]

Meant for a GPU, where host and device memory are separate: `freed_gb` is what the allocator
really releases when the reference parameters or the actor's AdamW state are parked.
"""

import json

from absl import app, flags

from rlhfjax.bench import offload_bench

_SIZE = flags.DEFINE_string("size", "1b", "Model size.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Round trips per part (median).")


def main(argv):
  del argv
  for row in offload_bench.run(_SIZE.value, _REPEATS.value):
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  app.run(main)
