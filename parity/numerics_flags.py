"""The flags that change what host offload does or how the numbers round, read from the environment without importing
jax or torch: the `numerics_flags` block of environment.json (harness.doctor) and what the regression gate compares
(parity.history.bands.flag_notes).

  XLA_FLAGS --xla_gpu_enable_pipelined_host_offloading   XLA GPU moves host-offload copies into nearby loop
      iterations (collective pipeliner, openxla/xla PR #32297). Opt-in only since PR #37979: auto-enabled at O1 it
      created extra all-gather channels and a loss convergence failure (12.8+ vs 5.7, gemma3-27b on 2x8 B200); the
      revert, PR #45393, was closed.
  XLA_FLAGS --xla_gpu_enable_latency_hiding_scheduler    XLA GPU's latency-hiding scheduler: where async copies and
      collectives sit among the compute.
  JAX_REMAT3          jax_remat3 (jax 0.10.2: default False): the offload remat policies re-implemented (jax-ml/jax
      PRs #38937, #38939), so one policy name can place different residuals.
  JAX_DEFAULT_MATMUL_PRECISION   jax_default_matmul_precision at import; parity's JAX step sets 'highest' itself
      (jax_impl/step.py), and each side's semantics card records the precision its step ran with.
  TORCH_ALLOW_TF32_CUBLAS_OVERRIDE   torch starts its float32 matmul precision at 'high' (TF32) when set
      (ATen/Context.h, torch 2.13); torch_impl's semantics card records the precision in force.
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB  XLA's pinned-host pool per GPU (parity.sizing.host_limits): the value the JAX
      worker gets, the user's or parity's.

A value is the text as set; None: unset (the framework's default). A bare boolean XLA flag (`--name`) reads 'true'.
"""
from __future__ import annotations

import shlex
from typing import Mapping

__all__ = ["XLA_POOL_ENV", "XLA_FLAG_NAMES", "ENV_NAMES", "SIDE_KEYS", "parse_xla_flags", "numerics_flags",
           "flag_values"]

XLA_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
"""XLA's pinned-host pool size per GPU, whole GiB (the unit is 1 << 30 bytes despite the name's 'GB'); defined here,
at the bottom, and used by parity.sizing.host_limits (the contract's top-level modules never import parity.sizing)."""
XLA_FLAG_NAMES = ("xla_gpu_enable_pipelined_host_offloading", "xla_gpu_enable_latency_hiding_scheduler")
"""XLA_FLAGS entries recorded (and compared) by name."""
ENV_NAMES = ("JAX_REMAT3", "JAX_DEFAULT_MATMUL_PRECISION", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", XLA_POOL_ENV)
"""Environment variables recorded (and compared)."""
SIDE_KEYS = ("matmul.precision",)
"""Items of each side's semantics card (<run>/<side>/semantics.json) the gate compares with these flags."""


def parse_xla_flags(text: str | None) -> dict[str, str]:
  """XLA_FLAGS as {name: value} ('--a=1 --b' -> {'a': '1', 'b': 'true'}); later entries win, as XLA reads them.
  Text that is no '--name[=value]' token is skipped."""
  out: dict[str, str] = {}
  try:
    tokens = shlex.split(text or "")
  except ValueError:
    tokens = (text or "").split()
  for tok in tokens:
    if not tok.startswith("--") or len(tok) == 2:
      continue
    name, eq, value = tok[2:].partition("=")
    out[name] = value if eq else "true"
  return out


def numerics_flags(environ: Mapping[str, str], pool: Mapping[str, object] | None = None) -> dict[str, object]:
  """The `numerics_flags` block: {'values': {key: text | None}, 'set_by': {XLA_POOL_ENV: ...}, 'other_xla_flags':
  [names of other XLA_FLAGS entries: recorded, not compared], 'side_records': where the sides' own records are}.

  Args:
    environ: the environment the workers inherit.
    pool: the JAX worker's pool choice (harness.env.jax_pool_choice) when known: its 'value' and 'set_by' replace
      the variable's (parity may set it for the JAX worker only).
  Keys: 'XLA_FLAGS --<name>' for XLA_FLAG_NAMES, and each of ENV_NAMES.
  """
  xla = parse_xla_flags(environ.get("XLA_FLAGS"))
  values: dict[str, object] = {f"XLA_FLAGS --{n}": xla.get(n) for n in XLA_FLAG_NAMES}
  values.update({k: environ.get(k) for k in ENV_NAMES})
  set_by = "user" if environ.get(XLA_POOL_ENV) is not None else "default"
  if pool is not None:
    values[XLA_POOL_ENV] = pool.get("value")
    set_by = str(pool.get("set_by") or set_by)
  return {"values": values, "set_by": {XLA_POOL_ENV: set_by},
          "other_xla_flags": sorted(n for n in xla if n not in XLA_FLAG_NAMES),
          "side_records": "each side's semantics.json item " + ", ".join(SIDE_KEYS)}


def flag_values(block: object) -> dict[str, str | None] | None:
  """The compared values of an environment.json `numerics_flags` block ({key: text | None}); None when the block is
  absent or not one (a run written before it was kept)."""
  if not isinstance(block, Mapping) or not isinstance(block.get("values"), Mapping):
    return None
  return {str(k): None if v is None else str(v) for k, v in block["values"].items()}
