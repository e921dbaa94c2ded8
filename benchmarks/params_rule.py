"""The per-element Adam params rule (parity.checks.param_checks) on a grid of correct pairs and planted bugs.

Correct pairs (jax~torch, some jax~deepspeed) over lr schedules x lr x Adam eps on gpt2-tiny must show zero false
alarms; every planted optimizer/model bug must still fail. For each cell both rules are evaluated on the same
final params: 'old' (per tensor, max|a - b| / moved <= params.rtol: the rule before issue #11) and 'new' (Adam per
element). Also records kappa_needed: the smallest params_grad_noise.rtol under which the cell's params check
passes (worst element's (|a_i - b_i| - rtol * moved) / (g_T * S_i)).

  .venv/bin/python benchmarks/params_rule.py [--steps 8] [--quick] [--out benchmarks/results/params_rule]

Writes <out>.json and <out>.md. Each cell runs the sides in their own processes via parity.compare
(noise_envelope=False, determinism_steps=0), run folders under /tmp/params-rule-bench/.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parity  # noqa: E402
import parity.spec  # noqa: E402
from parity import weights  # noqa: E402
from parity.checks import param_checks  # noqa: E402
from parity.protocol import FINAL_MOMENTS, read_moments, read_steps  # noqa: E402
from parity.spec import RunSpec, from_dict  # noqa: E402
from parity.tolerances import tolerance  # noqa: E402
from parity.weights import zero_grad_slices  # noqa: E402

SCHEDULES = ("WarmupCosineLR", "Constant", "WarmupLR", "WarmupDecayLR", "LRRangeTest")
BUGS = (("torch:train.weight_decay=0.0", "weight decay off"), ("torch:train.grad_clip=0.5", "grad_clip 0.5 vs 1.0"),
        ("torch:train.eps=1e-3", "Adam eps 1e-3"), ("torch:train.beta2=0.99", "beta2 0.99 vs 0.999"),
        ("torch:train.beta1=0.8", "beta1 0.8 vs 0.9"), ("torch:train.lr=0.0011", "lr +10%"),
        ("jax:model.norm_eps=1e-6", "LayerNorm eps 1e-6"), ("torch:model.gelu_approximate=false", "GELU erf"))


def kappa_needed(a, b, init, ma, mb, spec, lr_sum, rtol) -> tuple[float, str]:
  """Smallest kappa under which every element passes (the rule's noise term uncapped by 2·Σlr); inf when an element
  exceeds rtol·moved + 2·Σlr (no kappa helps)."""
  zs = zero_grad_slices(spec)
  worst, where = 0.0, ""
  for n in a:
    pa, pb, p0 = (np.asarray(x, np.float64) for x in (a[n], b[n], init[n]))
    mask = np.ones(pa.shape, bool)
    if n in zs:
      mask[slice(*zs[n])] = False
    d = np.abs(pa - pb)[mask]
    moved = max(np.abs(pa - p0)[mask].max(initial=0), np.abs(pb - p0)[mask].max(initial=0))
    exc = d - rtol * moved
    if not np.any(exc > 0):
      continue
    if np.any(exc > 2 * lr_sum):
      return float("inf"), n
    g = max(np.sqrt(np.mean(np.square(m["grad_rms"][n].astype(np.float64)))) for m in (ma, mb))
    s = np.maximum(ma["sensitivity"][n], mb["sensitivity"][n]).astype(np.float64)[mask]
    k = float(np.max(exc / np.maximum(g * s, 1e-300)))
    if k > worst:
      worst, where = k, n
  return worst, where


def cell(name: str, overrides: list[str], perturb: list[str], sides: list[str], steps: int, root: Path) -> dict:
  out = root / name
  shutil.rmtree(out, ignore_errors=True)
  t0 = time.time()
  rep = parity.compare("gpt2-tiny", steps=steps, sides=sides, out=out, overrides=overrides, perturb=perturb,
                       noise_envelope=False, determinism_steps=0)
  spec = from_dict(RunSpec, json.loads((out / "config.json").read_text()))
  init = weights.load(out / "init.safetensors")
  finals = {s: weights.load(out / s / "final.safetensors") for s in sides if (out / s / "final.safetensors").exists()}
  moms = {s: read_moments(out / s / FINAL_MOMENTS) for s in sides}
  a, b = sides
  row = {"cell": name, "overrides": overrides, "perturb": perturb, "sides": sides, "steps": steps,
         "verdict": rep.passed, "wall_s": round(time.time() - t0, 1),
         "failing": [c["name"] for c in rep.data["checks"] if not c["passed"] and c.get("gating", True)]}
  if a in finals and b in finals:
    lr_sum = float(sum(r["lr"] for r in read_steps(out / a / "steps.jsonl")))
    old, _ = param_checks(a, finals[a], b, finals[b], init, spec.model, "fp32", lr_sum)
    new, _ = param_checks(a, finals[a], b, finals[b], init, spec.model, "fp32", lr_sum, moments=moms)
    row.update(old_params_pass=old[0].passed, old_ratio=old[0].value, new_params_pass=new[0].passed,
               new_detail=new[0].detail, lr_sum=lr_sum,
               max_loss_diff=max(abs(x["loss"] - y["loss"]) for x, y in
                                 zip(read_steps(out / a / "steps.jsonl"), read_steps(out / b / "steps.jsonl"))))
    if moms[a] and moms[b]:
      row["kappa_needed"], row["kappa_worst_tensor"] = kappa_needed(
          finals[a], finals[b], init, moms[a], moms[b], spec.model, lr_sum, tolerance("fp32", "params").rtol)
  shutil.rmtree(out, ignore_errors=True)
  return row


def grid(quick: bool) -> list[tuple[str, list[str], list[str], list[str]]]:
  cells = []
  cells.append(("ok-Constant-6e-4-1e-8", ['train.lr_schedule="Constant"', "train.lr=6e-4"], [], ["jax", "torch"]))
  for sch in SCHEDULES:
    extra = ['train.lr_schedule_params={"total_num_steps": 8}'] if sch == "WarmupDecayLR" else []
    cells.append((f"ok-{sch}-1e-3-1e-8", [f'train.lr_schedule="{sch}"', *extra], [], ["jax", "torch"]))
  lrs = (1e-4, 6e-3) if quick else (1e-4, 1e-3, 6e-3)
  for sch in (("Constant",) if quick else ("Constant", "WarmupCosineLR")):
    for lr in lrs:
      for eps in (1e-8, 1e-6):
        if lr == 1e-3 and eps == 1e-8:
          continue
        cells.append((f"ok-{sch}-{lr:g}-{eps:g}", [f'train.lr_schedule="{sch}"', f"train.lr={lr}", f"train.eps={eps}"],
                      [], ["jax", "torch"]))
  cells.append(("ok-ds-Constant-1e-3-1e-8", ['train.lr_schedule="Constant"'], [], ["jax", "deepspeed"]))
  for stage in (0, 1, 3):
    cells.append((f"ok-ds-zero{stage}-Constant-6e-3-1e-6", ['train.lr_schedule="Constant"', "train.lr=6e-3",
                  "train.eps=1e-6", f"deepspeed.zero_stage={stage}", 'deepspeed.offload_optimizer="none"'], [],
                  ["jax", "deepspeed"]))
  cells.append(("ok-ds-Constant-6e-4-1e-8", ['train.lr_schedule="Constant"', "train.lr=6e-4"], [], ["jax", "deepspeed"]))
  for pert, label in BUGS:
    cells.append((f"bug-{label}", ['train.lr_schedule="Constant"'], [pert], ["jax", "torch"]))
  return cells


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--quick", action="store_true", help="fewer lr values and schedules x lr (2 busy cores)")
  ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "params_rule"))
  ap.add_argument("--only", default="", help="substring filter on cell names")
  args = ap.parse_args(argv)
  root = Path("/tmp/params-rule-bench")
  rows = []
  for name, ov, pert, sides in grid(args.quick):
    if args.only and args.only not in name:
      continue
    try:
      row = cell(name, ov, pert, sides, args.steps, root)
    except parity.spec.SpecError as exc:  # a schedule that needs parameters this grid does not give
      print(f"{name}: skipped ({exc})", flush=True)
      continue
    rows.append(row)
    print(json.dumps({k: row.get(k) for k in ("cell", "verdict", "old_params_pass", "new_params_pass",
                                               "kappa_needed", "failing", "wall_s")}), flush=True)
  import deepspeed  # noqa: F401  (versions only)
  import jax
  import torch
  ok = [r for r in rows if r["cell"].startswith("ok-")]
  bugs = [r for r in rows if r["cell"].startswith("bug-")]
  summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
             "versions": {"jax": jax.__version__, "torch": torch.__version__, "deepspeed": sys.modules["deepspeed"].__version__},
             "command": " ".join(["benchmarks/params_rule.py", *(argv if argv is not None else sys.argv[1:])]),
             "kappa": tolerance("fp32", "params_grad_noise").rtol,
             "false_alarms_new": sum(not r.get("new_params_pass", False) for r in ok),
             "false_alarms_old": sum(not r.get("old_params_pass", True) for r in ok),
             "max_kappa_needed_correct": max((r.get("kappa_needed", 0.0) for r in ok), default=0.0),
             "bugs_caught_new": sum(not r["verdict"] for r in bugs), "bugs": len(bugs), "rows": rows}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out + ".json").write_text(json.dumps(summary, indent=2, default=str))
  lines = [f"# params rule grid ({summary['date']})", "",
           f"CPU {summary['cpu']}, Python {summary['python']}, {summary['versions']}; gpt2-tiny, {args.steps} steps; "
           f"kappa = {summary['kappa']:g}. Command: `.venv/bin/python {summary['command']}`", "",
           f"Correct pairs: {len(ok)} cells, false alarms old rule {summary['false_alarms_old']}, new rule "
           f"{summary['false_alarms_new']}; largest kappa needed by a correct pair {summary['max_kappa_needed_correct']:.3g}. "
           f"Planted bugs failing the verdict: {summary['bugs_caught_new']} of {len(bugs)}.", "",
           "| cell | sides | verdict | old params | new params | kappa needed | max Δloss | failing checks |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['cell']} | {'~'.join(r['sides'])} | {'PASS' if r['verdict'] else 'FAIL'} | "
                 f"{r.get('old_params_pass')} ({r.get('old_ratio', float('nan')):.3g}) | {r.get('new_params_pass')} | "
                 f"{r.get('kappa_needed', float('nan')):.3g} | {r.get('max_loss_diff', float('nan')):.2g} | "
                 f"{', '.join(r['failing']) or '-'} |")
  Path(args.out + ".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines[:5]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
