"""The rules every spec field follows, for any frozen spec dataclass (parity.spec): integers within INT_MAX and
finite floats (`check_numbers`), and the JSON round trip (`to_dict` / `from_dict`) that carries specs to workers.
parity.spec re-exports these names."""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Mapping, TypeVar

from parity.errors import SpecError
from parity.inputs import ascii_number, check_tree

__all__ = ["INT_MAX", "check_numbers", "check_section_numbers", "to_dict", "from_dict", "why_not_finite"]

INT_MAX = 2**31 - 1
"""Largest value of any integer field (steps, sizes, seeds, counters). JAX without x64 keeps step counters and
shapes as int32, and torch.manual_seed refuses seeds past 64 bits; 2^31 - 1 covers every real run, and a
10^23 typo is refused here, by name, instead of overflowing inside a worker."""


def check_numbers(run: Any) -> Any:
  """The numeric rule of `check_section_numbers` over a RunSpec and each of its sections (every field holding a spec
  dataclass, in field order: model, train, then the sides' plans); no cross-field checks. Returns `run`. Raises
  SpecError naming `section.field` and the value."""
  check_section_numbers(run, "")
  for f in dataclasses.fields(run):
    section = getattr(run, f.name)
    if dataclasses.is_dataclass(section):
      check_section_numbers(section, f.name)
  return run


def check_section_numbers(obj: Any, section: str) -> None:
  """The rule for every numeric field of a spec section: integers in [-INT_MAX, INT_MAX], floats finite.

  Also walks mapping fields (train.lr_schedule_params). Field-specific ranges stay in each `validate`.
  Raises:
    SpecError: naming `section.field` and the value.
  """
  for f in dataclasses.fields(obj):
    v = getattr(obj, f.name)
    key = f"{section}.{f.name}" if section else f.name
    if isinstance(v, bool) or v is None:
      continue
    if isinstance(v, int) and not -INT_MAX <= v <= INT_MAX:
      raise SpecError(f"{key} = {v} is out of range: integer fields must be at most {INT_MAX:,} (2^31 - 1)")
    if isinstance(v, float) and not math.isfinite(v):
      raise SpecError(f"{key} = {v}: must be a finite number{why_not_finite(v)}")
    if isinstance(v, dict):
      check_tree(v, key)


def why_not_finite(x: float) -> str:
  """The hint for a non-finite value: NaN given as such, or an infinity (which a too-large literal becomes)."""
  return "; NaN is not a value a run can use" if math.isnan(x) else " (a value such as 1e400 overflows to inf)"


T = TypeVar("T")


def to_dict(spec: Any) -> dict[str, Any]:
  """Dataclass -> JSON-ready dict (tuples become lists)."""
  out = {}
  for f in dataclasses.fields(spec):
    v = getattr(spec, f.name)
    if dataclasses.is_dataclass(v):
      v = to_dict(v)
    elif isinstance(v, tuple):
      v = list(v)
    elif isinstance(v, enum.Enum):
      v = v.value
    out[f.name] = v
  return out


def from_dict(cls: type[T], data: Mapping[str, Any], *, path: str = "") -> T:
  """JSON dict -> dataclass. Raises SpecError naming the unknown or mistyped key."""
  if not isinstance(data, Mapping):
    raise SpecError(f"{path or cls.__name__}: expected an object, got {type(data).__name__}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise SpecError(f"unknown key(s) {', '.join((path + '.' if path else '') + k for k in unknown)}; "
                    f"expected one of: {', '.join(fields)}")
  kwargs = {}
  defaults = cls()
  for name, value in data.items():
    cur = getattr(defaults, name)
    key = f"{path}.{name}" if path else name
    if dataclasses.is_dataclass(cur):
      kwargs[name] = from_dict(type(cur), value, path=key)
    elif isinstance(cur, tuple):
      if not isinstance(value, (list, tuple)):  # tuple("full") would be its characters, tuple({...}) its keys
        raise SpecError(f"{key} must be a list; got {str(value)[:60] if isinstance(value, str) else value!r}")
      kwargs[name] = tuple(value)
    elif cur is None and _optional_bool(fields[name]) and isinstance(value, str) and value.lower() in (
        "true", "false"):  # as a bool field takes them (_coerce): 'model.qkv_bias=true' like 'model.bias=true'
      kwargs[name] = value.lower() == "true"
    elif value is None and cur is not None and not _allows_none(fields[name]):
      raise SpecError(f"{key}: expected {_kind(cur)}, got null; give a value, or leave the key out")
    else:
      kwargs[name] = _coerce(key, cur, value)
  return cls(**kwargs)


def _allows_none(f: dataclasses.Field) -> bool:
  """Whether the field's annotation admits None ('int | None', 'Optional[...]'; a string under `from __future__
  import annotations`)."""
  t = f.type if isinstance(f.type, str) else repr(f.type)
  return "None" in t or "Optional" in t or t in ("Any", "typing.Any")


def _optional_bool(f: dataclasses.Field) -> bool:
  """Whether the field is annotated 'bool | None' (or 'Optional[bool]')."""
  t = (f.type if isinstance(f.type, str) else repr(f.type)).replace(" ", "")
  return t in ("bool|None", "None|bool", "Optional[bool]", "typing.Optional[bool]")


def _kind(default: Any) -> str:
  """What a field of this default's type takes, in words (for the null refusal)."""
  if isinstance(default, bool):
    return "true/false"
  if isinstance(default, int):
    return "an integer"
  if isinstance(default, float):
    return "a finite number"
  return f"a {type(default).__name__}"


def _ascii_hint(value: Any) -> str:
  """'; write it in ASCII digits (0-9)' for text holding other characters (a full-width '１６', a superscript)."""
  return "; write it in ASCII digits (0-9)" if isinstance(value, str) and not value.isascii() else ""


def _coerce(key: str, default: Any, value: Any) -> Any:
  if value is None or default is None:
    return value
  if isinstance(default, bool):
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
      return value.lower() == "true"
    raise SpecError(f"{key}: expected true/false, got {value!r}")
  if isinstance(default, int):
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
      try:  # ASCII digits only: int() also reads '１６'
        return ascii_number(str(value))
      except ValueError:
        pass
      try:  # '1e6' (YAML reads exponent notation without a dot as a string)
        x = ascii_number(str(value), float)
      except ValueError:
        x = math.nan
      if not (math.isfinite(x) and x.is_integer()):
        raise SpecError(f"{key}: expected an integer, got {str(value)[:40]!r}{_ascii_hint(value)}") from None
      value = x
    return int(value)
  if isinstance(default, float):
    if isinstance(value, bool):  # float(True) is 1.0: a number the user never wrote
      raise SpecError(f"{key}: expected a finite number, got {str(value).lower()}")
    try:
      out = ascii_number(value, float) if isinstance(value, str) else float(value)
    except (TypeError, ValueError, OverflowError):
      raise SpecError(f"{key}: expected a finite number, got {str(value)[:40]!r}{_ascii_hint(value)}") from None
    if not math.isfinite(out):
      raise SpecError(f"{key} = {str(value)[:40]}: must be a finite number{why_not_finite(out)}")
    return out
  return value
