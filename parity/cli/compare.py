"""`parity compare`: arguments, the ResolvedRun and RunOptions they make, run_comparison, the summary tables
(`parity report` and `parity check`: parity/cli/report.py)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from parity.cli._common import add_allow_large, add_run_source, console, count_arg, float_arg, int_arg
from parity.pipeline.compare import OPTION_FIELDS, RunOptions, run_comparison
from parity.pipeline.request_source import CONFLICTING_FLAGS, resolve_request
from parity.pipeline.resolve import ResolvedRun, resolve_run
from parity.cli.port import add_stack_argument
from parity.spec import SpecError
from parity.overrides import parse_overrides
from parity.cli.gate_table import print_gate
from parity.history.after import PostRun
from parity.report.check_table import per_tensor_rule, tolerance_text
from parity.report.equivalence_view import equivalence_lines
from parity.report.headline import verdict_sentence, run_title
from parity.report.setup_table import perturbation_lines
from parity.report.side_table import side_rows, throughput_columns, throughput_note

__all__ = ["register", "run_options", "resolved_run", "print_summary"]


def register(sub) -> None:
  """Adds `compare` to the subparsers `sub`: what is run (_add_source_flags), how (_add_run_flags, _add_rank_flags)."""
  p = sub.add_parser("compare", help="run every side on identical data and weights and check parity",
                     description="Runs JAX (Flax+Optax, host offload), DeepSpeed (ZeRO) and plain PyTorch (and, "
                                 "with --sides ...,fsdp, PyTorch FSDP2) on the same data and initial weights, each "
                                 "in its own process, and checks parity. "
                                 "Exit 0: parity holds; 1: it does not (or a side failed; the report says which); "
                                 "2: bad input; 3: incomplete, a default side was left out (its framework is not "
                                 "installed here, or this machine refuses its sockets).")
  _add_source_flags(p)
  _add_run_flags(p)
  _add_rank_flags(p)
  add_allow_large(p)
  p.set_defaults(handler=run_compare)


def _add_source_flags(p) -> None:
  """What is run, the flags parity.pipeline.resolve.resolve_run takes (`resolved_run`)."""
  add_run_source(p, set_example="--set train.lr=3e-4 --set jax.offload_params=true")
  p.add_argument("--plan", help="a named plan pair: DeepSpeed <-> JAX, and FSDP2 where the pair has one (see "
                                "`parity plan`; e.g. zero3-offload-all), "
                                "or 'auto': the fastest pair that fits --hardware by the memory model "
                                "(default: the run's own plans)")
  p.add_argument("--hardware", default="H100", help="accelerator preset for --plan auto (A100-40, A100-80, H100, "
                                                    "H200, GH200)")
  p.add_argument("--steps", type=count_arg, help="optimizer steps, train.steps (default: the preset's)")
  p.add_argument("--sides", help="comma-separated sides out of jax, deepspeed, torch, fsdp; the first is the "
                                 "reference (default jax,deepspeed,torch)")
  p.add_argument("--data", help="corpus: 'stdlib', a text file or folder, a .bin of token ids (llm.c header, "
                                "or headerless uint16 as nanoGPT; NAME.uint32.bin for uint32) or a 1-D integer .npy; "
                                "or examples for train.layout padded/packed: a .jsonl/.json/.parquet file or "
                                "'sft-demo' (default: the preset's, stdlib)")
  p.add_argument("--tokenizer", metavar="DIR",
                 help="a folder with tokenizer.json (and tokenizer_config.json) for text example records of --data "
                      "(padded/packed layouts; default: the --hf-model folder)")
  p.add_argument("--hf-model", metavar="DIR",
                 help="start from a local Hugging Face checkpoint folder (model spec and initial weights; "
                      "default: seeded initial weights)")
  p.add_argument("--deepspeed-config", metavar="FILE",
                 help="a DeepSpeed JSON config: the DeepSpeed side runs it as is ('auto' filled from the run spec), "
                      "the JAX and torch sides run its port; see `parity port` (default: none)")
  add_stack_argument(p)
  p.add_argument("--request", metavar="FILE",
                 help="run exactly the run of an earlier folder's request.json (its spec; its batches, initial "
                      "weights and example arrays copied from that folder), with the --sides given: the other half "
                      "of a run split over two machines, joined by `parity join` (docs/join.md); --preset, --config, "
                      "--set, --steps, --data, --hf-model, --deepspeed-config, --plan and --tokenizer are refused "
                      "with it (default: none)")


def _add_run_flags(p) -> None:
  """How it runs: the RunOptions fields (`run_options`), but the rank flags."""
  p.add_argument("--out", help="run folder, new or empty (default runs/<time>-<preset>-<hash>); locked while the run "
                               "writes it")
  p.add_argument("--force", action="store_true",
                 help="if --out holds an earlier run, move it aside to <out>.old-<time> (never deleted or mixed; "
                      "default off)")
  p.add_argument("--perturb", action="append", default=[], metavar="SIDE:KEY=VALUE",
                 help="debug: change one side on purpose, e.g. jax:model.norm_eps=1e-3 or deepspeed:kill_at_step=5 "
                      "(default: none)")
  p.add_argument("--timeout", type=float_arg, help="per-side wall-clock limit in seconds (default: the run spec's "
                                               "timeout_s)")
  env = p.add_mutually_exclusive_group()
  env.add_argument("--noise-envelope", dest="noise_envelope", action="store_true", default=None,
                   help="rerun every side with its batches' rows in reverse order and hold each pair's loss "
                        "difference against that rounding noise (default: on for bf16/fp16 only)")
  env.add_argument("--no-noise-envelope", dest="noise_envelope", action="store_false",
                   help="never run the noise envelope (default: on for bf16/fp16 only)")
  p.add_argument("--determinism-steps", type=int_arg, default=8, metavar="N",
                 help="rerun each side's first N steps in a new process and state whether they are bit-identical "
                      "(reported, not gating; default 8, 0 skips)")
  p.add_argument("--resume-at", type=int_arg, metavar="STEP",
                 help="also checkpoint each side at STEP in that rerun, resume in a new process and check the rest "
                      "of the run is bit-identical to the uninterrupted one (default: no resume check)")
  p.add_argument("--equivalence", metavar="KINDS", default=None,
                 help="after the run, train each side again in an equivalent shape and hold it against its main run: "
                      "ga (GA 1 x micro batch k*m), ranks (1 rank, or 2 for a 1-rank run), packing (the examples "
                      "in the other layout), comma-separated; gating with loss_normalization tokens in fp32, "
                      "reported only otherwise (default: none)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar (default: a bar on a terminal)")
  p.add_argument("--allow-cpu", action="store_true",
                 help="run even when CUDA is present but the JAX or torch side would run on the CPU (no CUDA "
                      "plugin / a CPU-only torch build; refused by default, exit 2, naming the package to "
                      "install; PARITY_ALLOW_CPU=1 does the same; default off)")
  p.add_argument("--train-anyway-on-card-diff", action="store_true",
                 help="train every side even when its semantics card (GELU form, norm, decay set, Adam eps, ...: "
                      "parity.protocol.semantics) differs from an earlier side's; the report still FAILs the "
                      "'semantics' check at step 0 (default: a side whose card differs stops before step 1)")
  p.add_argument("--baseline", metavar="RUN_DIR_OR_CARD",
                 help="regression gate: check this run against a finished run folder or its card.json, metric by "
                      "metric (docs/report-compare.md); exit 1 when one moved outside its gate, the table says "
                      "which (default: no gate)")
  p.add_argument("-v", "--verbose", action="store_true",
                 help="with --baseline, print the gate's whole table and notes when it passes too (default off: a "
                      "pass prints its outcome, its counts and where gate.md is; a FAIL always prints the table)")
  p.add_argument("--tracker", action="append", default=[], metavar="KIND:TARGET",
                 help="mirror each side's per-step records after the run to tensorboard:DIR, wandb:PROJECT or "
                      "mlflow:EXPERIMENT (the package must be installed; default: none)")


def _add_rank_flags(p) -> None:
  """--nproc, --nnodes, --node-rank, --coordinator, --hostfile (docs/multirank.md: the commands they become)."""
  p.add_argument("--nproc", type=count_arg, default=1, metavar="N",
                 help="ranks per side on this host: torchrun for deepspeed/torch (DDP)/fsdp (FSDP2), N JAX processes "
                      "under jax.distributed; the global batch stays the 1-rank run's (default 1)")
  p.add_argument("--nnodes", type=count_arg, default=1, help="hosts in the job (torchrun --nnodes; default 1)")
  p.add_argument("--node-rank", type=int_arg, default=0, help="this host's index (torchrun --node-rank; default 0)")
  p.add_argument("--coordinator", metavar="HOST:PORT",
                 help="rendezvous every host reaches: torchrun --master-addr/--master-port and "
                      "jax.distributed.initialize's coordinator (default: a free port on 127.0.0.1)")
  p.add_argument("--hostfile", metavar="FILE", help="DeepSpeed hostfile: the DeepSpeed side runs through the "
                                                   "`deepspeed` launcher with it (default: torchrun)")


def run_compare(args: argparse.Namespace) -> int:
  """`parity compare`: resolve_run and run_comparison (as parity.pipeline.compare.compare) and the summary. Returns
  the report's exit code."""
  started = time.time()
  report = run_comparison(resolved_run(args), run_options(args, started_s=started), after=PostRun.for_options)
  print_summary(report, console())
  _print_post(report, console(), verbose=getattr(args, "verbose", False))
  return report.exit_code


