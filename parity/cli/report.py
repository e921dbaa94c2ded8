"""`parity report RUN_DIR...` (re-render one finished run, or a comparison page over several) and `parity check NEW
BASELINE` (the regression gate between two finished runs)."""
from __future__ import annotations

import argparse
import datetime as _dt
from pathlib import Path

from parity.cli._common import Failure, console
from parity.cli.gate_table import print_gate
from parity.history.after import PostRun
from parity.history.comparison import load_runs, write_comparison
from parity.cli.compare import print_summary
from parity.report.finished import load_finished, rerender_run
from parity.report.read import verify_report
from parity.report.trackers import mirror_run, open_tracker
from parity.inputs import InputError
from parity.history.gate import check_against
from parity.history.snapshot import load_baseline, snapshot_from_report

__all__ = ["register"]


def register(sub) -> None:
  """Adds `report` and `check` to the subparsers `sub`."""
  p = sub.add_parser("report", help="re-render a finished run, or compare several runs on one page",
                     description="One RUN_DIR: re-renders report.html, report.md with its PNGs and card.json from the "
                                 "run's files (nothing is re-run; report.json is left as it is) and prints the "
                                 "summary; exit 0/1: the run's verdict (1 also when a file could not be written: the "
                                 "lines say which, or when the run is UNVERIFIED: every check is recomputed from the "
                                 "run's records first and must match report.json). Several RUN_DIRs (or -o): writes "
                                 "comparison.html and comparison.md (key figures per run, one plot per metric across "
                                 "runs); exit 0, or 1 when a run is UNVERIFIED (its files changed since its verdict, "
                                 "or its checks do not recompute). Exit 2: a folder "
                                 "is not a finished run (the message says what is missing).")
  p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="folders written by `parity compare`")
  p.add_argument("-o", "--out", metavar="DIR",
                 help="folder for comparison.html/.md (default runs/comparison-<time> for several runs; with one "
                      "run, -o builds a one-run comparison page there)")
  p.add_argument("--force", action="store_true",
                 help="let -o replace comparison files this command did not write (default off: such a folder is "
                      "refused, exit 2); with one RUN_DIR, replace report files changed since parity wrote them "
                      "(default off: they are kept and named)")
  p.add_argument("--tracker", action="append", default=[], metavar="KIND:TARGET",
                 help="also mirror each run's per-step records to tensorboard:DIR, wandb:PROJECT or "
                      "mlflow:EXPERIMENT (when installed; default: none)")
  p.set_defaults(handler=run_report)
  p = sub.add_parser("check", help="regression gate: a finished run against a baseline run or card",
                     description="Gates NEW against BASELINE metric by metric (loss, grad norm, lr per step within "
                                 "the run's own tolerance; step time, peak memory within a band; docs/"
                                 "report-compare.md) and prints what moved. Exit 0 within every gate, 1 outside one, "
                                 "2 when a folder is not a finished run or the card is unreadable.")
  p.add_argument("new", metavar="NEW", help="the finished run folder to check")
  p.add_argument("baseline", metavar="BASELINE", help="the baseline: a finished run folder or its card.json")
  p.add_argument("-v", "--verbose", action="store_true",
                 help="print the gate's whole table and notes when it passes too (default off: a pass prints its "
                      "outcome and counts; a FAIL always prints the table)")
  p.set_defaults(handler=run_check)


def run_report(args: argparse.Namespace) -> int:
  """`parity report`. Raises InputError (exit 2) naming a folder that is not a finished run and what it lacks."""
  post = PostRun.prepare(None, args.tracker)
  if len(args.run_dirs) == 1 and args.out is None:
    return _one_run(Path(args.run_dirs[0]), post, args.force)
  runs = load_runs(args.run_dirs)
  out = Path(args.out) if args.out else Path("runs") / f"comparison-{_dt.datetime.now():%Y%m%d-%H%M%S}"
  written = write_comparison(runs, out, force=args.force)
  con = console()
  for r in runs:
    con.print(f"{r.label}: {r.verdict}" if not r.problems else
              f"{r.label}: [bold red]UNVERIFIED ({'; '.join(r.problems)})[/bold red]", soft_wrap=True)
  _mirror(runs, post, con)
  con.print(f"comparison: {written['html']} (also {written['md'].name}, {written['json'].name} and "
            f"{sum(k.startswith('plot:') for k in written)} PNG plots)")
  return 1 if any(r.problems for r in runs) else 0


def _one_run(run_dir: Path, post, force: bool = False) -> int:
  report = load_finished(run_dir)
  problems = verify_report(report)  # every check recomputed from the run's records; the files re-hashed
  if problems:  # exit 1: the stored verdict cannot be confirmed from the run's files; nothing is re-rendered
    raise Failure(f"UNVERIFIED: {run_dir}'s stored verdict is not confirmed by its files: {'; '.join(problems)}")
  written, errors, unrendered = rerender_run(report, force=force)
  con = console()
  # print_summary names the report page only when nothing failed; the errors of this re-render (in memory only:
  # report.json is not rewritten) make it say what could not be written instead
  report.set_write_errors([dict(zip(("file", "error"), e.rpartition(": ")[::2])) for e in errors])
  print_summary(report, con)
  if written:
    con.print(f"re-rendered from the run's files: {', '.join(sorted(p.name for p in written.values()))}",
              soft_wrap=True)
  for u in unrendered:
    con.print(f"[yellow]not re-rendered: {u}[/yellow]", soft_wrap=True)
  for kind, target in post.trackers:
    _mirror_one(run_dir, list(report.record.sides), kind, target, con)
  return 1 if errors else report.exit_code


def _mirror(runs, post, con) -> None:
  for kind, target in post.trackers:
    for r in runs:
      _mirror_one(r.run_dir, r.sides, kind, target, con)


def _mirror_one(run_dir: Path, sides: list[str], kind: str, target: str, con) -> None:
  n = mirror_run(run_dir, [open_tracker(kind, target, run_dir.name)], sides=sides)
  con.print(f"tracker {kind}:{target}: {n} step records of {run_dir.name} mirrored")


def run_check(args: argparse.Namespace) -> int:
  """`parity check NEW BASELINE`: exit 0 within every gate, 1 outside one (InputError, exit 2, for bad folders)."""
  report = load_finished(Path(args.new))  # a folder that is not a finished run: says what is missing
  problems = verify_report(report)
  if problems:
    raise InputError(f"NEW {args.new} cannot be checked: {'; '.join(problems)}")
  result = check_against(snapshot_from_report(report), load_baseline(args.baseline, flag="BASELINE"))
  print_gate(result, console(), verbose=getattr(args, "verbose", False))
  return result.exit_code
