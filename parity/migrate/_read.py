"""Reading DeepSpeed configs the way DeepSpeed does: hjson (comments, trailing commas), no duplicate keys."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hjson
import yaml

from parity.errors import ParityInputError
from parity.inputs import InputError, parse_text, read_text

__all__ = ["PortError", "read_deepspeed_config", "read_structured"]


class PortError(ParityInputError):
  """A config cannot be read, resolved or ported (bad input: exit 2). The message names the key, the value and
  the fix."""

  def __init__(self, message: str, *, key: str | None = None):
    super().__init__(message)
    self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for k, v in pairs:
    if k in out:
      raise PortError(f"duplicate key {k!r} in one object; DeepSpeed rejects duplicates "
                      "(dict_raise_error_on_duplicate_keys). Keep one of them.", key=k)
    out[k] = v
  return out


def read_deepspeed_config(path: str | Path) -> dict[str, Any]:
  """Parses a DeepSpeed JSON config leniently, as `DeepSpeedConfig` does (hjson).

  Comments (#, //, /* */) and trailing commas are accepted. Like hjson, integral floats such as
  5e8 are read as integers.

  Raises:
    PortError: unreadable file, syntax error (with file, line and column), duplicate key, or a
      top level that is not an object.
  """
  p = Path(path)
  try:  # parity.inputs: UTF-8 text under a size cap, no deep nesting, finite numbers (the rules of every reader)
    data = parse_text(read_text(p, what="config"), str(p), "hjson", object_pairs_hook=_no_duplicates)
  except InputError as e:
    raise PortError(str(e)) from None
  except hjson.HjsonDecodeError as e:
    raise PortError(f"{p}:{e.lineno}:{e.colno}: not valid JSON/hjson: {e.msg}. Fix the syntax at that position."
                    ) from None
  except PortError as e:
    raise PortError(f"{p}: {e}", key=e.key) from None
  if not isinstance(data, dict):
    raise PortError(f"{p}: the top level must be an object {{...}}; got {type(data).__name__}.")
  return json.loads(json.dumps(data))  # plain dicts, hjson's OrderedDict gone


def read_structured(path: str | Path) -> dict[str, Any]:
  """Reads a YAML or JSON file (a ported config) into a dict. Raises PortError with line and column."""
  p = Path(path)
  try:
    data = parse_text(read_text(p, what="config"), str(p), "yaml")
  except InputError as e:
    raise PortError(str(e)) from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
    raise PortError(f"{p}{where}: not valid YAML/JSON: {getattr(e, 'problem', e)}. Fix the syntax there.") from None
  if not isinstance(data, dict):
    raise PortError(f"{p}: the top level must be a mapping; got {type(data).__name__}.")
  return data
