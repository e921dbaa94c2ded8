"""parity: PyTorch/DeepSpeed and JAX/Flax training side by side, with numerical parity checks.

This package is the shared contract and imports neither jax nor torch.
"""
from parity.presets import preset, PRESETS
from parity.spec import DeepSpeedPlan, JaxPlan, ModelSpec, RunSpec, SpecError, TrainSpec
from parity.data import DataError


def compare(preset: str | None = None, **keywords):
  """Runs a comparison and returns its Report: `parity.pipeline.compare.compare` (its keywords: resolve_run's
  parameters and RunOptions' fields; an unknown one raises TypeError naming it and the valid ones).

  Imported on first use, like `run_comparison` and `RunOptions`: every worker imports parity.spec, and so this
  package, and must not load the pipeline, the harness and the report with it."""
  from parity.pipeline.compare import compare as _compare
  return _compare(preset, **keywords)


def __getattr__(name: str):
  """`parity.run_comparison` and `parity.RunOptions` (parity.pipeline.compare), imported on first use (see
  `compare`): the pipeline's resolved form."""
  if name in ("run_comparison", "RunOptions"):
    from parity.pipeline import compare as api
    return getattr(api, name)
  raise AttributeError(f"module 'parity' has no attribute {name!r}")


__all__ = ["compare", "run_comparison", "RunOptions", "ModelSpec", "TrainSpec", "JaxPlan", "DeepSpeedPlan", "RunSpec",
           "SpecError", "DataError",
           "PRESETS", "preset"]
