"""`parity diagnose`'s driver-side inputs: the planted bugs (`--plant`) and the lr position of the diagnosed update.
The request and output files a worker reads and writes (tap names and order, plants as a worker applies them, the
plan check) are the worker end's, `parity.protocol.diagnose`. Numpy only."""
from __future__ import annotations

from typing import Any, Sequence

from parity import weights
from parity.numerics import schedule
from parity.protocol.diagnose import PLANT_OFFSET
from parity.spec import ModelSpec, SpecError, TrainSpec

__all__ = ["PLANT_KINDS", "parse_plants", "lr_position"]

PLANT_KINDS = ("no_causal_mask", "transpose=<canonical square weight>", "offset=<canonical tensor>", "decay_all")
OFFSET = PLANT_OFFSET
"""What an `offset=NAME` plant adds to every element of the tensor when that side loads it (a mis-loaded tensor: a
zero bias or a norm weight of 1 is moved as much as a matrix)."""


def parse_plants(items: Sequence[str], sides: Sequence[str], spec: ModelSpec) -> dict[str, dict[str, Any]]:
  """Parses `--plant SIDE:KIND` items (planted bugs for testing diagnose itself).

  Kinds: `no_causal_mask`; `transpose=NAME` (a square canonical weight, transposed when loaded); `offset=NAME` (any
  canonical tensor, OFFSET added to each element when loaded); `decay_all` (AdamW decay on every tensor).
  Returns:
    side -> {'no_causal_mask': bool, 'decay_all': bool, 'transpose': [names], 'offset': [names]} for sides with
    plants.
  Raises:
    SpecError: malformed item, a side not run, an unknown kind, or a name that is not a square weight.
  """
  out: dict[str, dict[str, Any]] = {}
  shapes = weights.param_shapes(spec)
  for item in items:
    side, sep, kind = item.partition(":")
    if not sep or not kind:
      raise SpecError(f"--plant {item!r} must look like SIDE:KIND, e.g. jax:no_causal_mask; kinds: "
                      f"{', '.join(PLANT_KINDS)}")
    if side not in sides:
      raise SpecError(f"--plant {item!r}: side {side!r} is not among the sides run ({', '.join(sides)})")
    p = out.setdefault(side, {"no_causal_mask": False, "decay_all": False, "transpose": [], "offset": []})
    key, eq, value = kind.partition("=")
    if key in ("no_causal_mask", "decay_all") and not eq:
      p[key] = True
    elif key in ("transpose", "offset") and eq:
      if value not in shapes:
        raise SpecError(f"--plant {item!r}: {value!r} is not a canonical parameter of this model; e.g. "
                        f"h.0.attn.proj.weight")
      shape = shapes[value]
      if key == "offset":
        p["offset"].append(value)
        continue
      if len(shape) != 2 or shape[0] != shape[1]:
        raise SpecError(f"--plant {item!r}: {value} has shape {shape}; only a square weight can be transposed "
                        "in place (e.g. h.0.attn.proj.weight)")
      p["transpose"].append(value)
    else:
      raise SpecError(f"--plant {item!r}: unknown plant {kind!r}; use one of {', '.join(PLANT_KINDS)}")
  return out


def lr_position(train: TrainSpec, step: int) -> tuple[int, float]:
  """(schedule position, lr) of the diagnosed update: `step`, or the first later step with lr > 0.

  Raises:
    SpecError: step is outside [0, train.steps), or the lr is 0 from `step` to the end of the run.
  """
  if not 0 <= step < train.steps:
    raise SpecError(f"--step {step}: the run has train.steps={train.steps} (steps 0..{train.steps - 1})")
  for k in range(step, train.steps):
    lr = schedule.train_lr(train, k)
    if lr > 0:
      return k, float(lr)
  raise SpecError(f"--step {step}: the learning rate is 0 at every step from {step} to {train.steps - 1}; "
                  "an update would be the identity. Pick an earlier step or a schedule with lr > 0")