def resolved_run(args: argparse.Namespace) -> ResolvedRun:
  """What a parsed `parity compare` runs: resolve_run with its source flags (--set strings parsed here), or with
  --request the earlier request's run (parity.pipeline.request_source.resolve_request; a flag that would change it
  is refused, SpecError naming it)."""
  if getattr(args, "request", None):
    given = [flag for dest, flag in CONFLICTING_FLAGS.items() if getattr(args, dest, None)]
    if given:
      raise SpecError(f"--request {args.request} takes the whole run from that request, and {', '.join(given)} would "
                      "change it (the two halves of a joined run must be one run): drop "
                      f"{'them' if len(given) > 1 else 'it'}; only --sides (and how it runs: --perturb, --out, ...) "
                      "go with --request")
    return resolve_request(args.request, sides=args.sides.split(",") if args.sides else None)
  return resolve_run(args.preset, config=args.config, overrides=parse_overrides(args.overrides), steps=args.steps,
                     sides=args.sides.split(",") if args.sides else None, data=args.data, hf_model=args.hf_model,
                     deepspeed_config=args.deepspeed_config, plan=args.plan, hardware=args.hardware,
                     tokenizer=getattr(args, "tokenizer", None), stack=getattr(args, "stack", None))


_FLAG_OF = {"timeout_s": "timeout", "trackers": "tracker"}
"""The RunOptions fields whose flag has another name (--timeout, each --tracker)."""
_NOT_FLAGS = ("progress", "command", "started_s")
"""The RunOptions fields `run_options` sets itself: progress from --no-progress, the command line, the start time."""


