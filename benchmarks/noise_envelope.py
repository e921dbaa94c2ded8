"""Benchmark: noise envelopes by precision, and how far planted bugs sit above them.

For each precision asked for:
  1. `parity.compare` on the preset with every side and the noise envelope on (each side rerun with
     its batches' rows in reverse order; harness.self_runs), as a user would run it;
  2. the plain-torch side rerun with one setting wrong at a time (weight decay off, LayerNorm eps,
     GELU form, grad clip, lr +5%, beta2), each held against the correct torch run with torch's own
     envelope (parity.checks.envelope_check), the same rule the verdict uses.
It prints and writes, per precision: each side's envelope (rms per window), each pair's worst
window ratio rms|Δloss| / rms(envelope), and each bug's ratio, i.e. the margin between what the
rule lets through and what it must catch. The numbers behind parity/tolerances.py ENVELOPE_RULES.

Writes benchmarks/results/<date>-<host>-noise-envelope.json and .md with the machine and versions.

Usage: python benchmarks/noise_envelope.py [--preset gpt2-small-cpu] [--steps 200] [--precisions bf16,fp32]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.runner import run_side  # noqa: E402
from parity import api  # noqa: E402
from parity.checks import windowed_rms  # noqa: E402
from parity.protocol import derive_request, read_steps  # noqa: E402
from parity.tolerances import ENVELOPE_RULES, EnvelopeRule  # noqa: E402

BUGS = {
    "weight decay off": {"train.weight_decay": 0.0},
    "LayerNorm eps 1e-6": {"model.norm_eps": 1e-6},
    "GELU exact (not tanh)": {"model.gelu_approximate": False},
    "grad clip 0.5": {"train.grad_clip": 0.5},
    "lr +5%": "lr",
    "beta2 0.99": {"train.beta2": 0.99},
}


def cpu_name() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _loss(records: list[dict]) -> dict[int, float]:
  return {int(r["step"]): float(r["loss"]) for r in records}


def ratios(a: dict[int, float], b: dict[int, float], envs: list[dict[int, float]], window: int) -> list[float]:
  """Per window: rms|a - b| / max over envs of rms(env), over the steps all share."""
  steps = sorted(set(a) & set(b).intersection(*envs))
  d = windowed_rms(steps, np.array([abs(a[k] - b[k]) for k in steps]), window)
  n = [max(w[2] for w in ws) for ws in zip(*[windowed_rms(steps, np.array([e[k] for k in steps]), window)
                                            for e in envs])]
  return [x[2] / max(y, 1e-300) for x, y in zip(d, n)]


def one_precision(preset: str, steps: int, precision: str, tmp: Path, window: int) -> dict:
  rep = api.compare(preset, steps=steps, overrides=[f'train.precision="{precision}"'], out=tmp / precision,
                    noise_envelope=True, determinism_steps=0)
  d = rep.data
  run_dir = Path(rep.run_dir)
  loss = {s: _loss(read_steps(run_dir / s / "steps.jsonl")) for s in d["sides"]}
  env = {s: dict(zip(e["steps"], e["abs_loss_diff"])) for s, e in d["noise_envelope"]["sides"].items()}
  out = {"verdict": d["verdict"]["message"], "rule": d["noise_envelope"]["rule"],
         "envelopes": {s: {"max": max(e.values()), "rms_per_window": [w[2] for w in windowed_rms(
             sorted(e), np.array([e[k] for k in sorted(e)]), window)]} for s, e in env.items()},
         "pairs": {}, "bugs": {}, "checks": [c for c in d["checks"] if c["metric"] == "loss_envelope"]}
  names = list(loss)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      r = ratios(loss[a], loss[b], [env[x] for x in (a, b) if x in env], window)
      out["pairs"][f"{a}~{b}"] = {"worst_ratio": max(r), "median_ratio": float(np.median(r)), "per_window": r,
                                  "max_abs_dloss": max(abs(loss[a][k] - loss[b][k]) for k in loss[a] if k in loss[b])}
  lr = d["run"]["train"]["lr"]
  if "torch" in loss and "torch" in env:
    for j, (name, pert) in enumerate(BUGS.items()):
      pert = {"train.lr": lr * 1.05} if pert == "lr" else pert
      sub = f"bug{j}"
      req_path = derive_request(run_dir, sub)
      req = json.loads(req_path.read_text())
      req["perturb"] = {"torch": pert}
      req_path.write_text(json.dumps(req, indent=2))
      sr = run_side(run_dir / sub, "torch", timeout_s=3600)
      bug = _loss(read_steps(run_dir / sub / "torch" / "steps.jsonl"))
      r = ratios(loss["torch"], bug, [env["torch"]], window) if sr.status == "ok" else []
      out["bugs"][name] = {"perturb": pert, "status": sr.status, "worst_ratio": max(r) if r else None,
                           "per_window": r, "max_abs_dloss": max((abs(loss["torch"][k] - bug[k]) for k in bug
                                                                  if k in loss["torch"]), default=None)}
  return out


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="gpt2-small-cpu")
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--precisions", default="bf16")
  ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
  args = ap.parse_args()
  tmp = Path(tempfile.mkdtemp(prefix="parity-noise-"))
  import importlib.metadata as md
  versions = {p: md.version(p) for p in ("torch", "deepspeed", "jax", "jaxlib", "flax", "optax")}
  result = {"date": dt.date.today().isoformat(), "host": {"cpu": cpu_name(), "platform": platform.platform()},
            "versions": versions, "preset": args.preset, "steps": args.steps, "precisions": {}}
  for p in args.precisions.split(","):
    rule: EnvelopeRule = ENVELOPE_RULES[p]
    result["precisions"][p] = one_precision(args.preset, args.steps, p, tmp, rule.window)
  stamp = f"{result['date']}-{platform.node() or 'host'}-noise-envelope"
  res = Path(args.results)
  res.mkdir(parents=True, exist_ok=True)
  (res / f"{stamp}.json").write_text(json.dumps(result, indent=2))
  lines = [f"# Noise envelopes and planted bugs ({args.preset}, {args.steps} steps)", "",
           f"{result['date']}, {result['host']['cpu']}, " + ", ".join(f"{k} {v}" for k, v in versions.items()),
           f"Command: `python benchmarks/noise_envelope.py --preset {args.preset} --steps {args.steps} "
           f"--precisions {args.precisions}`", ""]
  for p, r in result["precisions"].items():
    lines += [f"## {p}", "", f"Verdict of the compare: {r['verdict']}", "",
              f"Rule: per window of {r['rule']['window']} steps, rms|Δloss| ≤ {r['rule']['factor']:g} × rms(envelope) "
              f"+ {r['rule']['floor']:g}.", "", "| envelope of | max |Δloss| | rms per window (first, median, max) |",
              "|---|---|---|"]
    for s, e in r["envelopes"].items():
      w = e["rms_per_window"]
      lines.append(f"| {s} | {e['max']:.3g} | {w[0]:.2g}, {float(np.median(w)):.2g}, {max(w):.2g} |")
    lines += ["", "| pair / planted bug (torch vs torch) | max |Δloss| | worst window ratio | median ratio |", "|---|---|---|---|"]
    for k, x in r["pairs"].items():
      lines.append(f"| {k} | {x['max_abs_dloss']:.3g} | {x['worst_ratio']:.1f} | {x['median_ratio']:.1f} |")
    for k, x in r["bugs"].items():
      wr = "n/a" if x["worst_ratio"] is None else f"{x['worst_ratio']:.1f}"
      med = "n/a" if not x["per_window"] else f"{float(np.median(x['per_window'])):.1f}"
      lines.append(f"| bug: {k} | {x['max_abs_dloss']:.3g} | {wr} | {med} |")
    lines.append("")
  (res / f"{stamp}.md").write_text("\n".join(lines))
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
