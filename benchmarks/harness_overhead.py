"""Benchmark: the cost of the harness itself, and of JAX host offload, on the default preset.

Runs, as a user would:
  1. `parity compare` (default preset, all three sides) and times the whole command;
     overhead = wall time / sum over sides of (init_s + compile_s + train_s); target <= 1.15.
  2. the JAX side alone with optimizer-state offload on and off (`--sides jax`,
     `--set jax.offload_opt_state=...`), `--repeats` times each, interleaved;
     ratio = median tokens/s with offload / without; target >= 0.97 on CPU.
Writes benchmarks/results/<date>-<host>.json and .md with the machine and versions.

Usage: python benchmarks/harness_overhead.py [--preset gpt2-small-cpu] [--steps N] [--repeats 3]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from parity.environment import cpu_model  # noqa: E402


def run_compare(out: Path, extra: list[str]) -> tuple[float, dict]:
  cmd = [sys.executable, "-m", "parity.cli", "compare", "--out", str(out), "--no-progress", *extra]
  t0 = time.time()
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  wall = time.time() - t0
  if not (out / "report.json").exists():
    raise SystemExit(f"no report from {' '.join(cmd)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
  return wall, json.loads((out / "report.json").read_text())


def cpu_name() -> str:
  """The CPU model (parity.environment.cpu_model), else the machine type."""
  return cpu_model() or platform.machine()


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="gpt2-small-cpu")
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
  args = ap.parse_args()
  base = ["--preset", args.preset] + (["--steps", str(args.steps)] if args.steps else [])
  tmp = Path(tempfile.mkdtemp(prefix="parity-bench-"))
  wall, rep = run_compare(tmp / "compare", base)
  sides = {}
  for name, s in rep["sides"].items():
    summ = s["summary"]
    sides[name] = {k: summ.get(k) for k in ("status", "tokens_per_s", "init_s", "compile_s", "train_s",
                                            "peak_host_rss_bytes", "peak_device_bytes", "state_bytes_by_memory_kind",
                                            "state_memory_kinds")}
  busy = sum(sum(float(v[k] or 0) for k in ("init_s", "compile_s", "train_s")) for v in sides.values())
  offload = {"on": [], "off": []}
  for i in range(args.repeats):
    for mode in ("on", "off"):
      flag = "true" if mode == "on" else "false"
      _, r = run_compare(tmp / f"jax-{mode}-{i}", base + ["--sides", "jax", "--set", f"jax.offload_opt_state={flag}"])
      offload[mode].append(r["sides"]["jax"]["summary"]["tokens_per_s"])
  ratio = statistics.median(offload["on"]) / statistics.median(offload["off"])
  loss_pairs = {c["name"]: c["value"] for c in rep["checks"] if c["metric"] == "loss"}
  result = {
      "date": dt.date.today().isoformat(),
      "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "platform": platform.platform(), "gpu": None},
      "versions": rep["environment"]["versions"], "python": rep["environment"]["python"],
      "preset": args.preset, "steps": rep["run"]["train"]["steps"], "verdict": rep["verdict"]["message"],
      "compare_wall_s": wall, "sides_busy_s": busy, "harness_overhead_ratio": wall / busy,
      "harness_overhead_target": 1.15, "sides": sides, "max_abs_loss_diff": loss_pairs,
      "jax_offload_tokens_per_s": offload, "jax_offload_ratio": ratio, "jax_offload_ratio_target": 0.97,
  }
  out = Path(args.results)
  out.mkdir(parents=True, exist_ok=True)
  stem = f"{result['date']}-{platform.node() or 'host'}-cpu{os.cpu_count()}-{args.preset}"
  (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
  md = [f"# Harness overhead and JAX offload cost — {result['date']}", "",
        f"Machine: {result['machine']['cpu']}, {os.cpu_count()} CPUs, no GPU; {result['machine']['platform']}",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
        f"Preset `{args.preset}`, {result['steps']} steps. Verdict: {result['verdict']}", "",
        f"- `parity compare` wall time: {wall:.1f} s; sides busy (init + compile + train): {busy:.1f} s; "
        f"**overhead ratio {wall / busy:.3f}** (target ≤ 1.15)",
        f"- JAX tokens/s with optimizer-state offload ÷ without: **{ratio:.3f}** (target ≥ 0.97; medians of "
        f"{args.repeats} runs each: on {offload['on']}, off {offload['off']})", "",
        "| side | status | tokens/s | init s | compile s | train s | peak RSS MiB |", "|---|---|---|---|---|---|---|"]
  for n, s in sides.items():
    md.append(f"| {n} | {s['status']} | {s['tokens_per_s'] or 0:,.0f} | {s['init_s'] or 0:.1f} | "
              f"{s['compile_s'] or 0:.2f} | {s['train_s'] or 0:.1f} | {(s['peak_host_rss_bytes'] or 0) / 2**20:.0f} |")
  md += ["", "Max |Δloss| per pair: " + ", ".join(f"{k}: {v:.2e}" for k, v in loss_pairs.items())]
  (out / f"{stem}.md").write_text("\n".join(md) + "\n")
  print("\n".join(md))
  return 0


if __name__ == "__main__":
  sys.exit(main())
