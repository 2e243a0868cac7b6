"""Prints the planner's predictions against published RLHF timings; exits 1 if a target fails.

  python scripts/validate_planner.py [--json]

Targets: every absolute time within a factor of 2 of the published one, every ratio between two
placements of one job within 25%. Also prints each case's predicted stages and the default
profile's factors against what this project measured on a GPU (`measured` in the table). The
cases, their sources and assumptions are in rlhfjax/bench/published.json; the engines'
efficiency profiles in rlhfjax/costmodel/profiles/.
"""

import json
import sys

from absl import app, flags

from rlhfjax import launch

_JSON = flags.DEFINE_bool("json", False, "One JSON object instead of the tables.")


def main(argv):
  if len(argv) > 1:
    launch.fail(f"unexpected arguments: {' '.join(argv[1:])}")
  from rlhfjax.bench.validation import validate

  result = validate()
  if _JSON.value:
    print(json.dumps(result))
  else:
    print(f"{'case':24} {'what':12} {'published':>10} {'predicted':>10} {'factor':>7}  ok")
    for r in result["absolute"]:
      print(
        f"{r['case']:24} {r['what']:12} {r['published']:>10g} {r['predicted']:>10.1f} "
        f"{r['factor']:>7.2f}  {'yes' if r['ok'] else 'NO'}"
        + ("" if r["fits"] else "  (the planner finds this placement over memory)")
      )
    print(f"\n{'ratio':46} {'what':12} {'published':>9} {'predicted':>9} {'error':>7}  ok")
    for r in result["ratios"]:
      print(
        f"{r['ratio']:46} {r['what']:12} {r['published']:>9.3f} {r['predicted']:>9.3f} "
        f"{r['error']:>+7.1%}  {'yes' if r['ok'] else 'NO'}"
      )
    names = ("generate", "score", "advantages", "update", "sync")
    print(f"\n{'predicted stages (s)':24} {'profile':22}" + "".join(f"{n:>11}" for n in names))
    for case, stages in result["stages"].items():
      print(
        f"{case:24} {stages['profile']:22}"
        + "".join(f"{stages[n]:>11.1f}" if n in stages else f"{'-':>11}" for n in names)
      )
    print("\nthe default profile (jax) against this project's GPU measurements")
    for r in result["calibration"]:
      low, high = r["measured"]
      print(
        f"  {r['factor']}: assumed {r['assumed']:g}, measured {low:g}-{high:g} "
        f"({r['assumed_over_measured'][0]:.2f}-{r['assumed_over_measured'][1]:.2f}x): "
        f"{r['source']}"
      )
  failed = [r for r in result["absolute"] + result["ratios"] if not r["ok"]]
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  app.run(main, flags_parser=launch.parse_flags)
