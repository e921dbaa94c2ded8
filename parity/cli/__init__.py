"""The `parity` command line: one module per subcommand group, one error path for all of them.

  parity compare [--preset NAME] [--config FILE] [--set key=value ...] [--steps N] [--sides a,b,c]
                 [--data SRC] [--out DIR] [--perturb side:key=value ...] [--timeout S]      (compare.py)
  parity report RUN_DIR...         (re-render a finished run; several: a comparison page)    (report.py)
  parity check NEW BASELINE        (regression gate of a run against a run or card)           (report.py)
  parity diagnose [--preset NAME | --config FILE | --hf-model DIR] [--step N] [--sides jax,torch]
                  [--perturb side:key=value ...] [--plant side:kind ...] [--out DIR]         (diagnose.py)
  parity estimate [--preset NAME | --model llama-7b] [--plan NAME]   (memory model, both sides)  (sizing.py)
  parity plan [--preset NAME | --model llama-7b] --hardware H100     (fastest plan pair that fits) (sizing.py)
  parity presets                   (run presets and model-size presets)                      (sizing.py)
  parity port CONFIG ...           (DeepSpeed config -> JAX config)                          (port.py)
  parity convert-weights SRC DST   (Hugging Face folder <-> canonical safetensors <-> orbax) (convert_weights.py)
  parity build-ops [OP ...]        (build DeepSpeed's C++ ops once, up front)                (build_ops.py)
  parity doctor [--quick] [--json FILE]  (versions, devices, memory kinds, ops, bandwidth)   (doctor.py)

Exit codes: 0 parity holds / success, 1 parity does not hold (or a command could not finish), 2 bad input,
130 interrupted. Every error is one line `parity COMMAND: error: ...` on stderr (main); a bug prints one line and
saves the traceback to a file. Each subcommand module has `register(subparsers)`, which sets its handler.
"""
from __future__ import annotations

import argparse
import sys

from parity.cli._common import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_OK, Failure, show_defaults

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAIL", "EXIT_BAD_INPUT"]


def _version() -> str:
  from importlib.metadata import PackageNotFoundError, version
  try:
    return version("parity")
  except PackageNotFoundError:  # run from a checkout that is not installed
    return "unknown (not installed; pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
  """The `parity` parser with every subcommand; each subparser's `handler` default runs it."""
  from parity.cli import build_ops, compare, convert_weights, diagnose, doctor, port, report, sizing
  ap = argparse.ArgumentParser(prog="parity", description="Runs the same GPT training in JAX, DeepSpeed and plain "
                               "PyTorch and gives a verdict on numerical parity (README.md).",
                               epilog="exit status: 0 parity holds / success, 1 parity does not hold, 2 bad input, "
                                      "130 interrupted; `parity COMMAND -h` for each command")
  ap.add_argument("--version", action="version", version=f"parity {_version()}")
  sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
  compare.register(sub)
  report.register(sub)
  diagnose.register(sub)
  sizing.register(sub)
  port.register(sub)
  convert_weights.register(sub)
  build_ops.register(sub)
  doctor.register(sub)
  show_defaults(ap)
  return ap


def _sigterm_as_interrupt(signum, frame):
  raise KeyboardInterrupt


def _bad_input_types() -> tuple[type[BaseException], ...]:
  """The rule: an input error of any module (SpecError, DataError, PortError: all ValueErrors; a path that is not
  there or not the right kind) is bad input, exit 2."""
  return (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, UnicodeError)


def main(argv: list[str] | None = None) -> int:
  """Runs one `parity` command; returns its exit code (module docstring). Never raises but SystemExit from argparse
  (usage errors exit 2, --help and --version 0)."""
  import signal
  from parity.pipeline.folder import RunIOError
  signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # SIGTERM stops the workers too, like Ctrl-C
  ap = build_parser()
  args = ap.parse_args(argv)
  bad = _bad_number_flag(args, sys.argv[1:] if argv is None else argv)
  if bad:
    ap.exit(EXIT_BAD_INPUT, f"parity {args.command}: error: {bad}\n")
  if getattr(args, "allow_large", False):
    import os
    from parity.sizing.resources import ALLOW_LARGE_ENV
    os.environ[ALLOW_LARGE_ENV] = "1"
  try:
    return args.handler(args)
  except Failure as exc:
    return _error(args.command, str(exc), exc.code)
  except _bad_input_types() as exc:
    return _error(args.command, str(exc), EXIT_BAD_INPUT)
  except MemoryError:
    return _error(args.command, "out of memory; the sizes asked for (train.steps, micro_batch_size, seq_len, "
                                "model.*) do not fit this machine: reduce them", EXIT_BAD_INPUT)
  except RunIOError as exc:  # the run's own files could not be written: attempted, no trustworthy result
    return _error(args.command, str(exc), EXIT_FAIL)
  except KeyboardInterrupt:
    print(f"parity {args.command}: {_interrupted_what(args.command)}", file=sys.stderr)
    return 130
  except Exception as exc:  # a bug, not bad input: one line, the traceback in a file, exit 1
    print(f"parity {args.command}: internal error: {type(exc).__name__}: {str(exc)[:300]} "
          f"(traceback saved to {_save_traceback(args.command)}; please report it)", file=sys.stderr)
    return EXIT_FAIL


def _interrupted_what(command: str) -> str:
  """What a Ctrl-C/SIGTERM actually stopped: before any worker started nothing ran and no report exists; after,
  the worker was killed (harness.runner) and compare/diagnose wrote the report of what ran."""
  from harness import lifetime
  if not lifetime.workers_started():
    return "interrupted before any side started; nothing ran and no report was written"
  if command in ("compare", "diagnose"):
    return "interrupted; the running side was killed and the report marks it"
  return "interrupted; the worker it started was killed with its child processes"


def _error(command: str, message: str, code: int) -> int:
  """The one error path: `parity COMMAND: error: MESSAGE` on stderr; returns `code`."""
  print(f"parity {command}: error: {message}", file=sys.stderr)
  return code


def _bad_number_flag(args, argv: list[str] | None = None) -> str | None:
  """The rule for every numeric flag of every command (argparse's float() takes '1e400' and 'nan'): floats finite,
  integers within parity.spec.INT_MAX. Returns the message naming the first bad flag and the text typed for it
  (1e400, not the inf it parsed to), or None."""
  import math
  from parity.spec import INT_MAX
  for dest, v in vars(args).items():
    flag = "--" + dest.replace("_", "-")
    if isinstance(v, float) and not math.isfinite(v):
      return f"{flag} {_typed(argv or [], flag, v)}: must be a finite number"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_MAX:
      return f"{flag} {_typed(argv or [], flag, v)}: out of range (at most {INT_MAX:,})"
  return None


def _typed(argv: list[str], flag: str, value) -> str:
  """What the user typed for `flag` in `argv` (its last `--flag X` or `--flag=X`), else `value` as parsed."""
  typed = None
  for i, tok in enumerate(argv):
    if tok == flag and i + 1 < len(argv):
      typed = argv[i + 1]
    elif tok.startswith(flag + "="):
      typed = tok[len(flag) + 1:]
  return typed if typed is not None else str(value)


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
