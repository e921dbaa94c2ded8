"""Every plan pair of parity.sizing.plans.PLANS under `parity compare`, on this machine (CPU, or a GPU node's).

For each pair: the verdict, max |Δloss| between the sides, each side's median step time and tokens/s,
and the memory model's prediction against the bytes measured on the live state (report.json
`measured.predicted_vs_measured`). Writes benchmarks/results/<date>-<host>-<gpu or cpuN>-plan-pairs[-<sides>-n<N>]
.{json,md} (no suffix for the default sides on one rank).

With `fsdp` among --sides only the pairs that have an FSDP2 plan run (the others are listed as skipped, with the
reason): `--sides jax,deepspeed,fsdp` is the FSDP2 check of a GPU node (CUDA + nccl), the same runs as on the CPU.

Usage: python benchmarks/plan_pairs.py [--preset gpt2-tiny] [--steps 8] [--sides jax,deepspeed] [--nproc N]
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
from parity.sizing.plans import PLANS, fsdp_missing_reason  # noqa: E402


def gpu_name() -> str | None:
  """The first GPU's name from nvidia-smi, or None (no driver, no GPU)."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=30).stdout.strip().splitlines()
  except (OSError, subprocess.SubprocessError):
    return None
  return out[0].strip() if out else None


def markdown(result: dict) -> list[str]:
  """The .md lines of one result (the .json's dict)."""
  md = [f"# Plan pairs under `parity compare` — {result['date']}", "",
        f"{result['machine']['platform']}, {result['machine']['cpu_count']} CPUs, "
        f"{result['machine']['gpu'] or 'no GPU'}. Preset `{result['preset']}`, {result['steps']} steps, sides "
        f"{result['sides']}, {result['nproc']} rank(s) per side. Versions: "
        + ", ".join(f"{k} {v}" for k, v in result['versions'].items()), "",
        "| plan | exit | max abs loss diff | step s (per side) | JAX state memory kinds | predicted = measured bytes |",
        "|---|---|---|---|---|---|"]
  for r in result['rows']:
    st = ", ".join(f"{s} {v:.3f}" for s, v in (r.get("step_time_s") or {}).items() if v)
    mem = r.get("memory") or []
    exact = sum(1 for m in mem if m["predicted"] == m["measured"])
    kinds = ", ".join(f"{k}: {v}" for k, v in (r.get("jax_state_memory_kinds") or {}).items())
    diff = r.get("max_abs_loss_diff")
    if r["exit"] is None:  # not run: the reason
      md.append(f"| `{r['plan']}` | {r['verdict']} | | | | |")
      continue
    md.append(f"| `{r['plan']}` | {r['exit']} | {diff if diff is None else format(diff, '.2e')} | {st} | {kinds} "
              f"| {exact} of {len(mem)} rows |")
  md += ["", "Rows that differ (predicted vs measured):", ""]
  for r in result['rows']:
    for m in r.get("memory") or []:
      if m["predicted"] != m["measured"]:
        md.append(f"- `{r['plan']}` {m['side']} {m['category']} {m['memory_kind']}: predicted {m['predicted']:,} B, "
                  f"measured {m['measured']:,} B (ratio {m['ratio']:.3f})")
  return md


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="gpt2-tiny")
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--sides", default="jax,deepspeed")
  ap.add_argument("--nproc", type=int, default=1, help="ranks per side (parity compare --nproc)")
  ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
  args = ap.parse_args()
  tmp = Path(tempfile.mkdtemp(prefix="parity-plans-"))
  rows = []
  for name, pair in PLANS.items():
    out = tmp / name
    if "fsdp" in args.sides.split(",") and pair.fsdp is None:
      rows.append({"plan": name, "exit": None, "verdict": f"skipped: {fsdp_missing_reason(pair)}"})
      continue
    cmd = [sys.executable, "-m", "parity.cli", "compare", "--preset", args.preset, "--steps", str(args.steps),
           "--sides", args.sides, "--plan", name, "--out", str(out), "--no-progress",
           "--determinism-steps", "0", "--nproc", str(args.nproc)]
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
  first = next((tmp / r["plan"] / "report.json" for r in rows if (tmp / r["plan"] / "report.json").exists()), None)
  versions = json.loads(first.read_text())["environment"]["versions"] if first is not None else {}
  gpu = gpu_name()
  result = {"date": dt.date.today().isoformat(),
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "gpu": gpu}, "versions": versions, "preset": args.preset, "steps": args.steps, "sides": args.sides,
            "nproc": args.nproc, "rows": rows}
  out = Path(args.results)
  out.mkdir(parents=True, exist_ok=True)
  where = (gpu or "").replace(" ", "-") or f"cpu{os.cpu_count()}"
  extra = "" if args.sides == "jax,deepspeed" and args.nproc == 1 else f"-{args.sides.replace(',', '-')}-n{args.nproc}"
  stem = f"{result['date']}-{platform.node() or 'host'}-{where}-plan-pairs{extra}"
  (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
  md = markdown(result)
  (out / f"{stem}.md").write_text("\n".join(md) + "\n")
  print("\n".join(md))
  return 0


if __name__ == "__main__":
  sys.exit(main())
