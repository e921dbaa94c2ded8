"""Shared state of one port: the resolved config, the report, the flags, and typed accessors."""
from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any, Iterable, Literal

from parity.migrate._report import Report, leaf_paths

__all__ = ["Flags", "Ctx", "MISSING", "UNRESOLVED"]


class _Sentinel:
  def __init__(self, name: str):
    self.name = name

  def __repr__(self) -> str:
    return self.name


MISSING = _Sentinel("MISSING")
"""The key is absent from the config."""
UNRESOLVED = _Sentinel("UNRESOLVED")
"""The key was "auto" and nothing resolves it (already reported as an error)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Flags:
  """Values the user passes, as the HF Trainer would fill them into "auto" keys."""
  micro_batch: int | None = None
  """--micro-batch: sequences per device per micro step (per_device_train_batch_size)."""
  grad_accum: int | None = None
  """--grad-accum: gradient accumulation steps."""
  world_size: int | None = None
  """--world-size: data-parallel ranks."""
  lr: float | None = None
  betas: tuple[float, float] | None = None
  eps: float | None = None
  weight_decay: float | None = None
  warmup_steps: int | None = None
  total_steps: int | None = None
  max_grad_norm: float | None = None
  precision: Literal["fp32", "fp16", "bf16"] | None = None
  """--fp16 / --bf16 / --fp32."""
  hidden_size: int | None = None
  """--hidden-size: model width, for the bucket-size "auto"s."""
  stack: str | None = None
  """--stack: the training stack that runs the config (parity.migrate._stack.STACKS); None: chosen from the config
  (hf-trainer when it has "auto" values, else deepspeed)."""


def _fmt(v: Any) -> str:
  return json.dumps(v) if not isinstance(v, _Sentinel) else repr(v)


class Ctx:
  """One port in progress. `cfg` is the input with every resolvable "auto" replaced."""

  def __init__(self, raw: dict[str, Any], cfg: dict[str, Any], flags: Flags, report: Report):
    self.raw = raw
    self.cfg = cfg
    self.flags = flags
    self.report = report
    self.leaves = dict(leaf_paths(raw))

  # -- access
  def get(self, path: str, node: Any = None) -> Any:
    node = self.cfg if node is None else node
    for part in path.split("."):
      if not isinstance(node, dict) or part not in node:
        return MISSING
      node = node[part]
    return node

  def has(self, path: str) -> bool:
    return self.get(path) is not MISSING

  def leaves_under(self, path: str) -> list[str]:
    return [k for k in self.leaves if k == path or k.startswith(path + ".")]

  # -- fates
  def mark(self, path: str, fate: str, target: str | None, reason: str, *, overwrite: bool = True) -> None:
    """Gives `path` (a leaf, or every leaf below it) a fate."""
    for leaf in self.leaves_under(path):
      self.report.set(leaf, fate, target, reason, value=self.leaves[leaf], overwrite=overwrite)

  def refuse(self, path: str | None, message: str, *, fate_reason: str | None = None, deepspeed: bool = False) -> None:
    """Records a refusal; marks the key unsupported with `fate_reason` (default: the message). `deepspeed`: DeepSpeed
    itself refuses this (config parse or deepspeed.initialize), not only the port (Report.deepspeed_refusals)."""
    self.report.refuse(message)
    if deepspeed and message not in self.report.deepspeed_refusals:
      self.report.deepspeed_refusals.append(message)
    if path is not None:
      self.mark(path, "unsupported", None, fate_reason or message)

  def warn(self, message: str) -> None:
    if message not in self.report.warnings:
      self.report.warnings.append(message)

  def implied(self, key: str, value: Any, reason: str) -> None:
    self.report.implied.append({"key": key, "value": value, "reason": reason})

  # -- typed reads; a bad value is refused with key, value and expectation, and None returned
  def num(self, path: str, default: Any = MISSING, *, integer: bool = False, ge: float | None = None,
          gt: float | None = None, lt: float | None = None, le: float | None = None) -> Any:
    """The number at `path` (default when missing), refused on ctx when it is not a number, not an integer with
    `integer`, or outside the ge/gt/lt/le bounds (DeepSpeed's own). Returns None when unresolved or refused."""
    v = self.get(path)
    if v is UNRESOLVED:
      return None
    if v is MISSING:
      return None if default is MISSING else default
    kind = "an integer" if integer else "a number"
    ok = not isinstance(v, bool) and (isinstance(v, int) or (not integer and isinstance(v, float)))
    if integer and isinstance(v, float):
      # pydantic int fields accept an integral float (5e8 is already an int after hjson) and reject a fraction.
      ok = v.is_integer()
      v = int(v) if ok else v
      kind = "an integer (no fractional part)"
    bounds = [(ge, ">=", lambda a, b: a >= b), (gt, ">", lambda a, b: a > b), (lt, "<", lambda a, b: a < b),
              (le, "<=", lambda a, b: a <= b)]
    want = " and ".join(f"{op} {b}" for b, op, _ in bounds if b is not None)
    if ok:
      ok = all(b is None or f(v, b) for b, _, f in bounds)
    if not ok:
      self.refuse(path, f"{path}: got {_fmt(self.get(path))}; expected {kind}{' ' + want if want else ''}.")
      return None
    return v

  def boolean(self, path: str, default: Any = MISSING) -> Any:
    v = self.get(path)
    if v is UNRESOLVED:
      return None
    if v is MISSING:
      return None if default is MISSING else default
    if not isinstance(v, bool):
      self.refuse(path, f"{path}: got {_fmt(v)}; expected true or false.")
      return None
    return v

  def choice(self, path: str, options: Iterable[str], default: Any = MISSING) -> Any:
    """The value at `path` when it is one of `options` (default when missing); otherwise refused on ctx, naming the
    options, and None is returned (also when unresolved)."""
    v = self.get(path)
    options = list(options)
    if v is UNRESOLVED:
      return None
    if v is MISSING:
      return None if default is MISSING else default
    if v not in options:
      self.refuse(path, f"{path}: got {_fmt(v)}; expected one of {', '.join(map(repr, options))}.")
      return None
    return v

  def unknown_keys(self, section: str, known: Iterable[str], *, why: str) -> None:
    """Refuses keys of `section` that DeepSpeed's pydantic model (extra='forbid') rejects."""
    node = self.get(section)
    if not isinstance(node, dict):
      return
    known = list(known)
    for k in node:
      if k not in known:
        close = difflib.get_close_matches(k, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else f" Known keys: {', '.join(known)}."
        self.refuse(f"{section}.{k}", f"{section}.{k}: unknown key; DeepSpeed 0.19.8 rejects it ({why}).{hint}",
                    deepspeed=True)
