"""The per-element Adam params rule (parity.verdict.params.param_checks) on a grid of correct pairs and planted bugs.

Correct pairs (jax~torch, some jax~deepspeed) over lr schedules x lr x Adam eps on gpt2-tiny must show zero false
alarms; every planted optimizer/model bug must still fail. For each cell both rules are evaluated on the same
final params: 'old' (per tensor, max|a - b| / moved <= params.rtol: the earlier per-tensor rule) and 'new' (Adam per
element). Also records kappa_needed: the smallest params_grad_noise.rtol under which the cell's params check
passes (worst element's (|a_i - b_i| - rtol * moved) / (g_T * S_i)).

  .venv/bin/python benchmarks/params_rule.py [--steps 8] [--quick] [--out benchmarks/results/params_rule]
  .venv/bin/python benchmarks/params_rule.py --precision bf16,fp16 [--out benchmarks/results/params_rule_envelope]
  .venv/bin/python benchmarks/params_rule.py --grid vocab --steps 3 [--out benchmarks/results/params_rule_vocab]

--grid vocab: correct jax~torch pairs with vocabularies of 32,000, 128,256 and 151,936, tied and untied,
each on the byte corpus as it is (ids < 256: most rows never fed) and with its ids spread over the vocabulary (a
seeded injective map of the 256 byte ids into [0, V), the first 1,000,000 ids of the corpus written as a uint32 .npy
token file and passed as `data`: the user's path, `--data ids.npy`; the cell records batches.npy's dtype and largest
id); jax~deepspeed on the largest vocabulary; a 2-rank cell (`--nproc 2`) of a config ported from a DeepSpeed JSON for
2 ranks (AdamW, weight decay 0.1, Constant lr); and the planted bugs above, grad_clip also under the default
WarmupCosineLR and on V = 151,936. Besides kappa_needed (today's noise scale) it records kappa_needed_gT: the same
with the tensor-wide g_T on every tensor (the rule before the vocabulary-row scale), the largest gap between the two
sides' gradient scales (parity.numerics.adam.moments_gap; beyond params_moments the noise term is withheld), and
every other check's value / tolerance (loss, grad norm, lr, val loss, params_zero_grad) and the memory model's
predicted / measured ratios, so a false alarm anywhere shows.

Writes <out>.json and <out>.md. Each cell runs the sides in their own processes via parity.compare
(noise_envelope=False, determinism_steps=0), run folders under /tmp/params-rule-bench/.

With --precision bf16/fp16 the grid is the noise-envelope one (parity.verdict.envelope.envelope_params_check): schedules
x lr x precision on correct jax~torch pairs, two jax~deepspeed cells, and the noise-envelope benchmark's planted bugs
(benchmarks/noise_envelope.py BUGS) on the torch side; each cell runs with the noise envelope on, and 'old' is the
per-tensor envelope rule, 'new' the envelope + Adam per-element rule, both on the same final params and reruns;
'old verdict' is the verdict with the old params_envelope check in place of the new one.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parity
import parity.spec
from parity import weights
from parity.verdict.envelope import envelope_params_check
from parity.numerics.adam import noise_scale
from parity.verdict.params import param_checks, param_ratios
from parity.protocol import FINAL_MOMENTS, read_moments, read_steps
from parity.spec import RunSpec, from_dict
from parity.verdict.tolerances import envelope_rule, tolerance
from parity.weights import zero_grad_slices
from parity.data import load_corpus

SCHEDULES = ("WarmupCosineLR", "Constant", "WarmupLR", "WarmupDecayLR", "LRRangeTest")
BUGS = (("torch:train.weight_decay=0.0", "weight decay off"), ("torch:train.grad_clip=0.5", "grad_clip 0.5 vs 1.0"),
        ("torch:train.eps=1e-3", "Adam eps 1e-3"), ("torch:train.beta2=0.99", "beta2 0.99 vs 0.999"),
        ("torch:train.beta1=0.8", "beta1 0.8 vs 0.9"), ("torch:train.lr=0.0011", "lr +10%"),
        ("jax:model.norm_eps=1e-6", "LayerNorm eps 1e-6"), ("torch:model.gelu_approximate=false", "GELU erf"))


def kappa_needed(a, b, init, ma, mb, spec, lr_sum, rtol, vocab_size=None) -> tuple[float, str]:
  """Smallest kappa under which every element passes the fp32 rule (the noise term uncapped by 2·Σlr); inf when an
  element exceeds rtol·moved + 2·Σlr (no kappa helps). The envelope's rule with the bound rtol for every tensor.
  vocab_size: the noise scale of the verdict (vocabulary-row tensors at max(g_T, g_row)); None: g_T everywhere."""
  return envelope_kappa_needed(a, b, init, ma, mb, spec, lr_sum, {n: rtol for n in a}, vocab_size)


def cell(name: str, overrides: list[str], perturb: list[str], sides: list[str], steps: int, root: Path,
         spread: bool = False, config: str | None = None, nproc: int = 1, vocab: int = 256) -> dict:
  """One compare (gpt2-tiny; `config` merged over it, `nproc` ranks per side; `spread`: ids spread over the
  `vocab` ids, `spread_file`) and both params rules on its final params."""
  out = root / name
  shutil.rmtree(out, ignore_errors=True)
  t0 = time.time()
  data = {"data": spread_file(root, vocab)} if spread else {}
  rep = parity.compare("gpt2-tiny", config=config, steps=steps, sides=sides, out=out, overrides=overrides,
                       perturb=perturb, noise_envelope=False, determinism_steps=0, nproc=nproc, progress=False, **data)
  spec = from_dict(RunSpec, json.loads((out / "config.json").read_text()))
  batches = np.load(out / "batches.npy", mmap_mode="r")
  init = weights.load(out / "init.safetensors")
  finals = {s: weights.load(out / s / "final.safetensors") for s in sides if (out / s / "final.safetensors").exists()}
  moms = {s: read_moments(out / s / FINAL_MOMENTS) for s in sides}
  a, b = sides
  row = {"cell": name, "overrides": overrides, "perturb": perturb, "sides": sides, "steps": steps, "nproc": nproc,
         "spread_ids": spread, "vocab_size": spec.model.vocab_size, "tied": spec.model.tie_embeddings,
         "verdict": rep.passed, "wall_s": round(time.time() - t0, 1),
         "failing": [c["name"] for c in rep.data["checks"] if not c["passed"] and c.get("gating", True)],
         "batches_dtype": str(batches.dtype), "batches_max_id": int(np.max(batches)),
         "checks": {c["name"]: [c["passed"], c["value"], c["tolerance"]] for c in rep.data["checks"]},
         "other_checks_worst": other_checks_worst(rep.data["checks"]),
         "memory_ratios": memory_ratios(rep.data)}
  if a in finals and b in finals:
    lr_sum = float(sum(r["lr"] for r in read_steps(out / a / "steps.jsonl")))
    old, _ = param_checks(a, finals[a], b, finals[b], init, spec.model, "fp32", lr_sum)
    new, table = param_checks(a, finals[a], b, finals[b], init, spec.model, "fp32", lr_sum, moments=moms)
    row.update(moments_gap=max((t.get("moments_gap", 0.0) for t in table), default=0.0),
               noise_withheld=sum(bool(t.get("noise_withheld")) for t in table))
    row.update(old_params_pass=old[0].passed, old_ratio=old[0].value, new_params_pass=new[0].passed,
               new_detail=new[0].detail, lr_sum=lr_sum,
               max_loss_diff=max(abs(x["loss"] - y["loss"]) for x, y in
                                 zip(read_steps(out / a / "steps.jsonl"), read_steps(out / b / "steps.jsonl"))))
    if moms[a] and moms[b]:
      rtol = tolerance("fp32", "params").rtol
      row["kappa_needed"], row["kappa_worst_tensor"] = kappa_needed(
          finals[a], finals[b], init, moms[a], moms[b], spec.model, lr_sum, rtol, spec.model.vocab_size)
      row["kappa_needed_gT"], row["kappa_gT_worst_tensor"] = kappa_needed(
          finals[a], finals[b], init, moms[a], moms[b], spec.model, lr_sum, rtol)
  shutil.rmtree(out, ignore_errors=True)
  return row


def other_checks_worst(checks: list[dict]) -> list:
  """[name, value / tolerance] of the gating check other than params with the largest ratio (every check of a
  compare's report but the params pair: loss, grad_norm, lr, val_loss, completed, updates, params_zero_grad)."""
  best = ["-", 0.0]
  for c in checks:
    if c["metric"] == "params" or not c.get("gating", True) or c["metric"] in ("completed", "updates"):
      continue
    v, t = c.get("value"), c.get("tolerance")
    r = (0.0 if not v else float("inf")) if not t else abs(v) / t
    if r > best[1] or not c["passed"]:
      best = [c["name"], r]
  return best


def memory_ratios(data: dict) -> list:
  """[min, max] of the memory model's predicted / measured ratios in the report (None: none measured)."""
  rs = [r["ratio"] for r in (data.get("memory") or {}).get("predicted_vs_measured", []) if r.get("ratio")]
  return [min(rs), max(rs)] if rs else None


SPREAD_IDS = 1_000_000
"""How many ids of the byte corpus the spread token files hold (3 steps of gpt2-tiny read a few thousand)."""


def spread_file(root: Path, vocab: int) -> str:
  """root/spread-V.npy: the first SPREAD_IDS ids of the stdlib byte corpus (train then held-out part) mapped through
  a seeded injective map (numpy seed 0) of the 256 byte ids into [0, vocab), as uint32: a token file a user
  passes with --data, read by parity.data like any other."""
  path = root / f"spread-{vocab}.npy"
  if not path.exists():
    corpus = load_corpus("stdlib")
    ids = np.concatenate([corpus.train, corpus.val])[:SPREAD_IDS]
    lut = np.random.default_rng(0).choice(vocab, size=256, replace=False).astype(np.uint32)
    root.mkdir(parents=True, exist_ok=True)
    np.save(path, lut[ids])
  return str(path)


W2_DS = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
"""The 2-rank DeepSpeed JSON of the issue's nproc-2 case (ported with `parity port --world-size 2`)."""


def ported_w2(root: Path) -> str:
  """`parity port` of W2_DS for 2 ranks, written to root/w2.yaml (the CLI, as a user runs it)."""
  import subprocess
  root.mkdir(parents=True, exist_ok=True)
  (root / "w2.json").write_text(json.dumps(W2_DS))
  subprocess.run([sys.executable, "-m", "parity.cli", "port", str(root / "w2.json"), "--world-size", "2", "-o",
                  str(root / "w2.yaml"), "--quiet"], check=True, capture_output=True)
  return str(root / "w2.yaml")


def vocab_grid(root: Path) -> list[tuple]:
  """(name, overrides, perturb, sides, vocab, spread, config, nproc) of the --grid vocab cells."""
  cells = []
  for v in (151936, 32000, 128256):
    for tied in (True, False):
      for spread in (False, True):
        cells.append((f"ok-V{v}-{'tied' if tied else 'untied'}-{'spread' if spread else 'bytes'}",
                      [f"model.vocab_size={v}", f"model.tie_embeddings={str(tied).lower()}"], [], ["jax", "torch"],
                      v, spread, None, 1))
  for tied in (True, False):
    cells.append((f"ok-ds-V151936-{'tied' if tied else 'untied'}-spread",
                  ["model.vocab_size=151936", f"model.tie_embeddings={str(tied).lower()}"], [], ["jax", "deepspeed"],
                  151936, True, None, 1))
  w2 = ported_w2(root)
  cells.append(("ok-nproc2-ported-AdamW-wd0.1", [], [], ["jax", "torch"], 256, False, w2, 2))
  cells.append(("ok-nproc2-ported-AdamW-wd0.1-ds", [], [], ["jax", "deepspeed"], 256, False, w2, 2))
  cells.append(("bug-V151936-weight decay off", ["model.vocab_size=151936"], ["torch:train.weight_decay=0.0"],
                ["jax", "torch"], 151936, True, None, 1))
  cells.append(("bug-grad_clip 0.5 vs 1.0 WarmupCosineLR", [], ["torch:train.grad_clip=0.5"], ["jax", "torch"], 256,
                False, None, 1))
  cells.append(("bug-V151936-grad_clip 0.5 vs 1.0 WarmupCosineLR", ["model.vocab_size=151936"],
                ["torch:train.grad_clip=0.5"], ["jax", "torch"], 151936, True, None, 1))
  for pert, label in BUGS:
    cells.append((f"bug-{label}", ['train.lr_schedule="Constant"'], [pert], ["jax", "torch"], 256, False, None, 1))
  first = ("ok-V151936", "ok-ds-V151936", "ok-nproc2-ported-AdamW-wd0.1", "bug-grad", "bug-V", "bug-weight",
           "bug-GELU")
  return sorted(cells, key=lambda c: next((i for i, f in enumerate(first) if c[0].startswith(f)), len(first)))


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
  cells.append(("ok-ds-Constant-6e-4-1e-8", ['train.lr_schedule="Constant"', "train.lr=6e-4"], [],
                ["jax", "deepspeed"]))
  for pert, label in BUGS:
    cells.append((f"bug-{label}", ['train.lr_schedule="Constant"'], [pert], ["jax", "torch"]))
  return cells


ENV_BUGS = (("torch:train.weight_decay=0.0", "weight decay off"), ("torch:model.norm_eps=1e-6", "LayerNorm eps 1e-6"),
            ("torch:model.gelu_approximate=false", "GELU exact"), ("torch:train.lr=0.00105", "lr +5%"))
"""benchmarks/noise_envelope.py BUGS, planted on the torch side of a jax~torch pair."""


def envelope_kappa_needed(a, b, init, ma, mb, spec, lr_sum, bounds, vocab_size=None) -> tuple[float, str]:
  """Smallest kappa under which every element passes the per-element rule |a-b| <= bound_T·moved + kappa·g_T·S_i
  (bounds: tensor -> bound_T; the envelope's, or the fp32 rtol); inf when an element exceeds bound_T·moved + 2·Σlr."""
  zs = zero_grad_slices(spec)
  worst, where = 0.0, ""
  for n in a:
    pa, pb, p0 = (np.asarray(x, np.float64) for x in (a[n], b[n], init[n]))
    mask = np.ones(pa.shape, bool)
    if n in zs:
      mask[slice(*zs[n])] = False
    d = np.abs(pa - pb)[mask]
    moved = max(np.abs(pa - p0)[mask].max(initial=0), np.abs(pb - p0)[mask].max(initial=0))
    exc = d - bounds[n] * moved
    if not np.any(exc > 0):
      continue
    if np.any(exc > 2 * lr_sum):
      return float("inf"), n
    g = noise_scale(n, ma, mb, mask, vocab_size)
    sens = np.maximum(ma["sensitivity"][n], mb["sensitivity"][n]).astype(np.float64)[mask]
    k = float(np.max(exc / np.maximum(g * sens, 1e-300)))
    if k > worst:
      worst, where = k, n
  return worst, where


def envelope_cell(name: str, precision: str, overrides: list[str], perturb: list[str], sides: list[str], steps: int,
                  root: Path) -> dict:
  """One bf16/fp16 compare with the noise envelope; the old (per tensor) and new (per element) params envelope."""
  out = root / name
  shutil.rmtree(out, ignore_errors=True)
  t0 = time.time()
  rep = parity.compare("gpt2-tiny", steps=steps, sides=sides, out=out, perturb=perturb, noise_envelope=True,
                       overrides=[f'train.precision="{precision}"', *overrides], determinism_steps=0)
  spec = from_dict(RunSpec, json.loads((out / "config.json").read_text()))
  init = weights.load(out / "init.safetensors")
  a, b = sides
  checks = rep.data["checks"]
  failing = [c["name"] for c in checks if not c["passed"] and c.get("gating", True)]
  row = {"cell": name, "precision": precision, "overrides": overrides, "perturb": perturb, "sides": sides,
         "steps": steps, "verdict": rep.passed, "wall_s": round(time.time() - t0, 1), "failing": failing}
  fin = {s: out / s / "final.safetensors" for s in sides}
  nfin = {s: out / "noise" / s / "final.safetensors" for s in sides}
  if all(p.exists() for p in (*fin.values(), *nfin.values())):
    finals = {s: weights.load(fin[s]) for s in sides}
    penv = {s: param_ratios(finals[s], weights.load(nfin[s]), init, spec.model) for s in sides}
    moms = {s: read_moments(out / s / FINAL_MOMENTS) for s in sides}
    steps_a = read_steps(out / a / "steps.jsonl")
    lr_sum = float(sum(r["lr"] for r in steps_a if not r.get("skipped")))
    rule = envelope_rule(precision)
    old = envelope_params_check(a, finals[a], b, finals[b], init, spec.model, penv, rule)
    new = envelope_params_check(a, finals[a], b, finals[b], init, spec.model, penv, rule, moments=moms,
                                lr_sum=lr_sum, precision=precision)
    others_pass = all(c["passed"] or not c.get("gating", True) for c in checks if c["metric"] != "params_envelope")
    row.update(old_params_pass=old.passed, old_ratio=old.value, old_bound=old.tolerance, new_params_pass=new.passed,
               new_detail=new.detail, old_detail=old.detail, lr_sum=lr_sum, old_verdict=others_pass and old.passed,
               max_loss_diff=max(abs(x["loss"] - y["loss"])
                                 for x, y in zip(steps_a, read_steps(out / b / "steps.jsonl"))
                                 if not (x.get("skipped") or y.get("skipped"))))
    if moms[a] and moms[b]:
      bounds = {n: rule.factor * max(penv[s].get(n, 0.0) for s in sides) + rule.params_floor for n in finals[a]}
      row["kappa_needed"], row["kappa_worst_tensor"] = envelope_kappa_needed(
          finals[a], finals[b], init, moms[a], moms[b], spec.model, lr_sum, bounds)
  shutil.rmtree(out, ignore_errors=True)
  return row


def envelope_grid(precisions: list[str]) -> list[tuple[str, str, list[str], list[str], list[str]]]:
  """Cells most likely to break first: Constant and WarmupLR (flat lr: a rounding-level element moves ~sum lr)."""
  cells = []
  for sch in ("Constant", "bugs", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
    for prec in precisions:
      if sch == "bugs":  # the default schedule (WarmupCosineLR), where the old rule had no false alarm to hide behind
        cells += [(f"bug-{prec}-{label}", prec, [], [pert], ["jax", "torch"]) for pert, label in ENV_BUGS]
        continue
      extra = ['train.lr_schedule_params={"total_num_steps": 8}'] if sch == "WarmupDecayLR" else []
      for lr in (6e-3, 1e-3, 1e-4):
        cells.append((f"ok-{prec}-{sch}-{lr:g}", prec, [f'train.lr_schedule="{sch}"', f"train.lr={lr}", *extra], [],
                      ["jax", "torch"]))
      if sch in ("Constant", "WarmupLR"):
        cells.append((f"ok-{prec}-ds-{sch}-1e-3", prec, [f'train.lr_schedule="{sch}"'], [], ["jax", "deepspeed"]))
  return cells


def envelope_main(args, precisions: list[str], argv) -> int:
  root = Path("/tmp/params-envelope/bench")
  rows = []
  if args.rescore:  # rows of an earlier run (its JSON, or the JSON lines it printed), scored under today's kappa
    text = Path(args.rescore).read_text()
    rows = (json.loads(text)["rows"] if text.lstrip().startswith("{\n") or text.lstrip().startswith('{"date"')
            else [json.loads(x) for x in text.splitlines() if x.startswith("{")])
    for r in rows:
      r.setdefault("precision", r["cell"].split("-")[1])
      r.setdefault("sides", ["jax", "deepspeed" if "-ds-" in r["cell"] else "torch"])
      k = r.get("kappa_needed")
      if k is None or r["precision"] not in precisions:
        continue
      r["new_params_pass"] = k <= tolerance(r["precision"], "params_grad_noise").rtol
      others = [f for f in r["failing"] if not f.startswith("params_envelope")]
      r["failing"] = others + ([] if r["new_params_pass"] else [f"params_envelope {'~'.join(r['sides'])}"])
      r["verdict"] = not r["failing"]
      r["rescored"] = True
    rows = [r for r in rows if r["precision"] in precisions]
  for name, prec, ov, pert, sides in [] if args.rescore else envelope_grid(precisions):
    if args.only and args.only not in name:
      continue
    try:
      row = envelope_cell(name, prec, ov, pert, sides, args.steps, root)
    except parity.spec.SpecError as exc:
      print(f"{name}: skipped ({exc})", flush=True)
      continue
    rows.append(row)
    print(json.dumps({k: row.get(k) for k in ("cell", "verdict", "old_verdict", "old_params_pass", "new_params_pass",
                                               "kappa_needed", "failing", "wall_s")}), flush=True)
  import deepspeed  # noqa: F401  (versions only)
  import jax
  import torch
  summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
             "versions": {"jax": jax.__version__, "torch": torch.__version__,
                          "deepspeed": sys.modules["deepspeed"].__version__},
             "command": " ".join(["benchmarks/params_rule.py", *(argv if argv is not None else sys.argv[1:])]),
             "kappa": {p: tolerance(p, "params_grad_noise").rtol for p in precisions}, "by_precision": {}, "rows": rows}
  lines = [f"# params envelope rule grid ({summary['date']})", "",
           f"CPU {summary['cpu']}, Python {summary['python']}, {summary['versions']}; gpt2-tiny, {args.steps} steps, "
           f"noise envelope on; kappa {summary['kappa']}. Command: `.venv/bin/python {summary['command']}`", ""]
  if args.rescore:
    lines += [f"Rows re-scored from {args.rescore} (cells run earlier on this machine) under the kappa above: 'new "
              "params' and the new verdict are kappa_needed <= kappa with the other checks as they ran; 'old' columns "
              "as they ran (nan where the log kept no figure).", ""]
  for p in precisions:
    ok = [r for r in rows if r["cell"].startswith(f"ok-{p}-")]
    bugs = [r for r in rows if r["cell"].startswith(f"bug-{p}-")]
    s = {"correct_cells": len(ok), "false_alarms_new": sum(not r.get("new_params_pass", False) for r in ok),
         "false_alarms_old": sum(not r.get("old_params_pass", True) for r in ok),
         "verdict_false_alarms_new": sum(not r["verdict"] for r in ok),
         "verdict_false_alarms_old": sum(not r.get("old_verdict", True) for r in ok),
         "max_kappa_needed_correct": max((r.get("kappa_needed", 0.0) for r in ok), default=0.0),
         "bugs": len(bugs), "bugs_failing_old": sum(not r.get("old_verdict", True) for r in bugs),
         "bugs_failing_new": sum(not r["verdict"] for r in bugs)}
    summary["by_precision"][p] = s
    lines.append(f"{p}: {s['correct_cells']} correct cells; params_envelope false alarms old {s['false_alarms_old']}, "
                 f"new {s['false_alarms_new']} (verdict: old {s['verdict_false_alarms_old']}, new "
                 f"{s['verdict_false_alarms_new']}); largest kappa needed by a correct pair "
                 f"{s['max_kappa_needed_correct']:.3g} (rule {summary['kappa'][p]:.3g}); planted bugs failing the "
                 f"verdict: old {s['bugs_failing_old']}, new {s['bugs_failing_new']} of {s['bugs']}.")
  lines += ["", "| cell | sides | verdict new (old) | old params (ratio / bound) | new params | kappa needed | "
            "max Δloss | failing checks (new) |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['cell']} | {'~'.join(r['sides'])} | {'PASS' if r['verdict'] else 'FAIL'} "
                 f"({'PASS' if r.get('old_verdict') else 'FAIL'}) | {r.get('old_params_pass')} "
                 f"({r.get('old_ratio', float('nan')):.3g} / {r.get('old_bound', float('nan')):.3g}) | "
                 f"{r.get('new_params_pass')} | {r.get('kappa_needed', float('nan')):.3g} | "
                 f"{r.get('max_loss_diff', float('nan')):.2g} | {', '.join(r['failing']) or '-'} |")
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out + ".json").write_text(json.dumps(summary, indent=2, default=str))
  Path(args.out + ".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines[:2 + len(precisions) + 2]))
  return 0


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--quick", action="store_true", help="fewer lr values and schedules x lr (2 busy cores)")
  ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "params_rule"))
  ap.add_argument("--only", default="", help="substring filter on cell names")
  ap.add_argument("--grid", default="rule", choices=("rule", "vocab"), help="rule: schedules x lr x eps and the "
                  "planted bugs; vocab: vocabularies 32,000-151,936 tied/untied, the 2-rank port and the "
                  "planted bugs")
  ap.add_argument("--rescore", default="", help="bf16/fp16: re-score the rows of an earlier run (its .json, or the "
                  "log of JSON lines it printed) under the current params_grad_noise kappa, without rerunning cells")
  ap.add_argument("--precision", default="fp32", help="fp32 (the Adam params rule), or bf16 and/or fp16 comma-"
                  "separated (the noise-envelope params rule, parity.verdict.envelope.envelope_params_check)")
  args = ap.parse_args(argv)
  precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
  if precisions != ["fp32"]:
    if not precisions or not set(precisions) <= {"bf16", "fp16"}:
      ap.error(f"--precision {args.precision!r}: give fp32 alone, or bf16 and/or fp16")
    if args.out == ap.get_default("out"):
      args.out = str(Path(__file__).parent / "results" / "params_rule_envelope")
    return envelope_main(args, precisions, argv)
  if args.grid == "vocab" and args.out == ap.get_default("out"):
    args.out = str(Path(__file__).parent / "results" / "params_rule_vocab")
  root = Path("/tmp/params-rule-bench")
  rows, load0 = [], os.getloadavg()
  todo = (vocab_grid(root) if args.grid == "vocab" else
          [(*c, 256, False, None, 1) for c in grid(args.quick)])
  for name, ov, pert, sides, vocab, spread, config, nproc in todo:
    if args.only and args.only not in name:
      continue
    try:
      row = cell(name, ov, pert, sides, args.steps, root, spread=spread, config=config, nproc=nproc, vocab=vocab)
    except parity.spec.SpecError as exc:  # a schedule that needs parameters this grid does not give
      print(f"{name}: skipped ({exc})", flush=True)
      continue
    rows.append(row)
    print(json.dumps({k: row.get(k) for k in ("cell", "verdict", "old_params_pass", "new_params_pass",
                                               "kappa_needed", "kappa_needed_gT", "failing", "wall_s")}), flush=True)
    write_grid(args, rows, argv, load0)  # after every cell: a grid cut short keeps what ran
  return write_grid(args, rows, argv, load0)


