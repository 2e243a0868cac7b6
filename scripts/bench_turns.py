r"""Conversations in the rollout engine: how soon a finished turn goes on, one JSON line per
`min_yield` (`rlhfjax.bench.turns_bench`).

  python scripts/bench_turns.py
  python scripts/bench_turns.py --slots=64 --min_yield=64,16,4,1 --turns=6
"""

import json

from absl import app, flags

from rlhfjax.bench import turns_bench

_SIZE = flags.DEFINE_string("size", "small", "Model size (its vocabulary made small).")
_SLOTS = flags.DEFINE_integer("slots", 32, "Decode slots, and conversations.")
_TURNS = flags.DEFINE_integer("turns", 4, "Most turns of the model per conversation.")
_MIN_YIELD = flags.DEFINE_list("min_yield", ["32", "8", "1"], "min_yield values to compare.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed streams per value (median).")


def main(argv):
  del argv
  bench = turns_bench.TurnsBench(
    size=_SIZE.value,
    slots=_SLOTS.value,
    turns=_TURNS.value,
    min_yields=tuple(int(m) for m in _MIN_YIELD.value),
    repeats=_REPEATS.value,
  )
  for row in turns_bench.run(bench):
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  app.run(main)
