"""Masks CPU features in every Python process the suite starts, so one machine can run the suite as a CPU that lacks
them would (docs/testing.md, "Masked CPU features"). Active only with this folder first on PYTHONPATH, which is how
the suite's masked runs start; PARITY_CPU_MASK names what to mask (comma-separated):

  fp16   DeepSpeed's CPU accelerator reports fp16 unsupported (`CPU_Accelerator.is_fp16_supported` -> False), as
         it does on a CPU without AVX512-FP16 / AMX-FP16, whatever this CPU has.

The vector-width mask needs no code: ATEN_CPU_CAPABILITY=avx2, NPY_DISABLE_CPU_FEATURES and
XLA_FLAGS=--xla_cpu_max_isa=AVX2 are read by torch, numpy and XLA themselves (tests/cpu_masks/run).
Imports nothing heavy: the patch is applied when DeepSpeed's CPU accelerator module is first imported, so a process
that never imports DeepSpeed (a JAX worker) is untouched.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

MASKS = frozenset(m.strip() for m in os.environ.get("PARITY_CPU_MASK", "").split(",") if m.strip())
TARGET = "deepspeed.accelerator.cpu_accelerator"


def mask_fp16(module) -> None:
  """DeepSpeed's CPU accelerator, as on a CPU without fp16: is_fp16_supported() False, float16 not listed."""
  module.CPU_Accelerator.is_fp16_supported = lambda self: False


class _PatchOnImport(importlib.abc.MetaPathFinder):
  """Finds TARGET with the other finders, then runs `mask_fp16` on the module right after it executes."""

  def find_spec(self, name, path=None, target=None):
    if name != TARGET:
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
      return spec
    loader = spec.loader
    real_exec = loader.exec_module

    def exec_module(module):
      real_exec(module)
      mask_fp16(module)

    loader.exec_module = exec_module
    return spec


if "fp16" in MASKS:
  sys.meta_path.insert(0, _PatchOnImport())
