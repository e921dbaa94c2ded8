"""What every `parity` subcommand shares: exit codes, the console, the defaults in help texts, `Failure`."""
from __future__ import annotations

import argparse
import math

__all__ = ["EXIT_OK", "EXIT_FAIL", "EXIT_BAD_INPUT", "Failure", "console", "add_allow_large", "split_list",
           "show_defaults", "add_run_source"]

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


class Failure(Exception):
  """A command that ran but could not finish (an output not written, a verify that timed out): main prints
  `parity X: error: <message>` on stderr and exits with `code` (never 0 or 2: those mean done and bad input)."""

  def __init__(self, message: str, code: int = EXIT_FAIL):
    super().__init__(message)
    self.code = code


def console(stderr: bool = False):
  """A rich Console; 160 columns when not a terminal (logs and CI: tables are not squeezed into 80)."""
  from rich.console import Console
  con = Console(highlight=False, stderr=stderr)
  if not con.is_terminal:
    con = Console(highlight=False, width=160, stderr=stderr)
  return con


def add_run_source(p: argparse.ArgumentParser, *, set_example: str, preset: bool = True) -> None:
  """--preset (when `preset`), --config and --set: the run sources every run-building command hands to
  parity.pipeline.resolve.resolve_run (overrides as key=value strings, parsed by parity.spec.parse_overrides)."""
  from parity.presets import DEFAULT_PRESET
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


def count_arg(text: str) -> int:
  """argparse type for counts: an integer, also written as an integral float ('2e9'); refuses inf/nan/fractions."""
  try:
    return int(text)
  except ValueError:
    pass
  try:
    x = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
  if not math.isfinite(x) or not x.is_integer():
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
  return int(x)
