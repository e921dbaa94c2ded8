"""The `parity` command line.

  parity compare [--preset NAME] [--config FILE] [--set key=value ...] [--steps N] [--sides a,b,c]
                 [--data SRC] [--out DIR] [--perturb side:key=value ...] [--timeout S]
  parity port CONFIG ...           (DeepSpeed config -> JAX config; see `parity port -h`)
  parity convert-weights SRC DST   (Hugging Face folder <-> canonical safetensors <-> orbax)
  parity estimate [--model llama-7b] [--plan NAME]   (memory model, both sides, vs DeepSpeed's estimators)
  parity plan --model llama-7b --hardware H100       (fastest plan pair that fits)
  parity diagnose [--preset NAME | --config FILE | --hf-model DIR] [--step N] [--sides jax,torch]
                  [--perturb side:key=value ...] [--plant side:kind ...] [--out DIR]
                                   (one step, both sides: the first tensor that differs)
  parity build-ops [OP ...]        (build DeepSpeed's C++ ops once, up front)
  parity report RUN_DIR            (print the summary of a finished run)
  parity presets                   (list the built-in presets)

Exit codes: 0 parity holds / success, 1 parity does not hold, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parity.data import DataError
from parity.inputs import count_arg
from parity.run import RunIOError
from parity.spec import DEFAULT_PRESET, PRESETS, SpecError, parse_overrides, to_dict

__all__ = ["main"]

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2

try:
  from parity.migrate import PortError as _PortError
except ImportError:  # pydantic/hjson missing: `parity port` is unavailable, compare still works
  class _PortError(ValueError):
    pass


def _console():
  from rich.console import Console
  con = Console(highlight=False)
  if not con.is_terminal:  # logs and CI: do not squeeze the tables into 80 columns
    con = Console(highlight=False, width=160)
  return con


def _add_compare(sub) -> None:
  p = sub.add_parser("compare", help="run every side on identical data and weights and check parity",
                     description="Runs JAX (Flax+Optax, host offload), DeepSpeed (ZeRO) and plain PyTorch on "
                                 "the same data and initial weights, each in its own process, and checks parity.")
  p.add_argument("--preset", default=None, help=f"built-in run (default {DEFAULT_PRESET}); see `parity presets`")
  p.add_argument("--config", help="run config file (YAML or JSON) merged over the preset")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="dotted override, e.g. --set train.lr=3e-4 --set jax.offload_params=true")
  p.add_argument("--plan", help="a DeepSpeed <-> JAX plan pair (see `parity plan`; e.g. zero3-offload-all), "
                                 "or 'auto': the fastest pair that fits --hardware by the memory model")
  p.add_argument("--hardware", default="H100", help="accelerator preset for --plan auto (A100-40, A100-80, H100, H200, GH200)")
  p.add_argument("--steps", type=count_arg, help="optimizer steps (train.steps)")
  p.add_argument("--sides", help="comma-separated sides, first is the reference (default jax,deepspeed,torch)")
  p.add_argument("--data", help="corpus: 'stdlib', a text file or folder, or a nanoGPT .bin of uint16 ids")
  p.add_argument("--out", help="run folder, new or empty (default runs/<time>-<preset>-<hash>); locked while the run "
                                "writes it")
  p.add_argument("--force", action="store_true",
                 help="if --out holds an earlier run, move it aside to <out>.old-<time> (never deleted or mixed)")
  p.add_argument("--perturb", action="append", default=[], metavar="SIDE:KEY=VALUE",
                 help="debug: change one side on purpose, e.g. jax:model.norm_eps=1e-3 or deepspeed:kill_at_step=5")
  p.add_argument("--timeout", type=float, help="per-side wall-clock limit in seconds")
  p.add_argument("--hf-model", metavar="DIR",
                 help="start from a local Hugging Face checkpoint folder (model spec and initial weights)")
  p.add_argument("--deepspeed-config", metavar="FILE",
                 help="a DeepSpeed JSON config: the DeepSpeed side runs it as is ('auto' filled from the run spec), "
                      "the JAX and torch sides run its port; see `parity port`")
  env = p.add_mutually_exclusive_group()
  env.add_argument("--noise-envelope", dest="noise_envelope", action="store_true", default=None,
                   help="rerun every side with its batches' rows in reverse order and hold each pair's loss "
                        "difference against that rounding noise (default: on for bf16/fp16 only)")
  env.add_argument("--no-noise-envelope", dest="noise_envelope", action="store_false")
  p.add_argument("--determinism-steps", type=int, default=8, metavar="N",
                 help="rerun each side's first N steps in a new process and state whether they are bit-identical "
                      "(reported, not gating; default 8, 0 skips)")
  p.add_argument("--resume-at", type=int, metavar="STEP",
                 help="also checkpoint each side at STEP in that rerun, resume in a new process and check the rest "
                      "of the run is bit-identical to the uninterrupted one")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  _add_allow_large(p)


def _add_allow_large(p) -> None:
  p.add_argument("--allow-large", action="store_true",
                 help="run even when the estimated memory or disk of the run exceeds what this machine has "
                      "(sets PARITY_ALLOW_LARGE=1; see parity.inputs.check_resources)")


def _add_diagnose(sub) -> None:
  p = sub.add_parser("diagnose", help="one step on identical weights and batch: the first tensor where two sides differ",
                     description="Runs one training step of two sides on the same initial weights and batch, "
                                 "records every forward intermediate, gradient and the first update, and names "
                                 "the first tensor that breaks tolerance (docs/diagnose.md).")
  p.add_argument("--preset", default=None, help=f"built-in run (default {DEFAULT_PRESET}); see `parity presets`")
  p.add_argument("--config", help="run config file (YAML or JSON) merged over the preset")
  p.add_argument("--hf-model", metavar="DIR", help="a local Hugging Face checkpoint folder (model spec and weights)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help="dotted override, e.g. --set model.n_layers=2")
  p.add_argument("--step", type=int, default=0, help="batch (batches.npy[STEP]) and lr position to diagnose (default 0)")
  p.add_argument("--sides", default="jax,torch", help="reference,candidate (default jax,torch)")
  p.add_argument("--perturb", action="append", default=[], metavar="SIDE:KEY=VALUE",
                 help="change one side on purpose, e.g. jax:model.norm_eps=1e-6")
  p.add_argument("--plant", action="append", default=[], metavar="SIDE:KIND",
                 help="plant a bug in one side: no_causal_mask, transpose=<square weight>, decay_all")
  p.add_argument("--out", help="output folder (default runs/<time>-diagnose-<hash>)")
  p.add_argument("--timeout", type=float, default=600.0, help="per-side wall-clock limit in seconds (default 600)")
  _add_allow_large(p)


def _run_diagnose(args) -> int:
  from parity.diagnose import diagnose
  con = _console()
  res = diagnose(args.preset, config=args.config, overrides=parse_overrides(args.overrides), hf_model=args.hf_model, step=args.step,
                 sides=[s.strip() for s in args.sides.split(",") if s.strip()], perturb=args.perturb,
                 plants=args.plant, out=args.out, timeout_s=args.timeout)
  a, b = res.sides
  con.print(f"parity diagnose — {res.run_dir}: {a} vs {b}, step {res.step} "
            f"(update at lr position {res.lr_step}, lr {res.lr:.3g})")
  from rich.markup import escape
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


def _run_compare(args) -> int:
  from parity.api import compare
  con = _console()
  report = compare(args.preset, config=args.config, overrides=parse_overrides(args.overrides), steps=args.steps,
                   sides=args.sides.split(",") if args.sides else None, data=args.data, out=args.out,
                   perturb=args.perturb, timeout_s=args.timeout, progress=not args.no_progress,
                   hf_model=args.hf_model, deepspeed_config=args.deepspeed_config, plan=args.plan,
                   hardware=args.hardware, noise_envelope=args.noise_envelope,
                   determinism_steps=args.determinism_steps, resume_at=args.resume_at, force=args.force,
                   command=" ".join(["parity", *sys.argv[1:]]))
  print_summary(report, con)
  return report.exit_code


def print_summary(report, con) -> None:
  from rich.table import Table
  from parity.report.write import fmt_bytes, side_rows

  t = Table(title=f"parity compare — {report.run_dir}")
  for col in ("side", "status", "steps", "loss first→last", "val loss", "tokens/s", "init+compile s",
              "peak RSS", "state by memory kind"):
    t.add_column(col)
  for r in side_rows(report):
    kinds = ", ".join(f"{k}={x}" for k, x in r["kinds"].items()) or \
        ", ".join(f"{k}: {fmt_bytes(b)}" for k, b in r["state_by_kind"].items())
    first = f"{r['first_loss']:.4f}" if isinstance(r["first_loss"], float) else "n/a"
    last = f"{r['last_loss']:.4f}" if isinstance(r["last_loss"], float) else str(r["last_loss"])
    t.add_row(r["side"], r["status"], str(r["steps"]), f"{first} → {last}",
              f"{r['val_loss']:.4f}" if isinstance(r["val_loss"], float) else "n/a",
              f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a",
              f"{(r['init_s'] or 0) + (r['compile_s'] or 0):.1f}", fmt_bytes(r["peak_rss"]), kinds)
  con.print(t)
  c = Table(title="checks")
  for col in ("check", "max diff", "tolerance", "ok", "first failing step"):
    c.add_column(col)
  for ch in report.checks:
    val = ch["value"]
    tol = ch["tolerance"]
    c.add_row(ch["name"], f"{val:.3g}" if isinstance(val, (int, float)) else "nan" if val is None else str(val),
              f"{tol:.3g}" if isinstance(tol, (int, float)) else "n/a",
              ("yes" if ch["passed"] else "[red]NO[/red]") if ch.get("gating", True) else
              ("yes (reported only)" if ch["passed"] else "no (reported only)"),
              "" if ch["first_failing_step"] is None else str(ch["first_failing_step"]))
  con.print(c)
  det = report.data.get("determinism") or {}
  if det:
    con.print("determinism (first steps rerun in a new process): " + ", ".join(
        f"{s} {'bit-identical' if x['deterministic'] else 'NOT bit-identical'}" for s, x in det.items()))
  style = "bold green" if report.passed else "bold red"
  con.print(f"[{style}]{report.message}[/{style}]")
  moved = (report.data.get("run_folder") or {}).get("moved_aside_to")
  if moved:
    con.print(f"--force: the earlier run in {report.run_dir} was moved aside to {moved}")
  where = report.data.get("report_written_to") or report.run_dir
  for e in report.data.get("write_errors") or []:
    con.print(f"[bold red]could not write {e['file']}: {e['error']}[/bold red]", soft_wrap=True)
  if report.data.get("write_errors"):
    con.print(f"[bold red]the report is incomplete (exit 1); what could be written is in {where}[/bold red]")
  else:
    con.print(f"report: {Path(where) / 'report.md'} (also report.json, loss.png)")


def _run_report(args) -> int:
  from parity.report.read import load_report
  report = load_report(args.run_dir)  # every section print_summary reads is checked (InputError names it)
  print_summary(report, _console())
  return report.exit_code


def _run_presets(args) -> int:
  con = _console()
  for name, spec in PRESETS.items():
    m, t = spec.model, spec.train
    con.print(f"[bold]{name}[/bold]{' (default)' if name == DEFAULT_PRESET else ''}: {m.n_params() / 1e6:.2f} M params, "
              f"{m.n_layers} layers × d_model {m.d_model}, seq {t.seq_len}, batch {t.micro_batch_size}×"
              f"{t.grad_accum_steps}, {t.steps} steps")
    if args.verbose:
      con.print_json(json.dumps(to_dict(spec)))
  return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="parity", description=__doc__.split("\n\n")[0])
  sub = ap.add_subparsers(dest="command", required=True)
  _add_compare(sub)
  _add_diagnose(sub)
  try:
    from parity.migrate import cli as migrate_cli
  except ImportError:
    migrate_cli = None
  if migrate_cli is not None:
    p = sub.add_parser("port", help="port a DeepSpeed config to a JAX config, key by key")
    migrate_cli.add_arguments(p)
  from parity import convert
  p = sub.add_parser("convert-weights", help="convert weights: Hugging Face folder <-> canonical <-> orbax")
  convert.add_arguments(p)
  from parity import memory, plans
  p = sub.add_parser("estimate", help="memory model: bytes per category and memory kind, both sides, "
                                      "with DeepSpeed's own estimator figures")
  memory.add_estimate_arguments(p)
  p = sub.add_parser("plan", help="choose the sharding/offload/remat plan that fits a device and is fastest")
  plans.add_plan_arguments(p)
  p = sub.add_parser("build-ops", help="build DeepSpeed's C++ ops once, up front (first use takes minutes)",
                     description="Builds (or loads, when built) DeepSpeed's JIT ops cpu_adam, deepspeed_shm_comm and "
                                 "fused_adam into this environment's torch_extensions folder, removing a stale build "
                                 "lock an interrupted build left, so no DeepSpeed side builds inside its timed run.")
  p.add_argument("ops", nargs="*", help="ops to build (default: all three)")
  p.add_argument("--timeout", type=float, default=None, help="seconds before the build is stopped (default 1800)")
  p = sub.add_parser("report", help="print the summary of a finished run")
  p.add_argument("run_dir")
  p = sub.add_parser("presets", help="list built-in presets")
  p.add_argument("-v", "--verbose", action="store_true")
  return ap


def _sigterm_as_interrupt(signum, frame):
  raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
  import signal
  signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # SIGTERM stops the workers too, like Ctrl-C
  ap = build_parser()
  args = ap.parse_args(argv)
  bad = _bad_number_flag(args)
  if bad:
    ap.exit(EXIT_BAD_INPUT, f"parity {args.command}: error: {bad}\n")
  if getattr(args, "allow_large", False):
    import os
    from parity.inputs import ALLOW_LARGE_ENV
    os.environ[ALLOW_LARGE_ENV] = "1"
  try:
    if args.command == "compare":
      return _run_compare(args)
    if args.command == "diagnose":
      return _run_diagnose(args)
    if args.command == "port":
      from parity.migrate import cli as migrate_cli
      return migrate_cli.run(args)
    if args.command == "convert-weights":
      from parity import convert
      return convert.run(args)
    if args.command == "estimate":
      from parity import memory
      return memory.run_estimate(args)
    if args.command == "plan":
      from parity import plans
      return plans.run_plan(args)
    if args.command == "build-ops":
      from harness.runner import build_ops  # harness depends on parity, not the reverse
      if args.timeout is not None and not args.timeout > 0:
        raise ValueError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
      return build_ops(args.ops, **({"timeout_s": args.timeout} if args.timeout else {}))
    if args.command == "report":
      return _run_report(args)
    return _run_presets(args)
  except (SpecError, DataError, _PortError) as exc:
    print(f"parity {args.command}: error: {exc}", file=sys.stderr)
    return EXIT_BAD_INPUT
  except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, UnicodeError) as exc:
    # the rule: an input error of any module (the ValueError family, a path that is not there) is bad input
    print(f"parity {args.command}: error: {exc}", file=sys.stderr)
    return EXIT_BAD_INPUT
  except MemoryError:
    print(f"parity {args.command}: error: out of memory; the sizes asked for (train.steps, micro_batch_size, "
          "seq_len, model.*) do not fit this machine: reduce them", file=sys.stderr)
    return EXIT_BAD_INPUT
  except RunIOError as exc:  # the run's own files could not be written: attempted, no trustworthy result
    print(f"parity {args.command}: error: {exc}", file=sys.stderr)
    return EXIT_FAIL
  except KeyboardInterrupt:
    print("parity: interrupted; the running side was killed and the report marks it", file=sys.stderr)
    return 130
  except Exception as exc:  # a bug, not bad input: one line, the traceback in a file, exit 1
    print(f"parity {args.command}: internal error: {type(exc).__name__}: {str(exc)[:300]} "
          f"(traceback saved to {_save_traceback(args.command)}; please report it)", file=sys.stderr)
    return EXIT_FAIL


def _bad_number_flag(args) -> str | None:
  """The rule for every numeric flag of every command (argparse's float() takes '1e400' and 'nan'): floats finite,
  integers within parity.spec.INT_MAX. Returns the message naming the first bad flag, or None."""
  import math
  from parity.spec import INT_MAX
  for dest, v in vars(args).items():
    flag = "--" + dest.replace("_", "-")
    if isinstance(v, float) and not math.isfinite(v):
      return f"{flag} {v}: must be a finite number"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_MAX:
      return f"{flag} {v}: out of range (at most {INT_MAX:,})"
  return None


def _save_traceback(command: str) -> str:
  """Writes the current exception's traceback to a new file in the temp folder; returns its path."""
  import tempfile
  import traceback
  try:
    fd, path = tempfile.mkstemp(prefix=f"parity-{command}-error-", suffix=".txt")
    with open(fd, "w", encoding="utf-8") as f:
      f.write(" ".join(["parity", *sys.argv[1:]]) + "\n\n" + traceback.format_exc())
    return path
  except OSError as exc:
    return f"nowhere: {exc.strerror}"


if __name__ == "__main__":
  sys.exit(main())