def write_grid(args, rows: list[dict], argv, load0: tuple) -> int:
  """<out>.json and <out>.md of an fp32 grid (the rows of `cell`); load0: os.getloadavg() at the start."""
  import deepspeed  # noqa: F401  (versions only)
  import jax
  import torch
  ok = [r for r in rows if r["cell"].startswith("ok-")]
  bugs = [r for r in rows if r["cell"].startswith("bug-")]
  summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
             "versions": {"jax": jax.__version__, "torch": torch.__version__,
                          "deepspeed": sys.modules["deepspeed"].__version__},
             "command": " ".join(["benchmarks/params_rule.py", *(argv if argv is not None else sys.argv[1:])]),
             "kappa": tolerance("fp32", "params_grad_noise").rtol, "cpus": os.cpu_count(),
             "load_start_end": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
             "false_alarms_new": sum(not r.get("new_params_pass", False) for r in ok),
             "false_alarms_old": sum(not r.get("old_params_pass", True) for r in ok),
             "max_kappa_needed_correct": max((r.get("kappa_needed", 0.0) for r in ok), default=0.0),
             "bugs_caught_new": sum(not r["verdict"] for r in bugs), "bugs": len(bugs), "rows": rows}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out + ".json").write_text(json.dumps(summary, indent=2, default=str))
  lines = [f"# params rule grid ({summary['date']})", "",
           f"CPU {summary['cpu']}, Python {summary['python']}, {summary['versions']}; gpt2-tiny, {args.steps} steps; "
           f"kappa = {summary['kappa']:g}; {summary['cpus']} CPUs, 1-minute load {summary['load_start_end'][0]} at "
           f"the start, {summary['load_start_end'][1]} at the end. Command: `.venv/bin/python {summary['command']}`",
           "",
           f"Correct pairs: {len(ok)} cells, false alarms old rule {summary['false_alarms_old']}, new rule "
           f"{summary['false_alarms_new']}; largest kappa needed by a correct pair "
           f"{summary['max_kappa_needed_correct']:.3g}. Planted bugs failing the verdict: {summary['bugs_caught_new']} "
           f"of {len(bugs)}.", "",
           "| cell | sides | verdict | old params | new params | kappa needed | kappa needed (g_T) | moments gap | "
           "max Δloss | worst other check (value/tol) | memory pred/meas | batches | failing checks |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    other, mem = r.get("other_checks_worst") or ["-", float("nan")], r.get("memory_ratios")
    lines.append(f"| {r['cell']} | {'~'.join(r['sides'])} | {'PASS' if r['verdict'] else 'FAIL'} | "
                 f"{r.get('old_params_pass')} ({r.get('old_ratio', float('nan')):.3g}) | {r.get('new_params_pass')} | "
                 f"{r.get('kappa_needed', float('nan')):.3g} | {r.get('kappa_needed_gT', float('nan')):.3g} | "
                 f"{r.get('moments_gap', float('nan')):.2g} ({r.get('noise_withheld', 0)} withheld) | "
                 f"{r.get('max_loss_diff', float('nan')):.2g} | {other[0].split(' ')[0]} {other[1]:.2g} | "
                 f"{'-' if not mem else f'{mem[0]:.3g}-{mem[1]:.3g}'} | "
                 f"{r.get('batches_dtype', '?')} max {r.get('batches_max_id', '?')} | {', '.join(r['failing']) or '-'} "
                 "|")
  Path(args.out + ".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines[:5]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
