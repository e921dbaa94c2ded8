"""What every `parity` subcommand shares: exit codes, the console, the defaults in help texts, `Failure`."""
from __future__ import annotations

import argparse
import errno
import math
import os
from parity.errors import SpecError
from parity.inputs import ascii_number
from parity.presets import DEFAULT_PRESET

__all__ = ["EXIT_OK", "EXIT_FAIL", "EXIT_BAD_INPUT", "Failure", "console", "add_allow_large", "split_list",
           "show_defaults", "add_run_source", "PATH_ARGS", "PATH_ERRNOS", "BAD_PATH_ERRNOS", "LIMITS",
           "path_problem", "bad_path_arg", "path_error", "shown_path", "check_json_target"]

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


class Failure(Exception):
  """A command that ran but could not finish (an output not written, a verify that timed out): main prints
  `parity X: error: <message>` on stderr and exits with `code` (never 0 or 2: those mean done and bad input)."""

  def __init__(self, message: str, code: int = EXIT_FAIL):
    super().__init__(message)
    self.code = code


def console(stderr: bool = False):
  """A rich Console; 160 columns when not a terminal (logs and CI: tables are not squeezed into 80)."""
  from rich.console import Console  # rich: loaded when something is printed
  con = Console(highlight=False, stderr=stderr)
  if not con.is_terminal:
    con = Console(highlight=False, width=160, stderr=stderr)
  return con


def add_run_source(p: argparse.ArgumentParser, *, set_example: str, preset: bool = True) -> None:
  """--preset (when `preset`), --config and --set: the run sources every run-building command hands to
  parity.pipeline.resolve.resolve_run (overrides as key=value strings, parsed by parity.overrides.parse_overrides)."""
  if preset:
    p.add_argument("--preset", default=None, help=f"built-in run (default {DEFAULT_PRESET}); see `parity presets`")
  p.add_argument("--config", help="run config file (YAML or JSON) merged over the preset (default: none)")
  p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                 help=f"dotted override, applied last, e.g. {set_example} (default: none)")


def add_allow_large(p: argparse.ArgumentParser) -> None:
  p.add_argument("--allow-large", action="store_true",
                 help="run even when the estimated memory or disk of the run exceeds what this machine has "
                      "(sets PARITY_ALLOW_LARGE=1; see parity.sizing.resources.check_resources; default off)")


def split_list(text: str | None) -> list[str] | None:
  """'a, b,,c' -> ['a', 'b', 'c']; None stays None."""
  return None if text is None else [s.strip() for s in text.split(",") if s.strip()]


def show_defaults(parser: argparse.ArgumentParser) -> None:
  """The rule for every option's help: it says its default. An option with a default value that its help does
  not mention gets ' (default: VALUE)' appended; options whose default is None must say in words what they
  default to (tests/test_cli.py checks every option of every subcommand)."""
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for sub in action.choices.values():
        show_defaults(sub)
      continue
    if not action.help or action.help == argparse.SUPPRESS or "default" in action.help:
      continue
    d = action.default
    if d is None or d is argparse.SUPPRESS or isinstance(d, bool) or d == []:
      continue
    action.help += f" (default: {d})"