def run_options(args: argparse.Namespace, *, started_s: float | None = None) -> RunOptions:
  """The RunOptions of a parsed `parity compare`: every field from its flag (the field's name, or _FLAG_OF's), but
  _NOT_FLAGS: progress unless --no-progress, the command line as typed, `started_s` (when the command began).
  A field added to RunOptions without a flag raises AttributeError here (tests/test_cli.py builds one)."""
  given = {f: getattr(args, _FLAG_OF.get(f, f)) for f in OPTION_FIELDS if f not in _NOT_FLAGS}
  return RunOptions(**given, progress=not args.no_progress, command=" ".join(["parity", *sys.argv[1:]]),
                    started_s=started_s)


def _print_post(report, con, verbose: bool = False) -> None:
  """The --baseline gate (its table when it failed or with --verbose; then one outcome line, with its counts on a
  pass, naming gate.md) and the --tracker lines (parity.history.after.PostRunResult), when asked for."""
  post = getattr(report, "post", None)
  if post is None:
    return
  if post.gate is not None:
    print_gate(post.gate, con, verbose=verbose, table=(post.gate_files or {}).get("md"))
  for m in post.messages:
    con.print(m, soft_wrap=True)


def print_summary(report, con) -> None:
  """Prints a Report (parity.report): one row per side (state bytes per memory kind for every side, JAX included),
  the throughput caveat of the page (parity.report.side_table.throughput_note), one row per check, one line per
  --perturb (applied or not: parity.report.setup_table.perturbation_lines), the verdict sentence
  and where the report is.
  Columns fold (wrap) instead of truncating: at 120 columns the memory-kind cell wraps onto a second line."""
  from rich.table import Table

  rec = report.record
  ranks = {n: int(s.summary.get("nproc") or 1) for n, s in rec.sides.items()}  # harness.ranks.fold_ranks
  world = max(ranks.values(), default=1)
  t = Table(title=f"parity compare — {report.run_dir}" + (f" — {world} ranks per side" if world > 1 else ""),
            caption=_title(rec))  # what was compared: the model (an --hf-model checkpoint by name), plan, ...
  tput = throughput_columns(rec)  # tokens/s, and loss tokens/s on padded/packed data
  cols = ("side", "status", "steps", "loss first→last", "val loss", *(h for _, h in tput), "init/compile s",
          "peak RSS", "state by memory kind")
  for col in cols:
    t.add_column(col, overflow="fold", no_wrap=col in ("side", "steps"),
                 min_width=20 if col == "state by memory kind" else None)
  for r in side_rows(rec):
    n = ranks.get(r["side"], 1)
    t.add_row(r["side"] + (f" × {n} ranks" if n > 1 else ""), f"{r['status']} ({r['backend']})", str(r["steps"]),
              r["loss"], r["val_loss"], *(r[k] for k, _ in tput), f"{r['init_s']} / {r['compile_s']}", r["peak_rss"],
              r["memory_kinds"].replace(", ", ",\n"))
  con.print(t)
  # the same caveat as the page: tokens/s of sides run one after another under changing load (a CPU backend)
  con.print(f"tokens/s: {throughput_note(rec)}", soft_wrap=True)
  _print_checks(rec, con)
  for line in perturbation_lines(rec):  # each --perturb and whether the side ran it (the report's table)
    con.print(line, style="bold red" if "NOT APPLIED" in line else None, soft_wrap=True, markup=False)
  style = "bold green" if report.passed else "bold red"
  for why in rec.sides_not_run.values():  # a side this machine could not start (parity.sockets)
    con.print(why.reason, style="bold red" if why.named else None, soft_wrap=True, markup=False)
  con.print(f"[{style}]{verdict_sentence(rec)}[/{style}]")
  incomplete = report.incomplete_line()  # default sides left out: exit 3 (parity.report.build.EXIT_INCOMPLETE)
  if incomplete:
    con.print(incomplete, style="bold yellow", soft_wrap=True, markup=False)
  if rec.run_folder.moved_aside_to:
    con.print(f"--force: the earlier run in {report.run_dir} was moved aside to {rec.run_folder.moved_aside_to}")
  where = rec.report_written_to or report.run_dir
  for e in rec.write_errors:
    con.print(f"[bold red]could not write {e.get('file')}: {e.get('error')}[/bold red]", soft_wrap=True)
  if rec.write_errors:
    con.print(f"[bold red]the report is incomplete (exit 1); what could be written is in {where}[/bold red]")
  else:
    con.print(f"report: {Path(where) / 'report.html'} (also report.md with its plots, card.json, report.json)",
              soft_wrap=True)


