"""`parity port`: argparse wiring. The lead mounts `add_arguments` / `run` under the `parity` CLI."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parity.migrate._ctx import Flags
from parity.migrate._read import PortError, read_deepspeed_config, read_structured

__all__ = ["add_arguments", "run", "flags_from_args", "main"]


def _betas(text: str) -> tuple[float, float]:
  try:
    a, b = (float(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"--betas expects two numbers like 0.9,0.999; got {text!r}") from None
  return a, b


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds `parity port` arguments to `parser`."""
  parser.add_argument("config", help="DeepSpeed JSON config (comments and trailing commas allowed); with "
                      "--to-deepspeed, a ported YAML/JSON config")
  parser.add_argument("-o", "--output", help="write the ported config here (.yaml/.yml or .json); default: stdout")
  parser.add_argument("--report-json", metavar="FILE", help="write the migration report as JSON")
  parser.add_argument("--report-md", metavar="FILE", help="write the migration report as Markdown")
  parser.add_argument("--quiet", action="store_true", help="do not print the report table")
  g = parser.add_argument_group("values for \"auto\" keys (what the HF Trainer fills)")
  g.add_argument("--micro-batch", type=int, help="train_micro_batch_size_per_gpu")
  g.add_argument("--grad-accum", type=int, help="gradient_accumulation_steps")
  g.add_argument("--world-size", type=int, help="data-parallel ranks (default 1, reported as implied)")
  g.add_argument("--lr", type=float, help="optimizer.params.lr, scheduler warmup_max_lr")
  g.add_argument("--betas", type=_betas, help="optimizer.params.betas, e.g. 0.9,0.999")
  g.add_argument("--eps", type=float, help="optimizer.params.eps")
  g.add_argument("--weight-decay", type=float, help="optimizer.params.weight_decay")
  g.add_argument("--warmup-steps", type=int, help="scheduler.params.warmup_num_steps")
  g.add_argument("--total-steps", type=int, help="scheduler.params.total_num_steps")
  g.add_argument("--max-grad-norm", type=float, help="gradient_clipping")
  p = g.add_mutually_exclusive_group()
  p.add_argument("--fp16", dest="precision", action="store_const", const="fp16", help="fp16.enabled=true")
  p.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="bf16.enabled=true")
  p.add_argument("--fp32", dest="precision", action="store_const", const="fp32", help="fp16 and bf16 disabled")
  g.add_argument("--hidden-size", type=int, help="model width for the bucket-size \"auto\"s")
  v = parser.add_argument_group("verification")
  v.add_argument("--verify", action="store_true", help="run DeepSpeed's scheduler and optimizer and the ported "
                 "optax ones side by side (two subprocesses) and compare")
  v.add_argument("--verify-steps", type=int, default=200, help="steps to compare (default 200)")
  parser.add_argument("--to-deepspeed", action="store_true", help="reverse: ported YAML/JSON -> DeepSpeed JSON")


def flags_from_args(args: argparse.Namespace) -> Flags:
  return Flags(micro_batch=args.micro_batch, grad_accum=args.grad_accum, world_size=args.world_size, lr=args.lr,
               betas=args.betas, eps=args.eps, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
               total_steps=args.total_steps, max_grad_norm=args.max_grad_norm, precision=args.precision,
               hidden_size=args.hidden_size)


def _write(path: str | None, text: str) -> None:
  if path is None:
    sys.stdout.write(text)
  else:
    Path(path).write_text(text, encoding="utf-8")


def _fmt(path: str | None) -> str:
  return "json" if path and path.endswith(".json") else "yaml"


def run(args: argparse.Namespace) -> int:
  """Runs `parity port`. Returns 0 when ported (and verified, with --verify), 2 when refused, 1 on a verify mismatch."""
  from parity.migrate._port import port_config
  from parity.migrate._reverse import to_deepspeed
  try:
    if args.to_deepspeed:
      ds, report = to_deepspeed(read_structured(args.config), source=args.config)
      if not args.quiet:
        report.print_table()
      if report.ported:
        _write(args.output, json.dumps(ds, indent=2) + "\n")
      _reports(args, report)
      return _refusal(report)
    raw = read_deepspeed_config(args.config)
    if args.verify_steps < 1:
      raise PortError(f"--verify-steps must be >= 1; got {args.verify_steps}")
    result = port_config(raw, flags_from_args(args), source=args.config)
  except PortError as e:
    print(f"parity port: error: {e}", file=sys.stderr)
    return 2
  if not args.quiet:
    result.report.print_table()
  _reports(args, result.report)
  if result.ported is None:
    return _refusal(result.report)
  _write(args.output, result.ported.dumps(_fmt(args.output)))
  if args.verify:
    from parity.migrate.verify import verify
    outcome = verify(result, steps=args.verify_steps)
    print(outcome.summary(), file=sys.stderr)
    return 0 if outcome.ok else 1
  return 0


def _reports(args: argparse.Namespace, report) -> None:
  if args.report_json:
    Path(args.report_json).write_text(report.to_json(), encoding="utf-8")
  if args.report_md:
    Path(args.report_md).write_text(report.to_markdown(), encoding="utf-8")


def _refusal(report) -> int:
  if report.ported:
    return 0
  msg = report.errors[0] if report.errors else "a key is unsupported (see the report)"
  more = f" (+{len(report.errors) - 1} more in the report)" if len(report.errors) > 1 else ""
  print(f"parity port: refused: {msg}{more}", file=sys.stderr)
  return 2


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="parity port", description=__doc__)
  add_arguments(parser)
  return run(parser.parse_args(argv))


if __name__ == "__main__":
  raise SystemExit(main())
