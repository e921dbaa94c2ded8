"""The `parity` command line: one module per subcommand group, one error path for all of them.

  parity compare [--preset NAME] [--config FILE] [--set key=value ...] [--steps N] [--sides a,b,c]
                 [--data SRC] [--out DIR] [--perturb side:key=value ...] [--timeout S]      (compare.py)
  parity report RUN_DIR...         (re-render a finished run; several: a comparison page)    (report.py)
  parity check NEW BASELINE        (regression gate of a run against a run or card)           (report.py)
  parity join A B [--out DIR]      (one verdict over one request's sides run on two machines)  (join.py)
  parity diagnose [--preset NAME | --config FILE | --hf-model DIR] [--step N] [--sides jax,torch]
                  [--perturb side:key=value ...] [--plant side:kind ...] [--out DIR]         (diagnose.py)
  parity estimate [--preset NAME | --model llama-7b] [--plan NAME]   (memory model, both sides)  (sizing.py)
  parity plan [--preset NAME | --model llama-7b] --hardware H100     (fastest plan pair that fits) (sizing.py)
  parity presets                   (run presets and model-size presets)                      (sizing.py)
  parity port CONFIG ...           (DeepSpeed config -> JAX config)                          (port.py)
  parity convert-weights SRC DST   (Hugging Face folder <-> canonical safetensors <-> orbax) (convert_weights.py)
  parity build-ops [OP ...]        (build DeepSpeed's C++ ops once, up front)                (build_ops.py)
  parity doctor [--quick] [--json FILE]  (versions, devices, memory kinds, ops, bandwidth)   (doctor.py)

Exit codes: 0 parity holds / success, 1 parity does not hold (or a command could not finish), 2 bad input (a
parity.errors.ParityInputError, or an OS error on a path the user gave: BAD_INPUT_TYPES, _os_error), 3 incomplete (a
run that held but left default sides out: parity.report.build.EXIT_INCOMPLETE), 130 interrupted.
Every error is one line `parity COMMAND: error: ...` on stderr (main); a bug (any other exception, a plain ValueError
included) prints one line `parity COMMAND: internal error: ...` and saves the traceback to a file, exit 1. Each
subcommand module has `register(subparsers)`, which sets its handler.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys

from parity.cli._common import (BAD_PATH_ERRNOS, EXIT_BAD_INPUT, EXIT_FAIL, EXIT_OK, LIMITS, PATH_ERRNOS, Failure,
                                bad_path_arg, path_error, show_defaults, shown_path as _shown)
from parity.errors import ParityInputError
from parity.cli import build_ops, compare, convert_weights, diagnose, doctor, join, port, report, sizing
from harness import lifetime
from parity.sizing.resources import ALLOW_LARGE_ENV
from parity.pipeline.claim import RunIOError
from parity.spec import INT_MAX

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAIL", "EXIT_BAD_INPUT"]


def _version() -> str:
  from importlib.metadata import PackageNotFoundError, version
  try:
    return version("parity")
  except PackageNotFoundError:  # run from a checkout that is not installed
    return "unknown (not installed; pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
  """The `parity` parser with every subcommand; each subparser's `handler` default runs it."""
  ap = argparse.ArgumentParser(prog="parity", description="Runs the same GPT training in JAX, DeepSpeed and plain "
                               "PyTorch and gives a verdict on numerical parity (README.md).",
                               epilog="exit status: 0 parity holds / success, 1 parity does not hold, 2 bad input, "
                                      "3 incomplete (compare: a default side left out), 130 interrupted; "
                                      "`parity COMMAND -h` for each command")
  ap.add_argument("--version", action="version", version=f"parity {_version()}")
  sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
  compare.register(sub)
  report.register(sub)
  join.register(sub)
  diagnose.register(sub)
  sizing.register(sub)
  port.register(sub)
  convert_weights.register(sub)
  build_ops.register(sub)
  doctor.register(sub)
  show_defaults(ap)
  return ap


BAD_INPUT_TYPES: tuple[type[BaseException], ...] = (
    ParityInputError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)
"""The rule: the project's own input errors (parity.errors.ParityInputError: SpecError, DataError, PortError, ...)
and a path that is not there or not the right kind are bad input, exit 2; so is any OSError on a path the user gave
(`_os_error`). Any other exception, a plain ValueError or UnicodeError included, is a bug (`_internal`, exit 1)."""


_COMMAND_LINE: list[str] = []
"""The arguments of the running `main` call (sys.argv[1:] from the shell), for the saved traceback's first line."""