def _title(rec) -> str | None:
  try:
    return run_title(rec)
  except (KeyError, TypeError):  # a report without its run section: the table says the rest
    return None


def _print_checks(rec, con) -> None:
  """The checks table, the determinism line and the equivalence lines of the summary (rec: the RunRecord)."""
  from rich.table import Table
  c = Table(title="checks")
  tols = rec.tolerance_table
  for col in ("check", "value", "tolerance", "ok", "first failing step"):
    c.add_column(col)
  for ch in rec.checks:
    val = ch.value
    text = f"{val:.3g}" if isinstance(val, (int, float)) else "nan" if val is None else str(val)
    c.add_row(ch.name, text + (" (ratio to moved)" if per_tensor_rule(ch) else ""),
              tolerance_text(ch, tols) if isinstance(ch.tolerance, (int, float)) else "n/a",
              ("yes" if ch.passed else "[red]NO[/red]") if ch.gating else
              ("yes (reported only)" if ch.passed else "no (reported only)"),
              "" if ch.first_failing_step is None else str(ch.first_failing_step))
  con.print(c)
  det = rec.determinism
  if det:
    con.print("determinism (first steps rerun in a new process; a side that does not repeat itself makes its "
              "verdict chance): " + ", ".join(
                  f"{s} {'bit-identical' if x.deterministic else 'NOT bit-identical'}" for s, x in det.items())
              + ("" if all(x.deterministic for x in det.values()) else
                 " (--determinism-steps 0 skips this rerun)"), soft_wrap=True)
  for line in equivalence_lines(rec):  # --equivalence: one line per kind and side
    con.print(line, soft_wrap=True, markup=False)
