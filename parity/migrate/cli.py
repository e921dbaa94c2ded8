"""`parity port`: argparse wiring. The lead mounts `add_arguments` / `run` under the `parity` CLI."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from parity.migrate._ctx import Flags
from parity.migrate._read import PortError, read_deepspeed_config, read_structured

__all__ = ["add_arguments", "run", "flags_from_args", "main", "EXIT_VERIFY_TIMEOUT"]

EXIT_VERIFY_TIMEOUT = 3
"""`parity port --verify` exit code when a side ran past --verify-timeout: neither a verdict (0 verified, 1 mismatch)
nor bad input (2)."""


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
  v.add_argument("--verify-timeout", type=float, default=None, metavar="SECONDS", help="wall-clock limit per side "
                 "(default 900); past it the side is stopped and port exits 3")
  parser.add_argument("--to-deepspeed", action="store_true", help="reverse: ported YAML/JSON -> DeepSpeed JSON")


def flags_from_args(args: argparse.Namespace) -> Flags:
  return Flags(micro_batch=args.micro_batch, grad_accum=args.grad_accum, world_size=args.world_size, lr=args.lr,
               betas=args.betas, eps=args.eps, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
               total_steps=args.total_steps, max_grad_norm=args.max_grad_norm, precision=args.precision,
               hidden_size=args.hidden_size)


OURS = ("schema: parity.ported/1", '"schema": "parity.ported/1"', '"schema": "parity.migration/1"',
        "# Migration report:")
"""Text any file `parity port` writes starts with (or holds in its first 4 KiB): only such a file is replaced."""


def check_outputs(args: argparse.Namespace) -> None:
  """Refuses, before anything is read or written, output paths that would destroy something: an output that is the
  input config (also through a symlink, `..` or a relative path), two outputs that are the same file, an output that
  is a folder, and an existing file that `parity port` did not write (OURS). An earlier port output is replaced.

  Raises:
    PortError: naming the flag, the path and the fix.
  """
  outs = [(flag, getattr(args, attr)) for flag, attr in (("-o", "output"), ("--report-json", "report_json"),
                                                          ("--report-md", "report_md")) if getattr(args, attr, None)
          is not None]
  src = Path(args.config)
  seen: dict[str, str] = {}
  for flag, raw in outs:
    if str(raw).strip() == "":
      raise PortError(f"{flag} '': an empty path names no file; give a file name or leave {flag} out")
    p = Path(raw)
    real = os.path.realpath(p)
    if real == os.path.realpath(src) or (p.exists() and src.exists() and os.path.samefile(p, src)):
      raise PortError(f"{flag} {raw}: that is the input config {args.config}; writing it would destroy the input. "
                      "Give another output path")
    if real in seen:
      raise PortError(f"{flag} {raw}: the same file as {seen[real]}; give each output its own path")
    seen[real] = f"{flag} {raw}"
    if p.is_dir():
      raise PortError(f"{flag} {raw}: is a folder; give a file path")
    if p.exists() or p.is_symlink():
      try:
        with open(p, "rb") as f:
          head = f.read(4096).decode("utf-8", "replace")
      except OSError as exc:
        raise PortError(f"{flag} {raw}: exists and cannot be read ({exc.strerror}); give a new path") from None
      if not any(mark in head for mark in OURS):
        raise PortError(f"{flag} {raw}: exists and was not written by `parity port`; it is never overwritten. "
                        "Give a new path, or remove the file first")


def _write(path: str | None, text: str) -> None:
  """Writes an output through a temporary file and a rename (a failed write never leaves half a file).

  Raises:
    OSError: the file cannot be written (the caller names it and exits 1).
  """
  if path is None:
    sys.stdout.write(text)
    return
  p = Path(path)
  tmp = p.with_name(f".{p.name}.tmp")
  try:
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, p)
  except OSError:
    tmp.unlink(missing_ok=True) if tmp.parent.is_dir() else None
    raise


def _fmt(path: str | None) -> str:
  return "json" if path and path.endswith(".json") else "yaml"


def run(args: argparse.Namespace) -> int:
  """Runs `parity port`. Returns 0 when ported (and verified, with --verify), 2 when refused, 1 on a verify mismatch
  (or a side that crashed), EXIT_VERIFY_TIMEOUT (3) when a --verify side ran past --verify-timeout."""
  try:
    check_outputs(args)
    return _run(args)
  except PortError as e:
    print(f"parity port: error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # an output could not be written (disk full, read-only folder)
    print(f"parity port: error: cannot write {e.filename or 'an output'} ({e.strerror or e}); nothing else was "
          "changed", file=sys.stderr)
    return 1


def _run(args: argparse.Namespace) -> int:
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
    vt = getattr(args, "verify_timeout", None)
    if vt is not None and not (0 < vt < float("inf")):
      raise PortError(f"--verify-timeout must be a positive number of seconds; got {vt}")
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
    from parity.migrate.verify import DEFAULT_TIMEOUT_S, VerifyTimeout, verify
    limit = vt if vt is not None else DEFAULT_TIMEOUT_S
    try:
      outcome = verify(result, steps=args.verify_steps, timeout=limit)
    except VerifyTimeout as e:
      print(f"parity port: verify timed out: {e}. A first run may be building DeepSpeed's ops; raise the limit with "
            f"--verify-timeout SECONDS (now {limit:g}) or lower --verify-steps (now {args.verify_steps}).",
            file=sys.stderr)
      return EXIT_VERIFY_TIMEOUT
    except RuntimeError as e:
      print(f"parity port: verify failed: {e}", file=sys.stderr)
      return 1
    print(outcome.summary(), file=sys.stderr)
    return 0 if outcome.ok else 1
  return 0


def _reports(args: argparse.Namespace, report) -> None:
  if args.report_json:
    _write(args.report_json, report.to_json())
  if args.report_md:
    _write(args.report_md, report.to_markdown())


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
