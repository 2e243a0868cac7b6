"""The planner against published RLHF timings (`published.json`, sources inside).

Each case fixes hardware, models, workload, the placement the source used (as data: devices and
mesh per role) and the engine's efficiency profile (`profiles/<name>.json`, one per engine,
shared by every case that engine ran). The prediction is compared with the published numbers:
every absolute time within a factor of 2, and every ratio between two placements of the same job
within 25% of the published ratio. 'generate' in the sources is the whole experience making
(generation and the scoring forwards: DeepSpeed-Chat's and OpenRLHF's `print_throughput_step3`
time `make_experience`), 'train' the PPO updates with the weight sync; a case whose source
times generation alone lists the predicted stages it covers (`experience_stages`). A case
states its settings (micro-batches, optimizer steps, offload) in `workload`; without a
`micro_batch` the largest that fits is taken.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from rlhfjax.config import OffloadSection
from rlhfjax.costmodel.efficiency import load_efficiency
from rlhfjax.costmodel.hardware import load_hardware
from rlhfjax.costmodel.workload import Workload, config_from_hf_dict, resolve_model
from rlhfjax.flows.registry import pricing_by_name
from rlhfjax.placement.spec import Layout, PlacementSpec, Role, RoleSpec
from rlhfjax.planner.evaluate import Plan, evaluate

TABLE = os.path.join(os.path.dirname(__file__), "published.json")
ABSOLUTE_FACTOR = 2.0
RATIO_TOLERANCE = 0.25
EXPERIENCE_STAGES = ("generate", "score", "advantages")
"""The predicted stages a source's 'generation' time covers, unless its case names others."""


def load_table(path: str = TABLE) -> dict:
  with open(path) as f:
    return json.load(f)


def _model(entry):
  if isinstance(entry, str):
    return resolve_model(entry)
  return config_from_hf_dict(entry["hf"], "bfloat16", "published.json")


def _spec(placement: Mapping[str, Mapping]) -> PlacementSpec:
  """The placement a source used: every role it names (or `all` gives), its devices as a
  `[start, stop)` range and its mesh axes."""
  roles = {}
  for role in Role:
    entry = placement.get(role.value) or placement.get("all")
    if entry is None:  # a flow without the role (GRPO's critic and reward model)
      continue
    devices = range(*entry["devices"])
    if role == Role.ROLLOUT:
      roles[role] = RoleSpec.generation(devices, data=entry["data"], tensor=entry["tensor"])
    else:
      roles[role] = RoleSpec.training(
        devices,
        stage=entry.get("stage", 1),
        data=entry.get("data", 1),
        fsdp=entry.get("fsdp", 1),
        tensor=entry.get("tensor", 1),
      )
    assert roles[role].layout in (Layout.TRAINING, Layout.GENERATION)
  return PlacementSpec(strategy="published", roles=roles)


def predict_case(case: Mapping, table: Mapping) -> Plan:
  models = {role: _model(table["models"][name]) for role, name in case["models"].items()}
  settings = dict(case["workload"])
  if "offload" in settings:
    settings["offload"] = OffloadSection(**{k: tuple(v) for k, v in settings["offload"].items()})
  work = Workload(
    pricing=pricing_by_name(case.get("algorithm", "ppo")),
    actor=models["actor"],
    critic=models.get("critic"),
    reward=models.get("reward"),
    reference=models.get("reference"),
    **settings,
  )
  hw = load_hardware(case["hardware"])
  eff = load_efficiency(case["profile"])
  spec = _spec(case["placement"])
  kwargs = dict(async_rollout=case.get("async_rollout", False), label=case["name"])
  if work.micro_batch:  # the source states it
    return evaluate(spec, work, hw, eff, micro_batch=work.micro_batch, **kwargs)
  plan = None
  for micro_batch in (16, 8, 4, 2, 1):  # the largest micro-batch that fits, as a user would
    plan = evaluate(spec, work, hw, eff, micro_batch=micro_batch, **kwargs)
    if plan.fits:
      break
  return plan


def validate(table: Mapping | None = None) -> dict:
  """Predicted against published for every case and ratio, with pass/fail per target; each
  case's predicted stages; the default profile against this project's GPU measurements."""
  table = table or load_table()
  rows, stages_by_case = [], {}
  for case in table["cases"]:
    plan = predict_case(case, table)
    stages_by_case[case["name"]] = {
      "profile": case["profile"],
      "fits": plan.fits,
      **{stage: round(seconds, 3) for stage, seconds in plan.stages.items()},
    }
    # The OpenRLHF table times `make_experience` (generation, then the scoring forwards) as
    # "generation" and the PPO updates (with the weight sync) as "training"; a case whose
    # source times generation alone names its stages.
    stages = case.get("experience_stages", EXPERIENCE_STAGES)
    experience = sum(plan.stages[s] for s in stages)
    predicted = {
      "iteration_s": plan.iteration_s,
      "generate_s": experience,
      "train_s": plan.iteration_s - experience,
    }
    for key, published in case["published"].items():
      factor = predicted[key] / published
      rows.append(
        {
          "case": case["name"],
          "what": key,
          "published": published,
          "predicted": round(predicted[key], 3),
          "factor": round(factor, 3),
          "ok": 1 / ABSOLUTE_FACTOR <= factor <= ABSOLUTE_FACTOR,
          "fits": plan.fits,
        }
      )
  published_by_name = {c["name"]: c["published"] for c in table["cases"]}
  ratios = []
  for a, b in table["ratios"]:
    for key in ("iteration_s", "generate_s", "train_s"):
      if key not in published_by_name[a] or key not in published_by_name[b]:
        continue
      pub = published_by_name[a][key] / published_by_name[b][key]
      pa = next(r["predicted"] for r in rows if r["case"] == a and r["what"] == key)
      pb = next(r["predicted"] for r in rows if r["case"] == b and r["what"] == key)
      pred = pa / pb
      ratios.append(
        {
          "ratio": f"{a} / {b}",
          "what": key,
          "published": round(pub, 3),
          "predicted": round(pred, 3),
          "error": round(pred / pub - 1, 3),
          "ok": abs(pred / pub - 1) <= RATIO_TOLERANCE,
        }
      )
  return {
    "absolute": rows,
    "ratios": ratios,
    "stages": stages_by_case,
    "calibration": calibration(table),
  }


def calibration(table: Mapping) -> list[dict]:
  """The default profile's factors against what this project measured on a GPU (the table's
  `measured`): the planner prices rlhfjax's own runs with the profile, so the gap is how far
  its predictions of them may be off."""
  profile = load_efficiency(None)
  rows = []
  for m in table.get("measured", ()):
    values = m["value"] if isinstance(m["value"], list) else [m["value"]]
    low, high = min(values), max(values)
    assumed = getattr(profile, m["factor"])
    rows.append(
      {
        "factor": m["factor"],
        "assumed": assumed,
        "measured": [low, high],
        "assumed_over_measured": [round(assumed / high, 3), round(assumed / low, 3)],
        "source": m["source"],
      }
    )
  return rows
