"""`parity diagnose`: arguments, the call into parity.diagnose.diagnose, the first-difference printout."""
from __future__ import annotations

import argparse
from pathlib import Path

from parity.cli._common import add_allow_large, add_run_source, console, float_arg, int_arg, split_list
from parity.overrides import parse_overrides
from parity.diagnose import diagnose

__all__ = ["register"]


def register(sub) -> None:
  """Adds `diagnose` to the subparsers `sub`."""
  p = sub.add_parser("diagnose",
                     help="one step on identical weights and batch: the first tensor where two sides differ",
                     description="Runs one training step of two sides on the same initial weights and batch, "
                                 "records every forward intermediate, gradient and the first update, and names "
                                 "the first tensor that breaks tolerance (docs/diagnose.md). Exit 0: no tensor "
                                 "differs; 1: one does (or a side failed); 2: bad input.")
  add_run_source(p, set_example="--set model.n_layers=2")
  p.add_argument("--hf-model", metavar="DIR", help="a local Hugging Face checkpoint folder (model spec and weights; "
                                                   "default: seeded initial weights)")
  p.add_argument("--step", type=int_arg, default=0,
                 help="batch (batches.npy[STEP]) and lr position to diagnose (default 0)")
  p.add_argument("--sides", default="jax,torch", help="reference,candidate (default jax,torch)")
  p.add_argument("--perturb", action="append", default=[], metavar="SIDE:KEY=VALUE",
                 help="change one side on purpose, e.g. jax:model.norm_eps=1e-6 (default: none)")
  p.add_argument("--plant", action="append", default=[], metavar="SIDE:KIND",
                 help="plant a bug in one side: no_causal_mask, transpose=<square weight>, offset=<tensor> (0.05 added "
                      "to it), decay_all (default: none)")
  p.add_argument("--out", help="output folder (default runs/<time>-diagnose-<hash>)")
  p.add_argument("--timeout", type=float_arg, default=600.0, help="per-side wall-clock limit in seconds (default 600)")
  add_allow_large(p)
  p.set_defaults(handler=run_diagnose)


def run_diagnose(args: argparse.Namespace) -> int:
  """`parity diagnose`: runs parity.diagnose.diagnose and prints its verdict. Returns its exit code."""
  from rich.markup import escape  # rich: loaded when something is printed
  con = console()
  res = diagnose(args.preset, config=args.config, overrides=parse_overrides(args.overrides), hf_model=args.hf_model,
                 step=args.step, sides=split_list(args.sides), perturb=args.perturb, plants=args.plant, out=args.out,
                 timeout_s=args.timeout)
  a, b = res.sides
  con.print(f"parity diagnose — {res.run_dir}: {a} vs {b}, step {res.step} "
            f"(update at lr position {res.lr_step}, lr {res.lr:.3g})")
  f = res.first
  if f is not None:
    con.print(f"[bold red]FIRST DIFFERENCE: {f.name}[/bold red] ({f.kind}, shape {list(f.shape)})")
    for side, where in f.where.items():
      con.print(f"  {side}: {escape(str(where))}")
    con.print(f"  max abs error {f.max_abs_err:.3g}, max rel error {f.max_rel_err:.3g} (scale {f.scale:.3g})")
    con.print(f"  worst element {f.worst_index}: {a} {f.ref_value}, {b} {f.cand_value}; |Δ| {f.worst_abs_err:.3g} "
              f"> tolerance {f.tolerance:.3g}")
    if f.note:
      con.print(f"  {escape(f.note)}")
  style = "bold green" if res.passed else "bold red"
  con.print(f"[{style}]{'PASS' if res.passed else 'FAIL'}: {escape(res.message)}[/{style}]", soft_wrap=True)
  con.print(f"diagnose: {Path(res.run_dir) / 'diagnose.md'} (also diagnose.json)")
  return res.exit_code
