"""Does offload change a value? Every JAX offload plan of parity.sizing.plans.PLANS, with and without scan_layers,
trained for a few fp32 steps beside its device-memory twin (jax_impl.offload_equality): params and Adam moments must be
bitwise equal. On CPU the in-jit moves lower to nothing; on a TPU or GPU they are real, so a stale or misplaced
offloaded buffer shows here as a difference. `--control` adds the positive control: the planted stale residual
('offload_residual_stale') on the offload remat plans, which must come back NOT bitwise.

  python benchmarks/offload_equality.py [--steps 3] [--plans NAME,...] [--control] [--out FILE.json]

Prints one line per plan; exit 0 when every plan is bitwise (and every control is not), 1 otherwise, 2 on an unknown
plan name.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _line(row: dict) -> str:
  what = "bitwise" if row["bitwise"] else (
      f"param max |diff| {row['max_abs_param_diff']:.3g} ({row['worst_param']}), "
      f"moment max |diff| {row['max_abs_moment_diff']:.3g} ({row['worst_moment']})")
  return f"{row['plan']:<32} vs {row['reference'] or 'itself'}: {what}"


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=3, help="fp32 optimizer steps per run (default 3)")
  ap.add_argument("--plans", default="", help="comma-separated names out of the offload plans (default: all)")
  ap.add_argument("--control", action="store_true", help="also run the planted stale residual (must differ)")
  ap.add_argument("--out", type=Path, help="write the rows as JSON here")
  args = ap.parse_args(argv)
  import jax
  from jax_impl import remat
  from jax_impl.offload_equality import offload_equality, offload_plans
  from parity.sizing.plans import PLANS
  plans = offload_plans({n: p.jax for n, p in PLANS.items()}, len(jax.devices()))
  if args.plans:
    unknown = [n for n in args.plans.split(",") if n not in plans]
    if unknown:
      print(f"offload_equality: unknown plan {', '.join(unknown)}; one of {', '.join(plans)}", file=sys.stderr)
      return 2
    plans = {n: plans[n] for n in args.plans.split(",")}
  rows = offload_equality(plans, args.steps)
  control = []
  if args.control:
    act = {n: p for n, p in plans.items() if p.remat in remat.OFFLOAD_POLICIES}
    control = offload_equality(act, args.steps, plants=frozenset({"offload_residual_stale"}))
  print(f"{jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}, {args.steps} fp32 steps")
  for row in rows:
    print(_line(row))
  for row in control:
    print("control (planted stale residual) " + _line(row))
  if args.out:
    args.out.write_text(json.dumps({"backend": jax.default_backend(), "jax": jax.__version__, "steps": args.steps,
                                    "rows": rows, "control": control}, indent=1))
  return 0 if all(r["bitwise"] for r in rows) and not any(r["bitwise"] for r in control) else 1


if __name__ == "__main__":
  sys.exit(main())
