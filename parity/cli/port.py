"""`parity port`: DeepSpeed config -> JAX config (and back), key by key, with the migration report.

The port itself is parity.migrate (port_config, to_deepspeed); the output-path rules are parity.migrate.outputs.
Every refusal reason is printed (on stderr, after the key table), none is left "in the report".
"""
from __future__ import annotations

import argparse
import json
import sys

from parity.cli._common import EXIT_FAIL, EXIT_OK, Failure, console, float_arg, int_arg
from parity.inputs import ascii_number
from parity.migrate._ctx import Flags
from parity.migrate._read import PortError, read_deepspeed_config, read_structured
from parity.migrate._port import port_config
from parity.migrate._stack import STACKS
from parity.migrate._reverse import to_deepspeed, load_ported
from parity.migrate.outputs import check_outputs, write_output
from parity.migrate.verify import DEFAULT_TIMEOUT_S, VerifyTimeout, verify

__all__ = ["register", "main", "EXIT_VERIFY_TIMEOUT"]

EXIT_VERIFY_TIMEOUT = 3
"""`parity port --verify` exit code when a side ran past --verify-timeout: neither a verdict (0 verified, 1 mismatch)
nor bad input (2)."""

EXITS = """exit status:
  0  ported (and verified, with --verify)
  1  --verify: the two sides differ or one crashed; or an output could not be written
  2  refused (every reason is printed) or bad input
  3  --verify: a side ran past --verify-timeout"""


def _betas(text: str) -> tuple[float, float]:
  try:
    a, b = (ascii_number(x, float) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"--betas expects two numbers like 0.9,0.999; got {text!r}") from None
  return a, b


def _count(text: str) -> int:
  """argparse type of a count flag: a whole number >= 1 (a world size, batch or width of 0 makes no job; argparse
  names the flag)."""
  try:
    n = ascii_number(text)  # ASCII digits only: int() also reads '１６'
  except ValueError:
    n = 0
  if n < 1:
    raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}")
  return n


