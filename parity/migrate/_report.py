"""The migration report: one entry per leaf key path of the input config, each with a fate."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator, Literal

__all__ = ["Entry", "Report", "leaf_paths", "FATES"]

Fate = Literal["mapped", "not_needed", "unsupported"]
FATES = ("mapped", "not_needed", "unsupported")


def leaf_paths(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """Yields (dotted path, value) for every leaf of a JSON tree. Lists and empty objects are leaves."""
  if isinstance(node, dict) and node:
    for k, v in node.items():
      yield from leaf_paths(v, f"{prefix}.{k}" if prefix else str(k))
  else:
    yield prefix, node


def _cell(text: str) -> str:
  """Text for a Markdown table cell: `|` escaped as `\\|` (GFM; also inside code spans), so ||g|| stays ||g||."""
  return str(text).replace("|", "\\|").replace("\n", " ")


@dataclasses.dataclass(slots=True)
class Entry:
  key: str
  """Dotted path of the leaf in the input config."""
  value: Any
  """The value as written in the input (e.g. "auto")."""
  fate: Fate
  target: str | None
  """Where it lands in the ported config (dotted path), or None."""
  reason: str
  resolved: Any = None
  """The value after resolving "auto" or a legacy form; None when it equals `value`."""

  def to_dict(self) -> dict[str, Any]:
    d = {"key": self.key, "value": self.value, "fate": self.fate, "target": self.target, "reason": self.reason}
    if self.resolved is not None:
      d["resolved"] = self.resolved
    return d


@dataclasses.dataclass
class Report:
  """Fates of every input key, plus implied defaults, DeepSpeed's warnings and the refusal, if any."""

  source: str
  entries: dict[str, Entry] = dataclasses.field(default_factory=dict)
  implied: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  """Settings the input does not spell out but DeepSpeed applies: {'key', 'value', 'reason'}."""
  warnings: list[str] = dataclasses.field(default_factory=list)
  errors: list[str] = dataclasses.field(default_factory=list)
  """Refusal reasons; the first is the one printed."""
  deepspeed_refusals: list[str] = dataclasses.field(default_factory=list)
  """The refusals DeepSpeed itself would make (at config parse or deepspeed.initialize), a subset of `errors`;
  the rest are what the JAX port cannot express. Empty exactly when the installed DeepSpeed accepts the config
  (tests/test_port_acceptance.py asks it)."""
  direction: str = "deepspeed->jax"
  stack: dict[str, Any] | None = None
  """deepspeed->jax: the training stack's model (parity.migrate._stack.StackModel.to_dict: stack, chosen_by,
  optimizer_class, built_by, groups, decay_mask, hyperparameters, loss_scaler, versions, sources, summary, ...)."""
  loss_normalization: dict[str, Any] | None = None
  """deepspeed->jax: the loss normalisation the job implies as far as the config tells
  (parity.migrate._loss_norm.loss_normalization: value, decided_by, same_loss, signals, why); None the other way."""

  @property
  def ported(self) -> bool:
    return not self.errors and all(e.fate != "unsupported" for e in self.entries.values())

  def set(self, key: str, fate: Fate, target: str | None, reason: str, *, value: Any = None,
          resolved: Any = None, overwrite: bool = True) -> None:
    if key in self.entries and not overwrite:
      return
    old = self.entries.get(key)
    if old is not None and old.fate == "unsupported" and fate != "unsupported":
      return  # the rule: a refused key stays refused; a later step that maps it never shows it as mapped
    val = old.value if old is not None else value
    self.entries[key] = Entry(key, val, fate, target, reason, resolved)

  def refuse(self, message: str) -> None:
    if message not in self.errors:
      self.errors.append(message)

  def to_dict(self) -> dict[str, Any]:
    """The report as JSON data (schema parity.migration/1): source, direction, status, errors, warnings, every
    key's entry (value, fate, target, reason) and, for a DeepSpeed config, `stack` and `loss_normalization`."""
    return {
        "schema": "parity.migration/1",
        "source": self.source,
        "direction": self.direction,
        "status": "ported" if self.ported else "refused",
        "error": self.errors[0] if self.errors else None,
        "errors": list(self.errors),
        "deepspeed_accepts": not self.deepspeed_refusals,
        "deepspeed_refusals": list(self.deepspeed_refusals),
        "warnings": list(self.warnings),
        "implied": list(self.implied),
        "entries": [e.to_dict() for e in self.entries.values()],
        **({"stack": self.stack} if self.stack is not None else {}),
        **({"loss_normalization": self.loss_normalization} if self.loss_normalization is not None else {}),
    }

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, default=str) + "\n"

  def to_markdown(self) -> str:
    """The report as Markdown: status, refusals, the key table (key, value, fate, target, reason), implied
    defaults, warnings and the loss normalisation."""
    d = self.to_dict()
    out = [f"# Migration report: `{self.source}`", "", f"Status: **{d['status']}**", ""]
    if self.errors:
      out += ["## Refused", ""] + [f"- {e}" for e in self.errors] + [""]
    st = self.stack
    if st is not None:
      out += ["## Training stack", "", f"`{st['stack']}` ({st['chosen_by']}; {st['versions']}): "
              f"{_cell(st['summary'])}. Decay mask `{st['decay_mask']}`. Loss scaler: {st['loss_scaler']}.", ""]
      out += [f"- {n}" for n in st["notes"]] + ([f"- the stack refuses it: {st['refusal']}"] if st["refusal"] else [])
      out += [f"- source: {src}" for src in st["sources"]] + [""]
    out += ["## Keys", "", "| key | value | fate | target | reason |", "|---|---|---|---|---|"]
    for e in self.entries.values():
      val = json.dumps(e.value) + (f" → {json.dumps(e.resolved)}" if e.resolved is not None else "")
      out.append(f"| `{_cell(e.key)}` | `{_cell(val)}` | {e.fate} | {('`' + _cell(e.target) + '`') if e.target else ''}"
                 f" | {_cell(e.reason)} |")
    if self.implied:
      out += ["", "## Implied by DeepSpeed defaults", "", "| key | value | reason |", "|---|---|---|"]
      out += [f"| `{_cell(i['key'])}` | `{_cell(json.dumps(i['value']))}` | {_cell(i['reason'])} |"
              for i in self.implied]
    if self.warnings:
      out += ["", "## Warnings", ""] + [f"- {w}" for w in self.warnings]
    ln = self.loss_normalization
    if ln is not None:
      out += ["", "## Loss normalisation", "", f"Recorded: `train.loss_normalization: {ln['value']}` (decided by "
              f"{ln['decided_by']}). {ln['why']}.", ""] + [f"- {s}" for s in ln["signals"]]
    return "\n".join(out) + "\n"
