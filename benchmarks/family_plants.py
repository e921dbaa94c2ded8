"""Benchmark: how far each planted model-family porting bug sits above the check that catches it.

Each cell is one `parity.compare` of a family preset with one family plant (parity.protocol.layout.FAMILY_PLANT_KEYS)
on one side, plus the correct run of each preset and precision. Per cell it records the verdict, the first failing
check and its step, and every gating check's margin value / tolerance (for a noise-envelope check: the worst window's
rms difference over its bound). A plant is caught well when it FAILs at step 0 (the semantics card) or with a margin
of at least 3x; a correct run passes with every margin below 1.

Writes benchmarks/results/<date>-<host>-family-plants.json and .md with the machine and versions.

Usage: python benchmarks/family_plants.py [--only NAME,...] [--sides jax,torch] [--tag TAG]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness_overhead import cpu_name  # noqa: E402
from parity.environment import package_versions  # noqa: E402
from parity.pipeline import compare as api  # noqa: E402

CELLS = {
    # name: (preset, precision, perturbation or None)
    "qwen3 qk-norm after rotary fp32": ("qwen3-tiny", "fp32", "torch:qk_norm_after_rope=true"),
    "gemma3 qk-norm after rotary fp32": ("gemma3-tiny", "fp32", "torch:qk_norm_after_rope=true"),
    "gemma2 attn soft-cap skipped fp32": ("gemma2-tiny", "fp32", "torch:attn_softcap_skipped=true"),
    "gemma2 final soft-cap skipped fp32": ("gemma2-tiny", "fp32", "torch:final_softcap_skipped=true"),
    "qwen3 qk-norm after rotary bf16": ("qwen3-tiny", "bf16", "torch:qk_norm_after_rope=true"),
    "gemma2 attn soft-cap skipped bf16": ("gemma2-tiny", "bf16", "torch:attn_softcap_skipped=true"),
    "gemma2 final soft-cap skipped bf16": ("gemma2-tiny", "bf16", "torch:final_softcap_skipped=true"),
    "gemma2 (1+w) rounding bf16": ("gemma2-tiny", "bf16", "torch:norm_plus_one_rounded=true"),
    "gemma3 (1+w) rounding bf16": ("gemma3-tiny", "bf16", "torch:norm_plus_one_rounded=true"),
    "gemma2 correct bf16": ("gemma2-tiny", "bf16", None),
    "gemma2 correct bf16 without soft-caps": ("gemma2-tiny", "bf16", "no-caps"),
    "gemma3 correct bf16": ("gemma3-tiny", "bf16", None),
    "qwen3 correct bf16": ("qwen3-tiny", "bf16", None),
}


AT_LEAST = ("completed", "updates")
"""Checks that pass when value >= tolerance (steps run, updates compared): no margin to report."""


GRID = {f"{name} correct {prec}": (name, prec, None) for name in ("gpt2-tiny", "llama3-tiny", "qwen3-tiny",
                                                                    "gemma2-tiny", "gemma3-tiny")
        for prec in ("fp32", "bf16")}
"""--grid: the correct runs of the family presets in both precisions (run with --sides jax,deepspeed,torch)."""


def _margins(checks) -> list[dict]:
  """Every gating check with a finite value and tolerance: name, value / tolerance, passed, first failing step."""
  out = []
  for c in checks:
    r = _ratio(c)
    if c.get("gating", True) and r is not None and c["metric"] not in AT_LEAST:
      out.append({"check": c["name"], "ratio": r, "passed": c["passed"], "step": c.get("first_failing_step"),
                  "value": c["value"], "tolerance": c["tolerance"], "noise_ratio": _noise_ratio(c)})
  return sorted(out, key=lambda m: -m["ratio"])


def run_cell(name: str, sides: list[str], base: Path) -> dict:
  preset, precision, change = {**CELLS, **GRID}[name]
  overrides = {"train.precision": precision}
  perturb = []
  if change == "no-caps":
    overrides.update({"model.attn_softcap": None, "model.final_softcap": None})
  elif change:
    perturb = [change]
  t0 = time.time()
  rep = api.compare(preset, sides=sides, overrides=overrides, perturb=perturb, out=base / name.replace(" ", "_"),
                    determinism_steps=0, progress=False, train_anyway_on_card_diff=True)
  failing = [c for c in rep.checks if c.get("gating", True) and not c["passed"]]
  first = min(failing, key=lambda c: c["first_failing_step"] if c.get("first_failing_step") is not None else 10**9) \
      if failing else None
  margins = _margins(rep.checks)
  return {"name": name, "preset": preset, "precision": precision, "change": change, "passed": rep.passed,
          "first_failure": None if first is None else {"check": first["name"], "step": first.get("first_failing_step"),
                                                       "ratio": _ratio(first)},
          "semantics_step0": next((c["detail"] for c in rep.checks if c["metric"] == "semantics" and not c["passed"]),
                                  None),
          "worst": margins[0] if margins else None, "margins": margins[:8], "wall_s": round(time.time() - t0, 1)}


def _noise_ratio(c: dict) -> float | None:
  """For a per-step noise-envelope check: the pair's worst-window rms difference over the envelope's rms there, raw
  (no factor, no floor: bound = factor x envelope + floor, parity.verdict.tolerances.ENVELOPE_RULES); else None."""
  from parity.verdict.tolerances import envelope_rule
  metric = c["metric"]
  if metric not in ("loss_envelope", "grad_norm_envelope", "val_loss_envelope"):
    return None
  rule = envelope_rule("bf16")
  floor = rule.grad_norm_floor if metric == "grad_norm_envelope" else rule.floor
  env = (float(c["tolerance"]) - floor) / rule.factor
  return float(c["value"]) / env if env > 0 else None


def _ratio(c: dict) -> float | None:
  """value / tolerance of a report.json check; None where either is missing, zero or not a number."""
  try:
    r = float(c["value"]) / float(c["tolerance"])
  except (TypeError, ValueError, ZeroDivisionError):
    return None
  return r if r == r else None


def markdown(rows: list[dict], meta: dict) -> str:
  lines = [f"# Family plants: margins ({meta['date']})", "",
           f"Machine: {meta['machine']}; Python {meta['python']}; {meta['versions']}. Code: {meta['commit']}. "
           f"Sides {', '.join(meta['sides'])}; `python benchmarks/family_plants.py{meta['args']}`.", "",
           "| cell | verdict | first failing check (step) | its margin | largest margin (check) | semantics card |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    ff = r["first_failure"]
    first = f"{ff['check']} ({ff['step']})" if ff else "-"
    fr = f"{ff['ratio']:.3g}x" if ff and ff["ratio"] is not None else "-"
    w = r["worst"]
    worst = f"{w['ratio']:.3g}x ({w['check']})" if w else "-"
    card = (r["semantics_step0"] or "agree").replace("semantics: ", "").replace("|", "/")
    card = card if len(card) < 90 else card[:87] + "..."
    lines.append(f"| {r['name']} | {'PASS' if r['passed'] else 'FAIL'} | {first} | {fr} | {worst} | {card} |")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", default="", help="comma-separated cell names (default: all)")
  ap.add_argument("--sides", default="jax,torch")
  ap.add_argument("--tag", default="", help="suffix of the result files")
  ap.add_argument("--grid", action="store_true", help="the correct runs of GRID instead of CELLS")
  args = ap.parse_args(argv)
  names = [n.strip() for n in args.only.split(",") if n.strip()] or list(GRID if args.grid else CELLS)
  sides = args.sides.split(",")
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      rows.append(run_cell(name, sides, Path(tmp)))
      print(json.dumps(rows[-1]), flush=True)
  import subprocess
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
  versions = ", ".join(f"{k} {v}" for k, v in package_versions().items() if v)
  meta = {"date": dt.date.today().isoformat(), "machine": f"{platform.node()} ({cpu_name()})",
          "python": platform.python_version(), "versions": versions, "commit": commit.strip(), "sides": sides,
          "args": "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))}
  stem = ROOT / "benchmarks" / "results" / f"{meta['date']}-family-plants{('-' + args.tag) if args.tag else ''}"
  stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  stem.with_suffix(".md").write_text(markdown(rows, meta))
  print(markdown(rows, meta))


if __name__ == "__main__":
  main()
