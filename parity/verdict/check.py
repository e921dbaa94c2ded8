"""One check (pairwise, or of one side): what every check of parity.verdict returns and report.json stores."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["Check"]


@dataclasses.dataclass
class Check:
  """One check: pairwise, or of one side (placement).

  Attributes:
    name: '<metric> <a>~<b>' ('placement <side>' for a one-side check).
    metric: 'completed', 'loss', 'grad_norm', 'lr', 'val_loss', 'params', 'params_zero_grad', 'placement', ...
    sides: (reference side, candidate side); (side,) for a one-side check (parity.verdict.placement).
    value: the largest difference found (absolute for series; for 'params' the largest
      per-tensor ratio max|a - b| / max|final - init|); NaN when a NaN mismatch occurred.
    tolerance: the allowed value at the worst point (atol + rtol * |reference| for series).
    passed: value within tolerance everywhere, no NaN mismatch.
    first_failing_step: first step (0-based) that broke tolerance; None when passed or not per-step.
    worst: where the largest difference is (step number or tensor name).
    detail: one line for humans.
    reason: why the tolerance is what it is (from the tolerance table).
    gating: whether a failure fails the verdict (False: reported only, e.g. determinism, which
      GPU kernels do not promise).
  """
  name: str
  metric: str
  sides: tuple[str, ...]
  value: float
  tolerance: float
  passed: bool
  first_failing_step: int | None = None
  worst: Any = None
  detail: str = ""
  reason: str = ""
  gating: bool = True

  def to_json(self) -> dict:
    """The check as JSON-safe data: sides a list; a non-finite value/tolerance None (NaN) or its text (inf)."""
    d = dataclasses.asdict(self)
    d["sides"] = list(self.sides)
    for k in ("value", "tolerance"):
      if isinstance(d[k], float) and not math.isfinite(d[k]):
        d[k] = None if math.isnan(d[k]) else str(d[k])
    return d