def int_arg(text: str) -> int:
  """argparse type of an integer flag, in ASCII digits (argparse's int() also reads '１６')."""
  try:
    return ascii_number(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer in ASCII digits, got {text!r}") from None


def float_arg(text: str) -> float:
  """argparse type of a number flag, in ASCII digits (argparse's float() also reads '１.５'); finiteness is checked
  with every flag's (parity.cli._bad_number_flag)."""
  try:
    return ascii_number(text, float)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number in ASCII digits, got {text!r}") from None


def count_arg(text: str) -> int:
  """argparse type for counts: an integer, also written as an integral float ('2e9'), in ASCII digits; refuses
  inf/nan/fractions."""
  try:
    return ascii_number(text)
  except ValueError:
    pass
  try:
    x = ascii_number(text, float)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer in ASCII digits, got {text!r}") from None
  if not math.isfinite(x) or not x.is_integer():
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
  return int(x)


# ----------------------------------------------------------------------------- paths the user gives
def check_json_target(path: str | None, force: bool, *, dash_is_stdout: bool = False) -> None:
  """Refuses (SpecError, exit 2, before anything is computed) a `--json FILE` that cannot be written as asked: a
  parent that is a file or missing, or a FILE that exists (a file or a link) without --force: nothing a user had is
  replaced without asking. '-' is stdout where the command says so (`dash_is_stdout`: doctor); elsewhere it is
  refused rather than written as a file named '-'. None (no --json) passes."""
  if path is None or (path == "-" and dash_is_stdout):
    return
  if path == "-":
    raise SpecError("--json -: this command prints its table to stdout and writes the JSON to a file; give a path")
  parent = os.path.dirname(os.path.abspath(path))
  if os.path.exists(parent) and not os.path.isdir(parent):
    raise SpecError(f"--json {path}: {parent} is a file where a folder is expected; pick another path")
  if not os.path.isdir(parent):
    raise SpecError(f"--json {path}: folder {parent} does not exist; create it or pick another path")
  if (os.path.isfile(path) or os.path.islink(path)) and not force:
    raise SpecError(f"--json {path}: it already exists and would be overwritten; pass --force to replace it, or "
                    "pick another path" + (" ('-' writes to stdout)" if dash_is_stdout else ""))


PATH_ARGS = frozenset({"config", "data", "out", "hf_model", "tokenizer", "deepspeed_config", "hostfile", "baseline",
                       "run_dirs",
                       "new", "json", "output", "report_json", "report_md", "src", "dst", "spec", "request"})
"""The `dest` of every argument, on any command, that names a file or folder (tests/test_cli.py lists them per
command). Each is checked before the command runs (`bad_path_arg`), and an OS error on it is bad input
(`path_error`). --data also takes 'stdlib' and --spec a preset's name: neither is a long name or holds a NUL."""
NAME_MAX_DEFAULT, PATH_MAX = 255, 4096
"""Linux's limits (bytes): a name (one path component) and a whole path with its terminating NUL. NAME_MAX is read
from the file system where it can be (os.pathconf), as some hold less."""
PATH_ERRNOS = {
    errno.ENAMETOOLONG: "file name too long ({what}): use a shorter path",
    errno.EACCES: "permission denied at {file}: give a path you may read (and write, for an output)",
    errno.EPERM: "operation not permitted at {file}: give a path you may read (and write, for an output)",
    errno.EISDIR: "{file} is a folder where a file is expected: give a file's path",
    errno.ENOTDIR: "{file} is a file where a folder is expected: give a path whose folders are folders",
    errno.ELOOP: "too many levels of symbolic links at {file}: give the path the links lead to",
    errno.EROFS: "{file} is on a read-only file system: give a place that can be written",
    errno.ENOENT: "no such file or folder: {file}",
    errno.EEXIST: "{file} exists already",
}
"""The OS errors that say a path the user gave cannot be used, with the words for each."""
DANGLING = ("{file} is a symbolic link that leads nowhere (a loop, or its target is gone): remove it or give another "
            "path")
BAD_PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ELOOP})
"""Of those, the ones that are bad input even where a command could not write an output it had computed (a folder
in the file's place, a file in a folder's, no permission): exit 2. A read-only file system stays exit 1 (the
machine's state, as a full disk: tests/test_run_folder.py), with the argument named all the same."""


def _name_max(text: str) -> int:
  """NAME_MAX of the file system of `text`'s nearest existing ancestor (the default where it cannot be read)."""
  p = os.path.abspath(text) if len(text) < PATH_MAX else "/"
  while True:
    try:
      return int(os.pathconf(p, "PC_NAME_MAX"))
    except (OSError, ValueError):
      parent = os.path.dirname(p)
      if parent == p:
        return NAME_MAX_DEFAULT
      p = parent


LIMITS = f"a name in it may have at most {NAME_MAX_DEFAULT} bytes, the whole path at most {PATH_MAX - 1}"


def path_problem(text: str) -> str | None:
  """Why `text` cannot name a file here, from the text alone (nothing is touched), or None.

  A NUL byte (no path holds one), a component longer than NAME_MAX bytes, or a path (as given, and made absolute)
  of PATH_MAX bytes or more: the OS would refuse each with an error that names no argument.
  """
  if "\0" in text:
    return "holds a NUL byte, which no path can: remove it"
  raw = os.fsencode(text)
  longest = max(raw.split(b"/"), key=len)
  if len(longest) > _name_max(text):
    return (f"has a name of {len(longest)} bytes ({os.fsdecode(longest[:24])}...), over the {_name_max(text)} a "
            "file or folder name may have here: use a shorter name")
  full = len(os.fsencode(os.path.abspath(text))) if len(raw) < PATH_MAX else len(raw)
  if full >= PATH_MAX:
    return f"is {full} bytes long{' as an absolute path' if full > len(raw) else ''}, over the {PATH_MAX - 1} a " \
           "path may have here: use a shorter path"
  return None


