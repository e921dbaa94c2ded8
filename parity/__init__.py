"""parity: PyTorch/DeepSpeed and JAX/Flax training side by side, with numerical parity checks.

This package is the shared contract and imports neither jax nor torch.
"""
from parity.presets import preset, PRESETS
from parity.spec import DeepSpeedPlan, JaxPlan, ModelSpec, RunSpec, SpecError, TrainSpec
from parity.data import DataError


def compare(*args, **kwargs):
  """Runs a comparison and returns its Report; see `parity.pipeline.compare.compare`."""
  from parity.pipeline.compare import compare as _compare
  return _compare(*args, **kwargs)


def __getattr__(name: str):
  """`parity.run_comparison` and `parity.RunOptions` (parity.pipeline.compare), imported on first use: the pipeline's resolved form."""
  if name in ("run_comparison", "RunOptions"):
    from parity.pipeline import compare as api
    return getattr(api, name)
  raise AttributeError(f"module 'parity' has no attribute {name!r}")


__all__ = ["compare", "run_comparison", "RunOptions", "ModelSpec", "TrainSpec", "JaxPlan", "DeepSpeedPlan", "RunSpec", "SpecError", "DataError",
           "PRESETS", "preset"]
