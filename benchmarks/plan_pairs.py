"""Every DeepSpeed <-> JAX plan pair of parity.sizing.plans.PLANS under `parity compare`, on CPU.

For each pair: the verdict, max |Δloss| between the sides, each side's median step time and tokens/s,
and the memory model's prediction against the bytes measured on the live state (report.json
`measured.predicted_vs_measured`). Writes benchmarks/results/<date>-<host>-plan-pairs.{json,md}.

Usage: python benchmarks/plan_pairs.py [--preset gpt2-tiny] [--steps 8] [--sides jax,deepspeed]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from parity.sizing.plans import PLANS  # noqa: E402


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="gpt2-tiny")
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--sides", default="jax,deepspeed")
  ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
  args = ap.parse_args()
  tmp = Path(tempfile.mkdtemp(prefix="parity-plans-"))
  rows = []
  for name in PLANS:
    out = tmp / name
    cmd = [sys.executable, "-m", "parity.cli", "compare", "--preset", args.preset, "--steps", str(args.steps),
           "--sides", args.sides, "--plan", name, "--out", str(out), "--no-progress",
           "--determinism-steps", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if not (out / "report.json").exists():
      rows.append({"plan": name, "exit": proc.returncode, "verdict": proc.stderr.strip()[-300:]})
      print(name, "no report:", proc.stderr[-300:], flush=True)
      continue
    rep = json.loads((out / "report.json").read_text())
    loss = [c for c in rep["checks"] if c["metric"] == "loss"]
    mem = [m for m in rep["memory"]["predicted_vs_measured"] if m["predicted"] and m["measured"] is not None]
    rows.append({
        "plan": name, "exit": proc.returncode, "verdict": rep["verdict"]["message"],
        "max_abs_loss_diff": max((c["value"] for c in loss if c["value"] is not None), default=None),
        "step_time_s": {s: v["summary"].get("step_time_s_median") for s, v in rep["sides"].items()},
        "tokens_per_s": {s: v["summary"].get("tokens_per_s") for s, v in rep["sides"].items()},
        "jax_state_memory_kinds": rep["sides"].get("jax", {}).get("summary", {}).get("state_memory_kinds"),
        "memory": [{k: m[k] for k in ("side", "category", "memory_kind", "predicted", "measured", "ratio")}
                   for m in mem],
    })
    print(name, rows[-1]["verdict"], rows[-1]["max_abs_loss_diff"], flush=True)
  versions = json.loads((tmp / next(iter(PLANS)) / "report.json").read_text())["environment"]["versions"] \
      if (tmp / next(iter(PLANS)) / "report.json").exists() else {}
  result = {"date": dt.date.today().isoformat(), "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "gpu": None}, "versions": versions, "preset": args.preset, "steps": args.steps, "sides": args.sides,
            "rows": rows}
  out = Path(args.results)
  out.mkdir(parents=True, exist_ok=True)
  stem = f"{result['date']}-{platform.node() or 'host'}-cpu{os.cpu_count()}-plan-pairs"
  (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
  md = [f"# Plan pairs under `parity compare` — {result['date']}", "",
        f"{platform.platform()}, {os.cpu_count()} CPUs, no GPU. Preset `{args.preset}`, {args.steps} steps, sides "
        f"{args.sides}. Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
        "| plan | exit | max abs loss diff | step s (per side) | JAX state memory kinds | predicted = measured bytes |",
        "|---|---|---|---|---|---|"]
  for r in rows:
    st = ", ".join(f"{s} {v:.3f}" for s, v in (r.get("step_time_s") or {}).items() if v)
    mem = r.get("memory") or []
    exact = sum(1 for m in mem if m["predicted"] == m["measured"])
    kinds = ", ".join(f"{k}: {v}" for k, v in (r.get("jax_state_memory_kinds") or {}).items())
    diff = r.get("max_abs_loss_diff")
    md.append(f"| `{r['plan']}` | {r['exit']} | {diff if diff is None else format(diff, '.2e')} | {st} | {kinds} "
              f"| {exact} of {len(mem)} rows |")
  md += ["", "Rows that differ (predicted vs measured):", ""]
  for r in rows:
    for m in r.get("memory") or []:
      if m["predicted"] != m["measured"]:
        md.append(f"- `{r['plan']}` {m['side']} {m['category']} {m['memory_kind']}: predicted {m['predicted']:,} B, "
                  f"measured {m['measured']:,} B (ratio {m['ratio']:.3f})")
  (out / f"{stem}.md").write_text("\n".join(md) + "\n")
  print("\n".join(md))
  return 0


if __name__ == "__main__":
  sys.exit(main())
