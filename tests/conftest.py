"""Shared fixtures: tiny run folders built with the real contract code."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))


def _has(mod: str) -> bool:
  import importlib.util
  return importlib.util.find_spec(mod) is not None


HAS_JAX = _has("jax") and _has("flax") and _has("optax")
HAS_TORCH = _has("torch")
HAS_DEEPSPEED = HAS_TORCH and _has("deepspeed")
requires_jax = pytest.mark.skipif(not HAS_JAX, reason="jax/flax/optax not installed")
requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
requires_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed")
requires_all = pytest.mark.skipif(not (HAS_JAX and HAS_DEEPSPEED), reason="needs jax, torch and deepspeed")


@pytest.fixture
def tiny_run_dir(tmp_path):
  """A prepared run folder for the gpt2-tiny preset (few steps), with a factory for variants."""
  from parity.run import prepare_run_dir, resolve

  def make(steps: int = 4, overrides=(), perturb=None, sides=None):
    spec = resolve("gpt2-tiny", steps=steps, overrides=overrides, sides=sides)
    rd = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    prepare_run_dir(spec, rd, perturb=perturb or {})
    return rd, spec
  return make
