"""`parity compare`: arguments, the call into parity.pipeline.compare.compare, the summary tables (`parity report` and
`parity check`: parity/cli/report.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parity.cli._common import add_allow_large, add_run_source, console, count_arg
from parity.spec import parse_overrides

__all__ = ["register", "print_summary"]


def register(sub) -> None:
  """Adds `compare` and `report` to the subparsers `sub`."""
  p = sub.add_parser("compare", help="run every side on identical data and weights and check parity",
                     description="Runs JAX (Flax+Optax, host offload), DeepSpeed (ZeRO) and plain PyTorch on "
                                 "the same data and initial weights, each in its own process, and checks parity. "
                                 "Exit 0: parity holds; 1: it does not (or a side failed; the report says which); "
                                 "2: bad input.")
  add_run_source(p, set_example="--set train.lr=3e-4 --set jax.offload_params=true")
  p.add_argument("--plan", help="a DeepSpeed <-> JAX plan pair (see `parity plan`; e.g. zero3-offload-all), "
                                "or 'auto': the fastest pair that fits --hardware by the memory model "
                                "(default: the run's own plans)")
  p.add_argument("--hardware", default="H100", help="accelerator preset for --plan auto (A100-40, A100-80, H100, "
                                                    "H200, GH200)")
  p.add_argument("--steps", type=count_arg, help="optimizer steps, train.steps (default: the preset's)")
  p.add_argument("--sides", help="comma-separated sides, first is the reference (default jax,deepspeed,torch)")
  p.add_argument("--data", help="corpus: 'stdlib', a text file or folder, or a nanoGPT .bin of uint16 ids "
                                "(default: the preset's, stdlib)")
  p.add_argument("--out", help="run folder, new or empty (default runs/<time>-<preset>-<hash>); locked while the run "
                               "writes it")
  p.add_argument("--force", action="store_true",
                 help="if --out holds an earlier run, move it aside to <out>.old-<time> (never deleted or mixed; "
                      "default off)")
  p.add_argument("--perturb", action="append", default=[], metavar="SIDE:KEY=VALUE",
                 help="debug: change one side on purpose, e.g. jax:model.norm_eps=1e-3 or deepspeed:kill_at_step=5 "
                      "(default: none)")
  p.add_argument("--timeout", type=float, help="per-side wall-clock limit in seconds (default: the run spec's "
                                               "timeout_s)")
  p.add_argument("--hf-model", metavar="DIR",
                 help="start from a local Hugging Face checkpoint folder (model spec and initial weights; "
                      "default: seeded initial weights)")
  p.add_argument("--deepspeed-config", metavar="FILE",
                 help="a DeepSpeed JSON config: the DeepSpeed side runs it as is ('auto' filled from the run spec), "
                      "the JAX and torch sides run its port; see `parity port` (default: none)")
  env = p.add_mutually_exclusive_group()
  env.add_argument("--noise-envelope", dest="noise_envelope", action="store_true", default=None,
                   help="rerun every side with its batches' rows in reverse order and hold each pair's loss "
                        "difference against that rounding noise (default: on for bf16/fp16 only)")
  env.add_argument("--no-noise-envelope", dest="noise_envelope", action="store_false",
                   help="never run the noise envelope (default: on for bf16/fp16 only)")
  p.add_argument("--determinism-steps", type=int, default=8, metavar="N",
                 help="rerun each side's first N steps in a new process and state whether they are bit-identical "
                      "(reported, not gating; default 8, 0 skips)")
  p.add_argument("--resume-at", type=int, metavar="STEP",
                 help="also checkpoint each side at STEP in that rerun, resume in a new process and check the rest "
                      "of the run is bit-identical to the uninterrupted one (default: no resume check)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar (default: a bar on a terminal)")
  _add_rank_flags(p)
  add_allow_large(p)
  p.add_argument("--allow-cpu", action="store_true",
                 help="run even when CUDA is present but the JAX or torch side would run on the CPU (no CUDA "
                      "plugin / a CPU-only torch build; refused by default, exit 2, naming the package to "
                      "install; PARITY_ALLOW_CPU=1 does the same; default off)")
  p.add_argument("--baseline", metavar="RUN_DIR_OR_CARD",
                 help="regression gate: check this run against a finished run folder or its card.json, metric by "
                      "metric (docs/report-compare.md); exit 1 when one moved outside its gate, the table says "
                      "which (default: no gate)")
  p.add_argument("--tracker", action="append", default=[], metavar="KIND:TARGET",
                 help="mirror each side's per-step records after the run to tensorboard:DIR, wandb:PROJECT or "
                      "mlflow:EXPERIMENT (the package must be installed; default: none)")
  p.set_defaults(handler=run_compare)


def _add_rank_flags(p) -> None:
  """--nproc, --nnodes, --node-rank, --coordinator, --hostfile (docs/multirank.md: the commands they become)."""
  p.add_argument("--nproc", type=count_arg, default=1, metavar="N",
                 help="ranks per side on this host: torchrun for deepspeed/torch (DDP), N JAX processes under "
                      "jax.distributed; the global batch stays the 1-rank run's (default 1)")
  p.add_argument("--nnodes", type=count_arg, default=1, help="hosts in the job (torchrun --nnodes; default 1)")
  p.add_argument("--node-rank", type=int, default=0, help="this host's index (torchrun --node-rank; default 0)")
  p.add_argument("--coordinator", metavar="HOST:PORT",
                 help="rendezvous every host reaches: torchrun --master-addr/--master-port and "
                      "jax.distributed.initialize's coordinator (default: a free port on 127.0.0.1)")
  p.add_argument("--hostfile", metavar="FILE", help="DeepSpeed hostfile: the DeepSpeed side runs through the "
                                                   "`deepspeed` launcher with it (default: torchrun)")


def run_compare(args: argparse.Namespace) -> int:
  """`parity compare`: runs parity.pipeline.compare.compare and prints the summary. Returns the report's exit code."""
  from parity.pipeline.compare import compare
  report = compare(args.preset, config=args.config, overrides=parse_overrides(args.overrides), steps=args.steps,
                   sides=args.sides.split(",") if args.sides else None, data=args.data, out=args.out,
                   perturb=args.perturb, timeout_s=args.timeout, progress=not args.no_progress,
                   hf_model=args.hf_model, deepspeed_config=args.deepspeed_config, plan=args.plan,
                   hardware=args.hardware, noise_envelope=args.noise_envelope,
                   determinism_steps=args.determinism_steps, resume_at=args.resume_at, force=args.force,
                   command=" ".join(["parity", *sys.argv[1:]]), nproc=args.nproc, nnodes=args.nnodes,
                   node_rank=args.node_rank, coordinator=args.coordinator, hostfile=args.hostfile,
                   allow_cpu=args.allow_cpu, baseline=args.baseline, trackers=args.tracker)
  print_summary(report, console())
  _print_post(report, console())
  return report.exit_code


