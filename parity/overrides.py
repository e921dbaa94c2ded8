"""Dotted keys and overrides over a RunSpec: the CLI's `--set section.key=value` strings parsed (`parse_value`,
`parse_overrides`), nested mappings read by dotted key (`get_dotted`, `has_dotted`), and dotted overrides applied to
a spec (`apply_overrides`). Plain data, like parity.spec: no jax, no torch."""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from parity.errors import SpecError
from parity.fields import from_dict, to_dict
from parity.inputs import parse_text
from parity.spec import RunSpec

__all__ = ["parse_value", "parse_overrides", "get_dotted", "has_dotted", "apply_overrides"]


def parse_value(raw: str, source: str) -> Any:
  """A `key=value` value: JSON where it parses (numbers, true/false, null, lists, objects), else the string.

  Parsed through parity.inputs.parse_text, so deep nesting and inf/nan are refused like in a config file.
  Raises:
    SpecError (InputError): nesting too deep, a number that overflows; naming `source`.
  """
  try:
    return parse_text(raw, source, "json")
  except json.JSONDecodeError:
    return raw
  except ValueError as exc:  # json's own 'Out of range float values' and the like
    if isinstance(exc, SpecError):
      raise
    return raw


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
  """`section.key=value` strings (the CLI's --set) -> {dotted key: parsed value}, in order (a later key wins).

  Values are parsed by `parse_value` (JSON where it parses, else the string).
  Raises:
    SpecError: an item without '=', with an empty key or an empty value, or a value parse_value refuses.
  """
  out: dict[str, Any] = {}
  for item in items:
    if not isinstance(item, str) or "=" not in item or not item.split("=", 1)[0].strip():
      raise SpecError(f"override {item!r} must look like section.key=value (e.g. train.lr=3e-4)")
    key, raw = item.split("=", 1)
    if not raw.strip():
      raise SpecError(f"override {item!r} has no value after '='; give one (e.g. {key.strip()}=VALUE), or leave "
                      "the --set out to keep the default")
    out[key.strip()] = parse_value(raw, f"override {key.strip()!r}")
  return out


def _walk_dotted(tree: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
  """(whether every part of `dotted` is present, the value there or None)."""
  node: Any = tree
  for part in dotted.split("."):
    if not isinstance(node, Mapping) or part not in node:
      return False, None
    node = node[part]
  return True, node


def get_dotted(tree: Mapping[str, Any], dotted: str) -> Any:
  """The value at a dotted key ('train.lr') of nested mappings (a to_dict() tree, a DeepSpeed JSON); None where any
  part of the path is absent or not a mapping."""
  return _walk_dotted(tree, dotted)[1]


def has_dotted(tree: Mapping[str, Any], dotted: str) -> bool:
  """Whether nested mappings hold the dotted key `dotted` (a key present with the value None counts)."""
  return _walk_dotted(tree, dotted)[0]


def apply_overrides(spec: RunSpec, overrides: Mapping[str, Any]) -> RunSpec:
  """Applies dotted overrides, e.g. {'train.lr': 3e-4, 'model.norm_eps': 1e-6}, over `spec`.

  Only the CLI parses `key=value` strings (`parse_overrides`); here values are already Python values.
  Raises:
    SpecError: naming the key when it does not exist or the value has the wrong type.
  """
  if not isinstance(overrides, Mapping):
    raise SpecError(f"overrides must be a mapping of dotted keys to values (parity.overrides.parse_overrides turns "
                    f"key=value strings into one); got {type(overrides).__name__}")
  data = to_dict(spec)
  for key, value in overrides.items():
    node = data
    parts = str(key).strip().split(".")
    for p in parts[:-1]:
      if not isinstance(node.get(p), dict):
        raise SpecError(f"override {key!r}: {p!r} is not a section; sections: "
                        f"{', '.join(k for k, v in data.items() if isinstance(v, dict))}")
      node = node[p]
    if parts[-1] not in node:
      raise SpecError(f"override {key!r}: unknown key {parts[-1]!r}; expected one of: {', '.join(node)}")
    node[parts[-1]] = value
  return from_dict(RunSpec, data)
