"""`parity join A B [--out DIR] [--force]`: one verdict and report over run folders of one request whose sides ran on
different machines (parity.pipeline.join; docs/join.md)."""
from __future__ import annotations

import argparse
import sys

from parity.cli._common import console
from parity.cli.compare import print_summary
from parity.pipeline.join import join_runs
from parity.report.join_view import join_lines

__all__ = ["register"]


def register(sub) -> None:
  """Adds `join` to the subparsers `sub`."""
  p = sub.add_parser("join", help="one verdict over the sides of one request run on different machines",
                     description="Joins finished `parity compare` folders made from one request, each with its own "
                                 "sides (e.g. `--sides deepspeed` on a GPU node into A, then `--request "
                                 "A/request.json --sides jax` on a TPU VM into B), into one folder with one verdict "
                                 "and report: every check of a one-machine run, the noise envelopes of both "
                                 "machines included. Refused (exit 2), naming the file and both folders: folders "
                                 "that are not the same run (spec, batches, initial weights, data), a file changed "
                                 "after its run, a side in two folders, different reruns. Exit 0: parity holds; 1: "
                                 "it does not, or a side did not finish; 2: bad input.")
  p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                 help="two or more finished run folders of one request; the first folder's first side is the "
                      "reference of every pair")
  p.add_argument("--out", help="the joined folder, new or empty (default runs/<time>-join-<hash>)")
  p.add_argument("--force", action="store_true",
                 help="if --out holds an earlier run, move it aside to <out>.old-<time> (never deleted or mixed; "
                      "default off)")
  p.set_defaults(handler=run_join)


def run_join(args: argparse.Namespace) -> int:
  """`parity join`: join_runs, the summary of a run and the joined folders; returns the report's exit code."""
  report = join_runs(args.run_dirs, out=args.out, force=args.force,
                     command=" ".join(["parity", *sys.argv[1:]]))
  con = console()
  for line in join_lines(report.record):
    con.print(line, soft_wrap=True, markup=False)
  print_summary(report, con)
  return report.exit_code