def main(argv: list[str] | None = None) -> int:
  """Runs one `parity` command; returns its exit code (module docstring). Never raises but SystemExit from argparse
  (usage errors exit 2, --help and --version 0). Ctrl-C and SIGTERM follow harness.lifetime.stop_signals: the
  first stops the running worker (or, when none runs, waits for what is being written), later ones are ignored,
  and the message says which it was, what was running and what is on disk (exit 130)."""
  ap = build_parser()
  argv = sys.argv[1:] if argv is None else list(argv)
  _COMMAND_LINE[:] = argv  # what a saved traceback names (main(argv) from Python, not the interpreter's sys.argv)
  args = ap.parse_args(argv)
  bad = _bad_number_flag(args, argv)
  if bad:
    ap.exit(EXIT_BAD_INPUT, f"parity {args.command}: error: {bad}\n")
  bad = _empty_flag(argv, _takes_no_value(ap, args.command))
  if bad:
    return _error(args.command, bad, EXIT_BAD_INPUT)
  bad = bad_path_arg(ap, args)  # a path no OS can open (a NUL byte, a name over 255 bytes): before anything runs
  if bad:
    return _error(args.command, bad, EXIT_BAD_INPUT)
  if getattr(args, "allow_large", False):
    os.environ[ALLOW_LARGE_ENV] = "1"
  with lifetime.stop_signals() as stop:
    try:
      return _run(ap, args)
    except KeyboardInterrupt:
      print(f"parity {args.command}: {_interrupted_what(args.command, stop)}", file=sys.stderr)
      return 130


def _run(ap: argparse.ArgumentParser, args) -> int:
  """The handler, with every error but KeyboardInterrupt mapped to its one line and exit code."""
  try:
    return args.handler(args)
  except Failure as exc:
    return _error(args.command, *_failure(ap, args, exc))
  except OSError as exc:
    code, message = _os_error(ap, args, exc)
    return _internal(args.command, exc) if message is None else _error(args.command, message, code)
  except BAD_INPUT_TYPES as exc:
    return _error(args.command, str(exc), EXIT_BAD_INPUT)
  except MemoryError:
    return _error(args.command, "out of memory; the sizes asked for (train.steps, micro_batch_size, seq_len, "
                                "model.*) do not fit this machine: reduce them", EXIT_BAD_INPUT)
  except Exception as exc:  # a bug, not bad input: one line, the traceback in a file, exit 1
    io = _library_io_error(exc)
    if io is None:
      return _internal(args.command, exc)
    code, message = _os_error(ap, args, io)
    return _error(args.command, message or f"cannot write {io.filename} ({io.strerror})", code)


def _library_io_error(exc: Exception) -> OSError | None:
  """The OSError inside a library's own exception for a failed write: safetensors' SafetensorError reads
  'I/O error: Permission denied (os error 13) at path "/x/.tmpAB12"'. None for any other exception."""
  import re
  m = re.search(r"\(os error (\d+)\)(?: at path \"(.*)\")?", str(exc))
  if type(exc).__name__ != "SafetensorError" or m is None:
    return None
  code = int(m.group(1))
  return OSError(code, os.strerror(code), m.group(2))


def _os_error(ap: argparse.ArgumentParser, args, exc: OSError) -> tuple[int, str | None]:
  """(exit code, message) for an OSError; message None: not an input error (a bug, or this machine's own problem).

  An OS error on a path the user gave (or inside or above it: a file of the run folder, a parent folder) is bad
  input naming the argument (parity.cli._common.path_error); so is a run folder that cannot be created or written
  for such a reason (RunIOError, which already names --out); a RunIOError for another reason (disk full) is exit 1:
  the run was attempted; so is a read-only file system (the machine's state), the argument named all the same.
  A name too long for the OS is bad input wherever it came from (a config's `data:`). The FileNotFoundError-like
  errors the modules raise with their own message stay exit 2."""
  if isinstance(exc, RunIOError):
    return (EXIT_BAD_INPUT if exc.errno in BAD_PATH_ERRNOS else EXIT_FAIL), str(exc)
  named = path_error(ap, args, exc)
  if named is not None:
    return (EXIT_FAIL if exc.errno == errno.EROFS else EXIT_BAD_INPUT), named
  if exc.errno == errno.ENAMETOOLONG and exc.filename is not None:  # from a config value (data: ...): still input
    return EXIT_BAD_INPUT, f"{_shown(os.fsdecode(exc.filename))}: {PATH_ERRNOS[errno.ENAMETOOLONG].format(what=LIMITS)}"
  if isinstance(exc, BAD_INPUT_TYPES):
    return EXIT_BAD_INPUT, str(exc)
  return EXIT_FAIL, None


