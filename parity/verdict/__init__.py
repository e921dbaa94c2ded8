"""The comparison: per-step and per-tensor checks between sides, and where each tolerance comes from.

  tolerances.py  every tolerance with its derivation or measurement
  checks.py      scalar (loss, grad norm, lr) and parameter checks, the bf16/fp16 noise envelope, the verdict
"""