def shown_path(text: str) -> str:
  """A path for a message: whole when short, else its start and end with its length."""
  return text if len(text) <= 200 else f"{text[:40]}...{text[-20:]} ({len(text)} characters)"


def _flag(parser: argparse.ArgumentParser, command: str, dest: str) -> str:
  """How the user wrote the argument `dest` of `command`: its long option, or the positional's metavar."""
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction) and command in action.choices:
      for a in action.choices[command]._actions:
        if a.dest == dest:
          return max(a.option_strings, key=len) if a.option_strings else (a.metavar or dest.upper())
  return dest.upper()


def _path_values(args: argparse.Namespace) -> list[tuple[str, str]]:
  """(dest, value) of every path argument given (PATH_ARGS), lists flattened."""
  out = []
  for dest in sorted(PATH_ARGS):
    v = getattr(args, dest, None)
    for item in v if isinstance(v, (list, tuple)) else [v]:
      if isinstance(item, (str, os.PathLike)):
        out.append((dest, os.fspath(item)))
  return out


def bad_path_arg(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
  """The message for the first path argument that cannot be a path (`path_problem`), naming it; None if none."""
  for dest, value in _path_values(args):
    problem = path_problem(value)
    if problem:
      return f"{_flag(parser, args.command, dest)} {shown_path(value)}: {problem}"
  return None


def _related(a: str, b: str) -> bool:
  """`a` and `b` are the same path, one lies inside the other, or `a` is a hidden file beside `b` (the temporary
  file an output is written through: `.o.yaml.tmp`, `.tmpAB12`, `.hf.partial-42`); compared absolute, and resolved."""
  def forms(p: str) -> set[str]:
    out = {os.path.abspath(p)}
    try:
      out.add(os.path.realpath(p))
    except (OSError, ValueError):
      pass
    return out
  for x in forms(a):
    for y in forms(b):
      if x == y or x.startswith(y.rstrip(os.sep) + os.sep) or y.startswith(x.rstrip(os.sep) + os.sep) or \
          (os.path.dirname(x) == os.path.dirname(y) and os.path.basename(x).startswith(".")):
        return True
  return False


def path_error(parser: argparse.ArgumentParser, args: argparse.Namespace, exc: BaseException | None,
               errnos=PATH_ERRNOS) -> str | None:
  """The message for an OS error (errno in `errnos`) on a path the user gave, or inside or above it: the
  argument, the value, what is wrong and the fix. None when `exc` is no such error, or about no path the user gave
  (then it is not bad input, and the caller keeps its own mapping)."""
  if not isinstance(exc, OSError) or exc.errno not in errnos:
    return None
  words = PATH_ERRNOS.get(exc.errno)
  code = exc.errno
  if code == errno.EEXIST and exc.filename is not None and os.path.lexists(exc.filename) and \
      not os.path.isdir(exc.filename):  # mkdir of a parent that is a file: say that, not "exists already"
    code = errno.ENOTDIR
    words = PATH_ERRNOS[code]
  names = [os.fsdecode(f) for f in (exc.filename, exc.filename2) if isinstance(f, (str, bytes, os.PathLike))]
  if words is None or not names:
    return None
  for dest, value in _path_values(args):
    for name in names:
      if value and _related(name, value):
        culprit = _culprit(code, name, value)
        if code == errno.ENOTDIR and os.path.islink(culprit) and not os.path.exists(culprit):
          words = DANGLING
        text = words.format(file=shown_path(culprit), what=LIMITS)
        return f"{_flag(parser, args.command, dest)} {shown_path(value)}: {text}"
  return None


def _culprit(code: int, name: str, value: str) -> str:
  """The path to name in the message: for 'not a folder', the first existing part of `value` (or `name`) that is a
  file; for an error on a file written beside `value` (a temporary one), the folder both lie in; else `name`."""
  if code == errno.ENOTDIR:
    for p in (value, name):
      parts = os.path.abspath(p).split(os.sep)
      for i in range(2, len(parts) + 1):
        head = os.sep.join(parts[:i])
        if os.path.lexists(head) and not os.path.isdir(head):
          return head
  a, b = os.path.abspath(name), os.path.abspath(value)
  if a != b and os.path.dirname(a) == os.path.dirname(b):
    return os.path.dirname(a)
  return name