def register(sub) -> None:
  """Adds `port` to the subparsers `sub`."""
  p = sub.add_parser("port", help="port a DeepSpeed config to a JAX config, key by key",
                     description="Ports a DeepSpeed JSON config to a JAX (parity) config: every key gets a fate "
                                 "(mapped, not_needed, unsupported) and a reason; a config with an unsupported key is "
                                 "refused with every reason printed. --to-deepspeed goes back (docs/migration.md).",
                     epilog=EXITS, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(p)
  p.set_defaults(handler=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The options of `parity port`."""
  parser.add_argument("config", help="DeepSpeed JSON config (comments and trailing commas allowed); with "
                      "--to-deepspeed, a ported YAML/JSON config")
  parser.add_argument("-o", "--output", help="write the ported config here (.yaml/.yml or .json); default: stdout")
  parser.add_argument("--report-json", metavar="FILE", help="write the migration report as JSON (default: none)")
  parser.add_argument("--report-md", metavar="FILE", help="write the migration report as Markdown (default: none)")
  parser.add_argument("--force", action="store_true", help="replace an existing output that is not the file "
                      "parity port wrote there (edited since, or another program's; default off: refused)")
  parser.add_argument("--quiet", action="store_true", help="do not print the key table (refusals are still printed; "
                                                           "default off)")
  g = parser.add_argument_group("values for \"auto\" keys (what the HF Trainer fills; default: none, an \"auto\" "
                                "without its value is refused)")
  g.add_argument("--micro-batch", type=_count, help="train_micro_batch_size_per_gpu (default: none)")
  g.add_argument("--grad-accum", type=_count, help="gradient_accumulation_steps (default: none)")
  g.add_argument("--world-size", type=_count,
                 help="data-parallel ranks (default 1, reported as implied)")
  g.add_argument("--lr", type=float_arg, help="optimizer.params.lr, scheduler warmup_max_lr (default: none)")
  g.add_argument("--betas", type=_betas, help="optimizer.params.betas, e.g. 0.9,0.999 (default: none)")
  g.add_argument("--eps", type=float_arg, help="optimizer.params.eps (default: none)")
  g.add_argument("--weight-decay", type=float_arg, help="optimizer.params.weight_decay (default: none)")
  g.add_argument("--warmup-steps", type=int_arg, help="scheduler.params.warmup_num_steps (default: none)")
  g.add_argument("--total-steps", type=int_arg, help="scheduler.params.total_num_steps (default: none)")
  g.add_argument("--max-grad-norm", type=float_arg, help="gradient_clipping (default: none)")
  x = g.add_mutually_exclusive_group()
  x.add_argument("--fp16", dest="precision", action="store_const", const="fp16", help="fp16.enabled=true")
  x.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="bf16.enabled=true")
  x.add_argument("--fp32", dest="precision", action="store_const", const="fp32", help="fp16 and bf16 disabled")
  g.add_argument("--hidden-size", type=_count,
                 help="model width for the bucket-size \"auto\"s (default: none)")
  add_stack_argument(parser)
  v = parser.add_argument_group("verification")
  v.add_argument("--verify", action="store_true", help="run DeepSpeed's scheduler and optimizer and the ported "
                 "optax ones side by side (two subprocesses) and compare (default off)")
  v.add_argument("--verify-steps", type=int_arg, default=200, help="steps to compare (default 200)")
  v.add_argument("--verify-timeout", type=float_arg, default=None, metavar="SECONDS", help="wall-clock limit per side "
                 "(default 900); past it the side is stopped and port exits 3")
  parser.add_argument("--to-deepspeed", action="store_true", help="reverse: ported YAML/JSON -> DeepSpeed JSON "
                                                                  "(default off)")


def add_stack_argument(parser: argparse.ArgumentParser) -> None:
  """--stack (port and compare --deepspeed-config): the training stack around deepspeed.initialize."""
  parser.add_argument("--stack", choices=STACKS, default=None, help="the training stack that runs the config, which "
                      "decides the optimizer class, param groups and decay mask the job gets (docs/migration.md, "
                      "'Training stacks'); default: hf-trainer when the config has \"auto\" values, else deepspeed "
                      "(a bare deepspeed.initialize)")


def _flags(args: argparse.Namespace):
  return Flags(micro_batch=args.micro_batch, grad_accum=args.grad_accum, world_size=args.world_size, lr=args.lr,
               betas=args.betas, eps=args.eps, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
               total_steps=args.total_steps, max_grad_norm=args.max_grad_norm, precision=args.precision,
               hidden_size=args.hidden_size, stack=args.stack)


def _fmt(path: str | None) -> str:
  return "json" if path and path.endswith(".json") else "yaml"


def run(args: argparse.Namespace) -> int:
  """Runs `parity port`. Returns 0 when ported (and verified, with --verify), 1 on a verify mismatch (or a side that
  crashed), EXIT_VERIFY_TIMEOUT (3) when a --verify side ran past --verify-timeout.

  Raises:
    PortError: a refused config (every reason in the message) or bad input; main exits 2.
    Failure: an output could not be written (exit 1), a verify side timed out (exit 3) or crashed (exit 1).
  """
  check_outputs(args.config, [("-o", args.output), ("--report-json", args.report_json),
                              ("--report-md", args.report_md)], force=args.force)
  if args.to_deepspeed:
    ds, report = to_deepspeed(read_structured(args.config), source=args.config)
    _show(args, report)
    if report.ported:
      _write(args.output, json.dumps(ds, indent=2) + "\n")
    _reports(args, report)
    code = _refusal(report)
    _done(args, load_ported(read_structured(args.config), source=args.config))
    return code
  if args.verify_steps < 1:
    raise PortError(f"--verify-steps must be >= 1; got {args.verify_steps}")
  vt = args.verify_timeout
  if vt is not None and not (0 < vt < float("inf")):
    raise PortError(f"--verify-timeout must be a positive number of seconds; got {vt}")
  result = port_config(read_deepspeed_config(args.config), _flags(args), source=args.config)
  _show(args, result.report)
  _reports(args, result.report)
  if result.ported is None:
    return _refusal(result.report)
  _write(args.output, result.ported.dumps(_fmt(args.output)))
  _done(args, result.ported)
  ln = result.report.loss_normalization
  print(f"loss normalisation: train.loss_normalization {ln['value']} recorded; {ln['why']}", file=sys.stderr)
  return _verify(args, result) if args.verify else EXIT_OK


def _done(args: argparse.Namespace, ported) -> None:
  """Prints (stderr) what was written and the next command: for a port, `parity compare --config OUT` (with --nproc
  for a multi-rank batch), or every reason compare cannot run it with how to run it; for --to-deepspeed (`ported`:
  the ported config read), how to run the DeepSpeed config."""
  what = "the DeepSpeed config" if args.to_deepspeed else "the ported JAX config"
  wrote = [f"{what} to {args.output}" if args.output else f"{what} to stdout"]
  wrote += [f"the migration report ({kind}) to {f}" for f, kind in ((args.report_json, "JSON"),
                                                                     (args.report_md, "Markdown")) if f]
  lines = ["parity port: wrote " + "; ".join(wrote)]
  target = args.output or "FILE (save it first with -o FILE)"
  world = ported.batch.world
  blockers = ported.not_runnable_by_compare
  if blockers:
    lines.append(f"parity compare cannot run this port ({len(blockers)} reason{'s' if len(blockers) > 1 else ''}):")
    lines += [f"  - {k}: {v.why}. {v.run}" for k, v in blockers.items()]
  if args.to_deepspeed:
    lines.append(f"next: launch it with {world} data-parallel rank{'s' if world > 1 else ''} (deepspeed.initialize "
                 f"reads {target})" + (f"; or parity compare --deepspeed-config {target}" if world == 1 and not
                                       blockers else ""))
  elif not blockers:
    nproc = f" --nproc {world}" if world > 1 else ""
    lines.append(f"next: parity compare --config {target}{nproc}" + (
        f"   (--nproc {world}: the config's {world} ranks; --nproc 1 runs the same global batch on one rank)"
        if nproc else ""))
  if not args.to_deepspeed and not args.verify:
    fp16 = ", the fp16 loss scaler" if ported.precision.compute_dtype == "fp16" else ""
    lines.append(f"{'next' if blockers else 'also'}: parity port {_port_args(args)} --verify   (the schedule, the "
                 f"optimizer{fp16} against DeepSpeed's own)")
  print("\n".join(lines), file=sys.stderr)


def _verify(args: argparse.Namespace, result) -> int:
  limit = args.verify_timeout if args.verify_timeout is not None else DEFAULT_TIMEOUT_S
  try:
    outcome = verify(result, steps=args.verify_steps, timeout=limit)
  except VerifyTimeout as e:
    raise Failure(f"verify timed out: {e}. A first run may be building DeepSpeed's ops; raise the limit with "
                  f"--verify-timeout SECONDS (now {limit:g}) or lower --verify-steps (now {args.verify_steps}).",
                  EXIT_VERIFY_TIMEOUT) from None
  except RuntimeError as e:
    raise Failure(f"verify failed: {e}") from None
  print(outcome.summary(), file=sys.stderr)
  return EXIT_OK if outcome.ok else EXIT_FAIL


_VALUE_FLAGS = ("micro_batch", "grad_accum", "world_size", "lr", "eps", "weight_decay", "warmup_steps", "total_steps",
                "max_grad_norm", "hidden_size")


def _port_args(args: argparse.Namespace) -> str:
  """The config and the value flags of this `parity port` call, as a shell would take them."""
  import shlex
  out = [shlex.quote(args.config)] + [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in _VALUE_FLAGS
                         if getattr(args, k) is not None]
  out += [f"--betas {args.betas[0]},{args.betas[1]}"] if args.betas else []
  out += [f"--{args.precision}"] if args.precision else []
  out += [f"--stack {args.stack}"] if getattr(args, "stack", None) else []
  return " ".join(out)


def _show(args: argparse.Namespace, report) -> None:
  """A port that went through: its outcome line first ('parity port: ported 35 keys: 30 mapped, 5 not_needed'), then
  the key table (--quiet: neither); a refusal: the table as before, its reasons after it (_refusal)."""
  if report.ported and not args.quiet:
    fates = {}
    for e in report.entries.values():
      fates[e.fate] = fates.get(e.fate, 0) + 1
    print(f"parity port: ported {report.source}: {len(report.entries)} keys ("
          + ", ".join(f"{n} {f}" for f, n in fates.items()) + "); the key table follows", file=sys.stderr)
  if not args.quiet:
    print_port_table(report, console(stderr=True))


def print_port_table(report, con) -> None:
  """The key-by-key port table (parity.migrate.Report): key, value (-> resolved "auto"), fate, target, reason; then
  the values DeepSpeed's defaults imply and the warnings."""
  from rich.markup import escape  # text is printed as written: "[adam_beta1, adam_beta2]" is not markup
  from rich.table import Table
  colour = {"mapped": "green", "not_needed": "cyan", "unsupported": "red"}
  if not con.is_terminal and (con.width or 0) < 200:  # a pipe or a log: wide rows, never squeezed to 80 columns
    from rich.console import Console
    con = Console(highlight=False, width=200, file=con.file)
  t = Table(title=f"parity port: {escape(report.source)}", show_lines=False)
  for col in ("key", "value", "fate", "target", "reason"):
    t.add_column(col, overflow="fold")
  for e in report.entries.values():
    val = json.dumps(e.value) + (f" → {json.dumps(e.resolved)}" if e.resolved is not None else "")
    t.add_row(escape(e.key), escape(val), f"[{colour[e.fate]}]{e.fate}[/]", escape(e.target or ""), escape(e.reason))
  con.print(t)
  st = report.stack
  if st is not None:
    refusal = f"; the stack refuses it: {escape(st['refusal'])}" if st["refusal"] else ""
    con.print(f"[yellow]stack[/] {escape(st['stack'])} ({escape(st['chosen_by'])}): {escape(st['summary'])}; decay "
              f"mask {st['decay_mask']}{refusal}")
  for i in report.implied:
    con.print(f"[yellow]implied[/] {escape(i['key'])} = {escape(json.dumps(i['value']))}: {escape(i['reason'])}")
  for w in report.warnings:
    con.print(f"[yellow]warning[/] {escape(w)}")


def _write(path: str | None, text: str) -> None:
  try:
    write_output(path, text)
  except OSError as e:  # disk full, read-only folder: nothing half-written (write_output renames a whole file)
    raise Failure(f"cannot write {e.filename or path or 'an output'} ({e.strerror or e}); nothing else was "
                  "changed") from None


def _reports(args: argparse.Namespace, report) -> None:
  if args.report_json:
    _write(args.report_json, report.to_json())
  if args.report_md:
    _write(args.report_md, report.to_markdown())


def _refusal(report) -> int:
  """0 when ported; else raises PortError listing every refusal reason (or the unsupported keys when the port
  recorded no message), one per line."""
  if report.ported:
    return EXIT_OK
  reasons = list(report.errors) or [f"{e.key}: {e.reason}" for e in report.entries.values() if e.fate == "unsupported"]
  head = "refused" if len(reasons) == 1 else f"refused, {len(reasons)} reasons"
  raise PortError(f"{head}:\n" + "\n".join(f"  - {r}" for r in reasons))


def main(argv: list[str] | None = None) -> int:
  """`parity port ARGS...` through the one `parity` entry point (same error path and exit codes)."""
  from parity.cli import main as parity_main  # a cycle: parity.cli imports this module to build its parser
  return parity_main(["port", *(argv or [])])