def _print_post(report, con) -> None:
  """The --baseline gate's table and the --tracker lines (parity.report.after.PostRunResult), when asked for."""
  post = getattr(report, "post", None)
  if post is None:
    return
  if post.gate is not None:
    from parity.report.after import print_gate
    print_gate(post.gate, con)
    if post.gate_files:
      con.print(f"gate: {post.gate_files['md']} (also gate.json)")
  for m in post.messages:
    con.print(m, soft_wrap=True)


def print_summary(report, con) -> None:
  """Prints a Report (parity.report): one row per side, one per check, the verdict sentence and where the report is.
  Columns fold (wrap) instead of truncating: at 120 columns the memory-kind cell wraps onto a second line."""
  from rich.table import Table
  from parity.report.content import side_rows, verdict_sentence

  sides = report.data.get("sides") or {}
  ranks = {n: int(((s.get("summary") or {}).get("nproc")) or 1) for n, s in sides.items()}  # harness.ranks.fold_ranks
  world = max(ranks.values(), default=1)
  t = Table(title=f"parity compare — {report.run_dir}" + (f" — {world} ranks per side" if world > 1 else ""))
  cols = ("side", "status", "steps", "loss first→last", "val loss", "tokens/s", "init/compile s", "peak RSS",
          "state by memory kind")
  for col in cols:
    t.add_column(col, overflow="fold", no_wrap=col in ("side", "steps"),
                 min_width=20 if col == "state by memory kind" else None)
  for r in side_rows(report.data):
    n = ranks.get(r["side"], 1)
    t.add_row(r["side"] + (f" × {n} ranks" if n > 1 else ""), f"{r['status']} ({r['backend']})", str(r["steps"]),
              r["loss"], r["val_loss"], r["tokens_per_s"], f"{r['init_s']} / {r['compile_s']}", r["peak_rss"],
              r["memory_kinds"].replace(", ", ",\n"))
  con.print(t)
  _print_checks(report, con)
  style = "bold green" if report.passed else "bold red"
  con.print(f"[{style}]{verdict_sentence(report.data)}[/{style}]")
  moved = (report.data.get("run_folder") or {}).get("moved_aside_to")
  if moved:
    con.print(f"--force: the earlier run in {report.run_dir} was moved aside to {moved}")
  where = report.data.get("report_written_to") or report.run_dir
  for e in report.data.get("write_errors") or []:
    con.print(f"[bold red]could not write {e['file']}: {e['error']}[/bold red]", soft_wrap=True)
  if report.data.get("write_errors"):
    con.print(f"[bold red]the report is incomplete (exit 1); what could be written is in {where}[/bold red]")
  else:
    con.print(f"report: {Path(where) / 'report.html'} (also report.md with its plots, card.json, report.json)",
              soft_wrap=True)


def _print_checks(report, con) -> None:
  from rich.table import Table
  from parity.report.content import tolerance_text
  c = Table(title="checks")
  tols = (report.data.get("tolerances") or {}).get(((report.data.get("run") or {}).get("train") or {}).get(
      "precision"), {})
  for col in ("check", "max diff", "tolerance", "ok", "first failing step"):
    c.add_column(col)
  for ch in report.checks:
    val = ch["value"]
    tol = ch["tolerance"]
    c.add_row(ch["name"], f"{val:.3g}" if isinstance(val, (int, float)) else "nan" if val is None else str(val),
              tolerance_text(ch, tols) if isinstance(tol, (int, float)) else "n/a",
              ("yes" if ch["passed"] else "[red]NO[/red]") if ch.get("gating", True) else
              ("yes (reported only)" if ch["passed"] else "no (reported only)"),
              "" if ch["first_failing_step"] is None else str(ch["first_failing_step"]))
  con.print(c)
  det = report.data.get("determinism") or {}
  if det:
    con.print("determinism (first steps rerun in a new process): " + ", ".join(
        f"{s} {'bit-identical' if x['deterministic'] else 'NOT bit-identical'}" for s, x in det.items()))