def _failure(ap: argparse.ArgumentParser, args, exc: Failure) -> tuple[str, int]:
  """(message, exit code) of a Failure. One raised for an OSError (its __context__, kept under `from None`) that
  makes a user's path unusable (BAD_PATH_ERRNOS: a folder in a file's place, no permission) is bad input, exit 2,
  with the message that names the argument (its own, where it does; else path_error's: a Failure written for an
  output says "cannot write" even when the source could not be read); other Failures keep their code."""
  named = path_error(ap, args, exc.__context__, BAD_PATH_ERRNOS) if exc.code == EXIT_FAIL else None
  if named is None:
    return str(exc), exc.code
  flag = named.split(" ", 1)[0]
  return (str(exc) if str(exc).startswith(flag + " ") else named), EXIT_BAD_INPUT


def _internal(command: str, exc: BaseException) -> int:
  """A bug: one line naming the exception and the file its traceback was saved to; exit 1."""
  print(f"parity {command}: internal error: {type(exc).__name__}: {str(exc)[:300]} "
        f"(traceback saved to {_save_traceback(command)}; please report it)", file=sys.stderr)
  return EXIT_FAIL


def _interrupted_what(command: str, stop) -> str:
  """What a Ctrl-C/SIGTERM actually stopped, from harness.lifetime's StopState `stop`: which signal, what was
  running then (a side's worker, the reruns, the report being written) and what stopping did to it, what the
  command left on disk, and the signals after the first (ignored)."""
  sig = {"SIGINT": "Ctrl-C (SIGINT)", None: "Ctrl-C"}.get(stop.signal, stop.signal)
  reports = command in ("compare", "diagnose")
  if stop.held and stop.doing:
    parts = [f"{sig} came while {stop.doing[0]}; {stop.on_stop or 'that was finished first'}"]
  elif stop.doing:
    where = "".join(f" {w}" for w in stop.within)
    parts = [f"interrupted by {sig} while {stop.doing[0]}{where}" + (f": {stop.on_stop}" if stop.on_stop else "")]
  elif not lifetime.workers_started():
    parts = [f"interrupted by {sig} before any side started; nothing ran" if reports else f"interrupted by {sig}"]
  elif reports:
    parts = [f"interrupted by {sig}"]
  else:
    parts = [f"interrupted by {sig}; the worker it started was killed with its child processes"]
  if stop.on_disk:
    parts.append(stop.on_disk)
  elif reports:
    parts.append("no report was written")
  if stop.later:
    parts.append(f"{len(stop.later)} more signal(s) ({', '.join(stop.later)}) came while it was stopping and "
                 "were ignored, so that it could finish")
  return "; ".join(parts)


def _error(command: str, message: str, code: int) -> int:
  """The one error path: `parity COMMAND: error: MESSAGE` on stderr; returns `code`."""
  print(f"parity {command}: error: {message}", file=sys.stderr)
  return code


def _bad_number_flag(args, argv: list[str] | None = None) -> str | None:
  """The rule for every numeric flag of every command (argparse's float() takes '1e400' and 'nan'): floats finite,
  integers within parity.spec.INT_MAX. Returns the message naming the first bad flag and the text typed for it
  (1e400, not the inf it parsed to), or None."""
  import math
  for dest, v in vars(args).items():
    flag = "--" + dest.replace("_", "-")
    if isinstance(v, float) and not math.isfinite(v):
      return f"{flag} {_typed(argv or [], flag, v)}: must be a finite number"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_MAX:
      return f"{flag} {_typed(argv or [], flag, v)}: out of range (at most {INT_MAX:,})"
  return None


def _takes_no_value(ap, command: str) -> set[str]:
  """The option strings of `command` (and the top level) that take no value (store_true and the like)."""
  parsers = [ap] + [a.choices[command] for a in ap._actions
                    if isinstance(a, argparse._SubParsersAction) and command in a.choices]
  return {o for p in parsers for a in p._actions if a.nargs == 0 for o in a.option_strings}


def _empty_flag(argv: list[str], no_value: set[str] = frozenset()) -> str | None:
  """The message for the first option given an empty or blank value (`--sides ""`, `--preset=`), or None: an empty
  value is a slip (an unset shell variable), never a request for the default (`--sides ""` once ran
  all three sides, `--preset ""` the default preset)."""
  for i, tok in enumerate(argv):
    if tok == "--" or not (tok.startswith("--") or (len(tok) == 2 and tok[0] == "-" and tok[1].isalpha())):
      continue
    if "=" in tok:
      flag, value = tok.split("=", 1)
    elif tok not in no_value and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
      flag, value = tok, argv[i + 1]
    else:
      continue
    if value.strip() == "":
      return f"{flag} is given an empty value; give it one, or leave the option out for its default"
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
      f.write(" ".join(["parity", *_COMMAND_LINE]) + "\n\n" + traceback.format_exc())
    return path
  except OSError as exc:
    return f"nowhere: {exc.strerror}"
