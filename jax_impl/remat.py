"""Rematerialisation and activation offload: JaxPlan.remat -> a jax.checkpoint policy per block.

Each block names its backward residuals with `jax.ad_checkpoint.checkpoint_name` (model.py);
the names sit on values the backward pass really reads (matmul and nonlinearity inputs), so a
policy over them decides what is saved, recomputed or offloaded:

  ==========================  ==============================================================
  none                        no jax.checkpoint: every residual is saved (device memory)
  full                        nothing_saveable: the block is recomputed in the backward pass
  save_dots                   dots_saveable: every matmul output is saved, the rest recomputed
  save_dots_no_batch          dots_with_no_batch_dims_saveable: only weight matmuls (x @ W)
  offload_dots_no_batch       offload_dot_with_no_batch_dims: those outputs go to host memory
  offload_names               save_and_offload_only_these_names(RESIDUAL_NAMES -> host memory)
  ==========================  ==============================================================

On the CPU backend the two offload policies are silent no-ops after lowering (docs/numerics.md):
the offload is visible only in the jaxpr of the differentiated step, as `device_put` ops to the
host memory kind (`device_puts_in_jaxpr`). GPU runs are the real test of the placement.

References:
  JAX docs, "Gradient checkpointing" (jax.checkpoint policies) and "Host offloading"
  (activation offloading with `save_and_offload_only_these_names`).
"""
from __future__ import annotations

import re
from typing import Callable

import jax

from parity.spec import REMAT_POLICIES

__all__ = ["RESIDUAL_NAMES", "OFFLOAD_POLICIES", "DEVICE_COUNTERPART", "policy", "device_puts_in_jaxpr"]

RESIDUAL_NAMES = ("attn_in", "qkv", "attn_out", "mlp_in", "mlp_hidden")
"""checkpoint_name tags in each block: ln_1 output (qkv matmul input), qkv projection output
(attention einsum input), attention output (proj matmul input), ln_2 output (fc/gate/up input),
MLP hidden (proj matmul input, after the nonlinearity)."""

OFFLOAD_POLICIES = ("offload_dots_no_batch", "offload_names")
"""Policies that put saved residuals in host memory."""
DEVICE_COUNTERPART = {"offload_dots_no_batch": "save_dots_no_batch", "offload_names": "save_names"}
"""Each offload policy's twin that saves the same residuals in device memory (jax_impl.offload_equality compares
the two). 'save_names' (save_only_these_names(RESIDUAL_NAMES)) is internal: `policy` knows it, jax.remat does not
take it (a plan saving every named residual on the device is 'none' to a user: it saves those and more)."""

DEVICE_KIND = "device"


def policy(name: str, host_kind: str = "pinned_host") -> Callable | None:
  """The jax.checkpoint policy of a JaxPlan.remat value; None means "no jax.checkpoint at all".

  Args:
    name: one of parity.spec.REMAT_POLICIES.
    host_kind: memory kind the offload policies move residuals to (JaxPlan.host_memory_kind).
  Raises:
    ValueError: unknown policy name.
  """
  cp = jax.checkpoint_policies
  table = {
      "none": lambda: None,
      "full": lambda: cp.nothing_saveable,
      "save_dots": lambda: cp.dots_saveable,
      "save_dots_no_batch": lambda: cp.dots_with_no_batch_dims_saveable,
      "offload_dots_no_batch": lambda: cp.offload_dot_with_no_batch_dims(DEVICE_KIND, host_kind),
      "offload_names": lambda: cp.save_and_offload_only_these_names(
          names_which_can_be_saved=(), names_which_can_be_offloaded=RESIDUAL_NAMES,
          offload_src=DEVICE_KIND, offload_dst=host_kind),
      "save_names": lambda: cp.save_only_these_names(*RESIDUAL_NAMES),  # DEVICE_COUNTERPART only
  }
  if name not in table:
    raise ValueError(f"jax.remat must be one of {', '.join(REMAT_POLICIES)}; got {name!r}")
  return table[name]()


def device_puts_in_jaxpr(jaxpr_text: str) -> dict[str, int]:
  """Counts the in-jit memory moves of a (differentiated) step's jaxpr.

  Returns:
    to_host: `device_put` equations with destination `MemorySpace.Host` (activation offload:
      one per offloaded residual per layer, or per scan body);
    to_device: `device_put` equations with destination `MemorySpace.Device` (the offload
      policies' reloads, and the per-layer param moves in the scan body).
  On the CPU backend these moves exist only here: lowering drops them (docs/numerics.md).
  """
  ops = re.findall(r"device_put\[[^\]]*\]", jaxpr_text)
  return {"to_host": sum("devices=(MemorySpace.Host,)" in op for op in ops),
          "to_device": sum("devices=(MemorySpace.Device,)" in op for op in ops)}
