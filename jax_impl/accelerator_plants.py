"""Planted errors the JAX side makes only when it runs on an accelerator (parity.protocol.layout.
ACCELERATOR_PLANT_KEYS): the class of bug a migration must catch and a host-CPU rerun cannot see, such as a compiler
or runtime error of the accelerator alone. The side's rerun on the host CPU (JAX_PLATFORMS=cpu: the cross-backend
rule, parity.verdict.backend) runs clean, so only the rule's checks can catch what is planted here.

  accelerator_update_scale  every optimizer update multiplied by this factor (after the side's whole chain: weight
                            decay included; the optimizer state and the lr the metrics report are unchanged)
  accelerator_norm_eps      the final norm's eps replaced by this value (the model spec, the request and the
                            semantics card keep the run's eps)
  accelerator_matmul_default  the output projection's forward matmul at the 'default' matmul precision (one bf16
                            pass on a TPU) where the step sets 'highest'

Set once per worker process, before the step is traced (`set_accelerator_plants`), and read while tracing, as the
family plants are (jax_impl.layers.set_model_plants). On the CPU nothing is applied and the side's summary records
the plant as not applied (parity.report.build's `applied`).
"""
from __future__ import annotations

from typing import Any, Mapping

from parity.protocol.layout import ACCELERATOR_PLANT_KEYS

__all__ = ["set_accelerator_plants", "planted_value", "scaled_updates"]

_ACTIVE: dict[str, Any] = {}
"""This process's accelerator plants in force: {key: value}, empty on the CPU."""


def set_accelerator_plants(debug: Mapping[str, Any], platform: str) -> dict[str, Any]:
  """Makes the accelerator plants among `debug` (a side's SideIO.debug) this process's when `platform` (its first
  device's platform: 'tpu', 'gpu', 'cpu') is an accelerator. Returns the plants applied ({} on the CPU)."""
  _ACTIVE.clear()
  if platform != "cpu":
    _ACTIVE.update({k: debug[k] for k in ACCELERATOR_PLANT_KEYS if debug.get(k) is not None})
  return dict(_ACTIVE)


def planted_value(key: str) -> Any:
  """The value of accelerator plant `key` in force in this process, or None."""
  return _ACTIVE.get(key)


def scaled_updates(updates: Any) -> Any:
  """The optimizer's `updates` (a pytree, after the whole chain: weight decay and lr included) times the
  accelerator_update_scale in force; `updates` itself where none is. The optimizer state is untouched."""
  factor = planted_value("accelerator_update_scale")
  if factor is None:
    return updates
  import jax
  return jax.tree.map(lambda u: u * float(factor), updates)
